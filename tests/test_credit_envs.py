"""The environments where credit per turn matters (toy/probe.py, toy/lake.py): their states, replies and rewards
on games worked out by hand, the shaping that changes no best policy, slips replayed from the reset seed, the SFT
habits their policies imitate, and the tokens their builds train on."""

import random

import pytest

import environments
import toy
from toy.lake import LAKE_SLIP, SHORTEST_PATH, best_win_chances, moved, sft_move
from toy.play import play, rule_turns
from toy.probe import ANSWER_SHARE, EARLY_SHARE, PROBE_RANGE, PROBE_WORDS, sft_probe


def played(env, row: dict, actions: list[str], seed: int = 0) -> list[tuple]:
    """Each turn's (reply, reward, done, state_key after it), after reset's (message, state_key)."""
    turns = [(env.reset(row, seed), env.state_key())]
    for action in actions:
        turns.append((*env.step(action), env.state_key()))
    return turns


def rewards(env, row: dict, actions: list[str]) -> list[float]:
    return [turn[1] for turn in played(env, row, actions)[1:]]


def test_probes_narrow_the_numbers_still_possible_and_an_answer_ends_the_game():
    turns = played(toy.ProbeAnswer(), {"secret": 11}, ["8", "5", "12", "10", "answer 11"])
    assert turns == [("find the number from 1 to 15 :", (1, 15)),
                     ("higher :", 0.0, False, (9, 15)),
                     ("higher :", 0.0, False, (9, 15)),  # below what is still possible: nothing learnt
                     ("lower :", 0.0, False, (9, 11)),
                     ("higher :", 0.0, False, (11, 11)),
                     (None, 1.0, True, (11, 11))]
    assert played(toy.ProbeAnswer(), {"secret": 11}, ["answer 10"])[1][:3] == (None, 0.0, True)
    assert played(toy.ProbeAnswer(), {"secret": 4}, ["4", "answer 4"])[1:] == [("equal :", 0.0, False, (4, 4)),
                                                                              (None, 1.0, True, (4, 4))]


@pytest.mark.parametrize("action", ["answer", "answer 16", "answer 0", "16", "0", "8 9", "answer 3 4", "equal", ""])
def test_a_turn_that_is_neither_a_probe_nor_an_answer_costs_the_turn(action):
    for env in (toy.ProbeAnswer(), toy.ProbeAnswerShaped()):
        assert played(env, {"secret": 11}, ["8", action])[2] == ("invalid :", 0.0, False, (9, 15))


def test_the_shaping_pays_each_probe_the_range_it_rules_out_and_the_answer_what_was_left():
    """Of the 14 steps from 1 to 15: 8 ruled out by the first probe (9-15 left), 4 by the second (9-11), 2 by the
    third (11); a probe outside what is still possible rules out nothing; the answer earns what was open."""
    shaped = toy.ProbeAnswerShaped()
    assert rewards(shaped, {"secret": 11}, ["8", "5", "12", "10", "answer 11"]) == pytest.approx(
        [8 / 14, 0, 4 / 14, 2 / 14, 1 + 0])
    assert rewards(shaped, {"secret": 11}, ["8", "answer 9"]) == pytest.approx([8 / 14, 0 + 6 / 14])  # 9-15 open
    # "equal" leaves one number: the 14 steps ruled out at once
    assert rewards(shaped, {"secret": 4}, ["4", "4", "answer 4"]) == pytest.approx([1, 0, 1])
    # cut off here by the turns: 13 / 14 collected
    assert rewards(shaped, {"secret": 11}, ["8", "12", "9"]) == pytest.approx([8 / 14, 4 / 14, 1 / 14])


