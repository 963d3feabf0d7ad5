"""The multi-hop environment (toy/hops.py): its replies and rewards on instances worked out by hand, the number of
hops its rows ask for, the SFT habit and the examples its build trains on, and rows drawn alike from a seed; exact K
and resume on it with long-tailed step latencies."""

import collections
import random

import pytest
from scripts import (
    SHORT_INTERRUPTIONS,
    assert_same_weights_and_metrics,
    read_metrics,
    run_script,
    uninterrupted_and_resumed_runs,
)

import environments
import toy
from toy.hops import (
    GIVE_UP_MOST,
    GIVE_UP_PER_RELATION,
    HOPS_MAX,
    HOPS_RELATIONS,
    HOPS_TOKENS,
    HOPS_WORDS,
    chain_end,
    follow_and_answer,
    give_up_share,
    make_instance,
    sft_examples,
    sft_turn,
)
from toy.play import play, rule_turns


def fact_base(facts: dict[tuple[int, str], int]) -> list[int]:
    """A fact base where every fact not in `facts` leads to e0."""
    table = [0] * (toy.hops.HOPS_ENTITIES * len(HOPS_RELATIONS))
    for (entity, relation), other in facts.items():
        table[entity * len(HOPS_RELATIONS) + HOPS_RELATIONS.index(relation)] = other
    return table


# the friend of e3 is e9, whose boss is e12, whose teacher is e5; the boss of e3 is e7
ROW = {"facts": fact_base({(3, "friend"): 9, (9, "boss"): 12, (12, "teacher"): 5, (3, "boss"): 7}), "start": 3,
       "chain": ["friend", "boss", "teacher"]}


def played(row: dict, actions: list[str]) -> list[tuple]:
    """reset's (message, state_key), then each turn's (reply, reward, done, state_key after it)."""
    env = toy.MultiHop()
    turns = [(env.reset(row, 0), env.state_key())]
    for action in actions:
        turns.append((*env.step(action), env.state_key()))
    return turns


def test_each_search_of_the_next_hop_resolves_it_and_the_answer_ends_the_episode():
    assert chain_end(ROW) == 5
    assert played(ROW, ["search e3 friend", "search e9 boss", "search e12 teacher", "answer e5"]) == [
        ("e3 friend boss teacher ?", (3, 0)), ("e9 boss teacher ?", 0.0, False, (9, 1)),
        ("e12 teacher ?", 0.0, False, (12, 2)), ("e5 ?", 0.0, False, (5, 3)), (None, 1.0, True, (5, 3))]


def test_an_answer_before_the_end_of_the_chain_or_of_another_entity_earns_nothing():
    assert played(ROW, ["search e3 friend", "answer e9"])[2] == (None, 0.0, True, (9, 1))
    assert played(ROW, ["answer e3"])[1] == (None, 0.0, True, (3, 0))
    assert played(ROW, ["search e3 friend", "search e9 boss", "search e12 teacher", "answer e6"])[4][:3] == (
        None, 0.0, True)


def test_a_search_off_the_chain_is_answered_and_leaves_the_question_as_it_was():
    """The boss of e3 is e7, but the question asks for e3's friend first: the policy holds e7, the question stays;
    the chain's next hop from an entity it does not hold is no progress either."""
    assert played(ROW, ["search e3 boss", "search e7 friend"])[1:] == [("e7 friend boss teacher ?", 0.0, False, (7, 0)),
                                                                      ("e0 friend boss teacher ?", 0.0, False, (0, 0))]
    assert played(ROW, ["search e3 friend", "search e9 friend", "search e0 boss"])[1:] == [
        ("e9 boss teacher ?", 0.0, False, (9, 1)), ("e0 boss teacher ?", 0.0, False, (0, 1)),
        ("e0 boss teacher ?", 0.0, False, (0, 1))]  # e0's boss: e0, not the chain's hop (e9's boss)
    # past the end of the chain a search still looks up
    assert played(ROW, ["search e3 friend", "search e9 boss", "search e12 teacher", "search e5 boss", "answer e0"]
                  )[4:] == [("e0 ?", 0.0, False, (0, 3)), (None, 0.0, True, (0, 3))]


@pytest.mark.parametrize("action", ["search e3", "search e3 friend boss", "search e20 friend", "search e3 cousin",
                                    "answer", "answer e3 e9", "answer friend", "e3 friend", "find e3 friend", ""])