def test_the_shaping_of_every_answered_episode_is_1_and_of_a_cut_off_one_less():
    """Potential-based: whatever an episode probes, its shaping telescopes to Phi(end) - Phi(start), 1 when it
    answers; one cut off before answering collects 1 - (high - low) / 14. Random games of random turns."""
    rng = random.Random(0)
    for _ in range(500):
        secret, actions = rng.randint(1, PROBE_RANGE), []
        while len(actions) < 6 and not (actions and actions[-1].startswith("answer")):
            actions.append(rng.choice([str(rng.randint(1, PROBE_RANGE)), f"answer {rng.randint(1, PROBE_RANGE)}",
                                       "invalid"]))
        sparse = played(toy.ProbeAnswer(), {"secret": secret}, actions)
        shaped = played(toy.ProbeAnswerShaped(), {"secret": secret}, actions)
        assert [turn[0] for turn in sparse] == [turn[0] for turn in shaped]  # the same replies
        shaping = sum(turn[1] for turn in shaped[1:]) - sum(turn[1] for turn in sparse[1:])
        low, high = shaped[-1][-1]
        assert shaping == pytest.approx(1 if shaped[-1][2] else 1 - (high - low) / 14), actions


def test_the_probe_habit_bisects_and_answers_a_known_secret_only_sometimes():
    env, rng = toy.ProbeAnswer(), random.Random(0)
    env.reset({"secret": 11}, 0)
    before = [sft_probe(env, rng) for _ in range(10_000)]
    env.step("8"), env.step("12"), env.step("10")  # 11 known
    known = [sft_probe(env, rng) for _ in range(10_000)]
    assert set(before) == {"8", "answer 8"} and set(known) == {"11", "answer 11"}
    assert before.count("answer 8") / 10_000 == pytest.approx(EARLY_SHARE, abs=0.015)
    assert known.count("answer 11") / 10_000 == pytest.approx(ANSWER_SHARE, abs=0.015)