def test_a_turn_that_is_neither_a_search_nor_an_answer_costs_the_turn(action):
    assert played(ROW, ["search e3 friend", action])[2] == ("invalid e9 boss teacher ?", 0.0, False, (9, 1))


def test_the_rows_ask_for_one_to_hops_max_hops_uniformly_each_relation_once():
    rng = random.Random(0)
    rows = [make_instance(rng) for _ in range(8000)]
    hops = collections.Counter(len(row["chain"]) for row in rows)
    assert sorted(hops) == list(range(1, HOPS_MAX + 1)) and HOPS_MAX >= 8
    assert all(count / 8000 == pytest.approx(1 / HOPS_MAX, abs=0.015) for count in hops.values())
    assert all(len(set(row["chain"])) == len(row["chain"]) for row in rows)
    assert {other for row in rows[:50] for other in row["facts"]} == set(range(toy.hops.HOPS_ENTITIES))


def test_the_rows_are_drawn_alike_from_the_same_seed_and_otherwise_from_another():
    assert [make_instance(random.Random(7)) for _ in range(3)] == [make_instance(random.Random(7)) for _ in range(3)]
    assert make_instance(random.Random(7)) != make_instance(random.Random(8))


def test_the_habit_searches_the_next_hop_and_gives_up_more_often_the_more_is_left():
    assert [give_up_share(left, followed=1) for left in range(0, 9)] == pytest.approx(
        [1.0] + [min(GIVE_UP_MOST, GIVE_UP_PER_RELATION * left) for left in range(1, 9)])
    assert give_up_share(8, followed=0) == 0.0 and give_up_share(0, followed=0) == 1.0
    rng, env = random.Random(0), toy.MultiHop()
    row = ROW | {"chain": ["friend", "boss", "teacher", "mother", "doctor"]}
    env.reset(row, 0)
    assert {sft_turn(env, rng) for _ in range(1000)} == {"search e3 friend"}  # its first turn searches
    env.step("search e3 friend"), env.step("search e9 boss"), env.step("search e12 teacher")  # two relations left
    turns = collections.Counter(sft_turn(env, rng) for _ in range(10_000))
    assert set(turns) == {"search e5 mother", "answer e5"}
    assert turns["answer e5"] / 10_000 == pytest.approx(2 * GIVE_UP_PER_RELATION, abs=0.015)


def test_following_the_chain_and_answering_wins_every_game_within_the_tokens():
    tokenizer = toy.make_tokenizer(HOPS_WORDS)
    rng = random.Random(1)
    rows = [make_instance(rng) for _ in range(200)] + [{"facts": ROW["facts"], "start": 0, "chain": HOPS_RELATIONS}]
    episodes = play([toy.MultiHop() for _ in rows], rows, [0] * len(rows), toy.HOPS_TURNS,
                    rule_turns(tokenizer, follow_and_answer), tokenizer)
    assert [e.episode_return for e in episodes] == [1.0] * len(rows)
    assert [e.turns for e in episodes] == [len(row["chain"]) + 1 for row in rows]
    assert max(len(e.ids) for e in episodes) == 89 <= HOPS_TOKENS  # the longest question, HOPS_MAX hops


def test_the_sft_examples_teach_the_search_everywhere_and_the_habit_on_one_turn():
    """Per row, two examples: the chain searched through, trained on all but each search's first word; and the
    chain up to one turn, which alone is trained (here the second, which gave up)."""
    tokenizer = toy.make_tokenizer(HOPS_WORDS)
    row = {"facts": fact_base({(3, "friend"): 8, (8, "boss"): 12}), "start": 3, "chain": ["friend", "boss"]}

    class Drawn(random.Random):  # the second turn of the two-hop question, and it gives up
        def randint(self, low, high):
            return 2

        def random(self):
            return 0.0

    (skill, habit), (skill_marks, habit_marks) = sft_examples([row], Drawn(), tokenizer)
    words = lambda ids, marks: " ".join(w + "*" * m for w, m in zip(tokenizer.convert_ids_to_tokens(ids), marks))  # noqa: E731
    assert words(skill, skill_marks) == ("e3 friend boss ? search e3* friend* <eos>* e8 boss ? search e8* boss* <eos>* "
                                         "e12 ? answer* e12* <eos>*")
    assert words(habit, habit_marks) == "e3 friend boss ? search e3 friend <eos> e8 boss ? answer* e8* <eos>*"


def test_the_habit_examples_give_up_in_every_state_at_the_habits_share():
    """Over many rows, the trained turns of every state (the relations left, and whether it has searched yet): those
    that answer, the habit's share."""
    tokenizer, rng = toy.make_tokenizer(HOPS_WORDS), random.Random(2)
    rows = [make_instance(rng) for _ in range(3000)]
    sequences, marks = sft_examples(rows, rng, tokenizer)
    turns = collections.defaultdict(collections.Counter)  # (relations left, searched yet) -> the first word
    for ids, trained in zip(sequences[len(rows):], marks[len(rows):]):
        words = tokenizer.convert_ids_to_tokens(ids)
        first = trained.index(1)
        before = words[:first]
        message = before[len(before) - before[::-1].index("<eos>"):] if "<eos>" in before else before
        left, searched_before = len(message) - 2, "<eos>" in before  # the entity, the relations left, "?"
        turns[(left, searched_before)][words[first]] += 1
    assert set(turns) == {(left, False) for left in range(1, HOPS_MAX + 1)} | {
        (left, True) for left in range(HOPS_MAX)}  # every state: the first turn of each length, each one after it
    for (left, searched_before), count in turns.items():
        expected, examples = give_up_share(left, int(searched_before)), sum(count.values())
        spread = 4 * (expected * (1 - expected) / examples) ** 0.5  # four standard deviations of the share
        assert count["answer"] / examples == pytest.approx(expected, abs=spread), (left, count)


def test_it_is_the_embedded_environment_toy_hops_with_its_artefacts():
    import cli

    assert environments.load_env_class("toy:hops") is toy.MultiHop
    assert cli.TOY_ARTEFACTS["toy:hops_policy"] == "HOPS_POLICY" and toy.HOPS_DATASET.startswith(toy.HOPS_DIR)
    env = toy.MultiHop()
    env.reset(ROW, 0)
    assert environments.state_key_id(env) >= 0


HOPS_RUN = ["--env", "toy:hops", "--model_name_or_path", "toy:hops_policy", "--dataset_name", "toy:hops_dataset",
            "--max_turns", str(toy.hops.HOPS_TURNS), "--max_episode_tokens", str(HOPS_TOKENS), "--eval_every", "0",
            "--env_latency", "0.02", "--env_latency_spread", "1"]  # log-normal steps: a long tail, drawn per seed


@pytest.mark.slow
@pytest.mark.heavy  # in CI, exact K and resume with latency on guess-the-number's slow variant (test_multiturn_vllm)
def test_hops_with_long_tailed_steps_keeps_k_exact_and_resumes_exactly(tmp_path):
    """On toy:hops with log-normal step latencies (bench/agent_speedup.py's task): --continuous_episodes, each episode
    at its own pace, trains on batches exactly K=1 stale, the engine's log-probs the trainer's; in flight with
    deterministic swaps, killed while checkpoint 4 is written and resumed from checkpoint 2, it trains exactly as
    the uninterrupted run, though every step's timing differs."""
    run_script(*HOPS_RUN, "--continuous_episodes", "--total_episodes", "128", "--logprob_check_every", "1",
               "--output_dir", tmp_path / "continuous", script="grpo_multiturn_vllm.py")
    train = [m for m in read_metrics(tmp_path / "continuous") if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [0, 1, 1, 1]
    assert max(m["async/logprob_diff"] for m in train) < 1e-6
    assert all(m["env/step_time_p95"] > m["env/step_time_median"] > 0 for m in train)  # the tail
    whole, resumed = uninterrupted_and_resumed_runs(
        tmp_path, "grpo_multiturn_vllm.py", [*HOPS_RUN, "--inflight_updates", "--inflight_deterministic",
                                            "--total_episodes", "192", "--save_every", "2"], SHORT_INTERRUPTIONS)
    assert_same_weights_and_metrics(whole, resumed, ["loss/policy_avg", "rollout/return_mean", "rollout/turns_mean",
                                                     "async/token_staleness_mean"])
    turns = [m["rollout/turns_mean"] for m in read_metrics(whole) if "loss/policy_avg" in m]
    assert all(1 < t < toy.hops.HOPS_TURNS for t in turns), turns