def test_the_builds_play_the_scripts_tokens():
    """play(), which makes the SFT episodes: the first message, each turn and its stop token (the policy's), each
    reply (the environment's), as the multi-turn scripts build an episode without a chat template."""
    tokenizer = toy.make_tokenizer(PROBE_WORDS)
    bisect_and_answer = lambda env: f"answer {env.low}" if env.low == env.high else str((env.low + env.high) // 2)  # noqa: E731
    high, low = play([toy.ProbeAnswer(), toy.ProbeAnswer()], [{"secret": 11}, {"secret": 2}], [0, 0], 3,
                     rule_turns(tokenizer, bisect_and_answer), tokenizer)
    assert tokenizer.decode(high.ids) == "find the number from 1 to 15 : 8 <eos> higher : 12 <eos> lower : 10 <eos>"
    assert tokenizer.decode(low.ids) == "find the number from 1 to 15 : 8 <eos> lower : 4 <eos> lower : 2 <eos>"
    assert low.by_policy == [0] * 8 + [1, 1] + [0, 0] + [1, 1] + [0, 0] + [1, 1]
    assert (high.turns, high.episode_return, high.done) == (3, 0.0, False)  # cut off before it answers
    answered = play([toy.ProbeAnswer()], [{"secret": 2}], [0], 4, rule_turns(tokenizer, bisect_and_answer),
                    tokenizer)[0]
    assert tokenizer.decode(answered.ids).endswith("2 <eos> equal : answer 2 <eos>")
    assert (answered.turns, answered.episode_return, answered.done) == (4, 1.0, True)


def test_the_lake_is_frozenlakes_4x4_map():
    """SFFF / FHFH / FFFH / HFFG, cells numbered row by row: holes at 5, 7, 11 and 12, the goal at 15."""
    turns = played(toy.FrozenLake(), {"start": 0}, ["left", "up", "down", "down", "right", "down", "right", "right"])
    assert turns == [("lake 0 :", 0), ("0 :", 0.0, False, 0), ("0 :", 0.0, False, 0), ("4 :", 0.0, False, 4),
                     ("8 :", 0.0, False, 8), ("9 :", 0.0, False, 9), ("13 :", 0.0, False, 13),
                     ("14 :", 0.0, False, 14), (None, 1.0, True, 15)]
    for start, move, hole in [(4, "right", 5), (1, "down", 5), (3, "down", 7), (6, "right", 7), (10, "right", 11),
                              (8, "down", 12), (13, "left", 12)]:
        assert played(toy.FrozenLake(), {"start": start}, [move])[1] == (None, 0.0, True, hole)
    assert played(toy.FrozenLake(), {"start": 3}, ["right", "up"])[1:] == [("3 :", 0.0, False, 3)] * 2  # the walls
    assert played(toy.FrozenLake(), {"start": 14}, ["jump", "left left", "right"])[1:] == [
        ("invalid 14 :", 0.0, False, 14), ("invalid 14 :", 0.0, False, 14), (None, 1.0, True, 15)]


def test_the_shortest_paths_reach_the_goal_from_every_start():
    assert SHORTEST_PATH == {0: "down", 1: "right", 2: "down", 3: "left", 4: "down", 6: "down", 8: "right",
                             9: "down", 10: "down", 13: "right", 14: "right"}
    lengths = {}
    for start in SHORTEST_PATH:
        cell, moves = start, 0
        while cell != 15:
            cell, moves = moved(cell, SHORTEST_PATH[cell]), moves + 1
        lengths[start] = moves
    assert lengths == {0: 6, 1: 5, 2: 4, 3: 5, 4: 5, 6: 3, 8: 4, 9: 3, 10: 2, 13: 2, 14: 1}


def test_the_best_chances_are_the_shortest_paths_and_on_the_slippery_lake_worked_out_by_hand():
    """Not slippery: 1 wherever a shortest path is short enough. Slippery, from 14 (G right of it): with one move,
    right, 2/3 (a slip goes up to 10 or down against the wall); with two, right again, 2/3 + 1/6 (slipped down, still
    on 14) x 2/3 = 7/9 (down would give 2/3 x 2/3 + 1/6, the slip right, = 11/18)."""
    distances = {0: 6, 1: 5, 2: 4, 3: 5, 4: 5, 6: 3, 8: 4, 9: 3, 10: 2, 13: 2, 14: 1}
    assert best_win_chances(0.0, 3) == {cell: float(distance <= 3) for cell, distance in distances.items()}
    assert best_win_chances(1 / 3, 1) == pytest.approx({cell: 2 / 3 if cell == 14 else 0.0 for cell in distances})
    assert best_win_chances(1 / 3, 2)[14] == pytest.approx(7 / 9)


def test_the_lake_habit_takes_a_shortest_path_sometimes_and_else_goes_right():
    env, rng = toy.FrozenLake(), random.Random(0)
    env.reset({"start": 9}, 0)
    moves = [sft_move(env, rng) for _ in range(10_000)]
    assert set(moves) == {"down", "right"} and moves.count("down") / 10_000 == pytest.approx(0.4, abs=0.015)


def test_the_slippery_lake_slips_to_a_side_a_third_of_the_time():
    """From 9, "down" goes to 13, or slips left to 8 or right to 10 (a sixth each), never up into the hole at 5;
    the lake that is not slippery never slips."""
    cells = [played(toy.FrozenLakeSlippery(), {"start": 9}, ["down"], seed)[1][3] for seed in range(6000)]
    assert set(cells) == {8, 10, 13}
    assert [cells.count(cell) / 6000 for cell in (8, 10)] == pytest.approx([LAKE_SLIP / 2] * 2, abs=0.015)
    assert {played(toy.FrozenLake(), {"start": 9}, ["down"], seed)[1][3] for seed in range(100)} == {13}


def test_the_slips_replay_from_the_reset_seed():
    """The contract: the same row, seed and moves give the same cells (a resumed run replays its episodes);
    another seed, other slips."""
    moves = ["right", "down", "left", "down", "right", "up", "right", "down", "left", "down"]
    histories = {seed: [played(toy.FrozenLakeSlippery(), {"start": 0}, moves, seed) for _ in range(2)]
                 for seed in range(20)}
    assert all(first == again for first, again in histories.values())
    assert len({repr(first) for first, _ in histories.values()}) > 10


@pytest.mark.parametrize("name", ["probe_answer", "probe_answer_shaped", "lake", "lake_slippery"])
def test_each_is_an_embedded_environment_with_a_state_key(name):
    env_class = environments.load_env_class(f"toy:{name}")
    env = env_class()
    env.reset({"secret": 3, "start": 0}, 0)
    assert environments.state_key_id(env) >= 0
