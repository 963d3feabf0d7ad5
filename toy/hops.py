"""Multi-hop questions over a small fact base, answered one hop at a time by search (--env toy:hops).

Each row is an instance of its own: a fact base of HOPS_ENTITIES entities (e0, e1, ...) where each entity has one
of each of HOPS_RELATIONS' relations to another entity, drawn at random (so no policy can know a fact without
searching it), and a question, a start entity and a chain of 1 to HOPS_MAX distinct relations to follow from it,
the number of hops uniform. The environment's message is the entity the policy holds and what is still to follow:
"e3 friend boss ?" asks for the boss of the friend of e3. The policy's turn is a search, "search e3 friend", which
the environment answers with the fact and the question left ("e9 boss ?": the friend of e3 is e9; a search that is
not the question's next hop leaves the question as it was), or "answer e7", which ends the episode: reward 1 if e7
is at the end of the chain, else 0. A question of N hops takes N + 1 turns: episodes of 2 to HOPS_MAX + 1 turns.

The SFT policy knows how to search: it follows the next relation from the entity it holds, rightly in every
state. Its fault is in giving up: with relations still to follow, after its first turn (which always searches), it
answers the entity it holds instead, GIVE_UP_PER_RELATION of its turns for each relation left, at most GIVE_UP_MOST
(35% with one left, 70% with two, 99% with three or more). Near-greedy it wins 31% of the validation questions
(every question of one or two hops, 16% of three, about 6% of longer ones: the entity it gives up on is sometimes
the answer), in 2.1 turns; sampled at the scripts' temperature it wins 29%, where searching the chain through wins
all, in 5.5 turns on average. What RL has to learn is to go on searching, one length of question after another: a
question of N hops pays only once the states with fewer relations left search on, so the longer ones are learnt
last, and the episodes grow longer as it learns.
"""

import os
import random
import time

import torch
from datasets import Dataset, DatasetDict

from toy.builder import (
    EOS,
    PAD,
    SMALL_SHAPE,
    UNK,
    built_once,
    cache_folder,
    llama_config,
    make_tokenizer,
    masked_sft_loss,
    parameter_count,
    train,
    untrained_policy,
)
from toy.play import play, policy_turns, rates, rule_turns

HOPS_DIR = cache_folder("hops", __file__, os.path.join(os.path.dirname(__file__), "play.py"))
HOPS_POLICY = os.path.join(HOPS_DIR, "sft_policy")
HOPS_DATASET = os.path.join(HOPS_DIR, "dataset")
HOPS_ENTITIES = 20
HOPS_RELATIONS = ["friend", "boss", "mother", "father", "teacher", "neighbour", "partner", "doctor"]
HOPS_MAX = 8  # a chain's relations are distinct: at most all of them
HOPS_TURNS = HOPS_MAX + 2  # the --max_turns its runs take (ENVIRONMENTS.md): the longest question takes 9
HOPS_TOKENS = 96  # the --max_episode_tokens they take: the longest question, answered, takes 89
GIVE_UP_PER_RELATION = 0.35  # of the SFT policy's turns with r relations left (after its first), r times this give up
GIVE_UP_MOST = 0.99  # ... up to this share
ENTITIES = [f"e{n}" for n in range(HOPS_ENTITIES)]
HOPS_WORDS = [PAD, EOS, UNK, "search", "answer", "?", "invalid", *HOPS_RELATIONS, *ENTITIES]
HOPS_SFT_STEPS = 500


def make_instance(rng: random.Random) -> dict:
    """A row: a random fact base (facts[entity * len(HOPS_RELATIONS) + relation] = the entity it leads to), a start
    entity and a chain of 1 to HOPS_MAX distinct relations (the number of hops uniform)."""
    facts = [rng.randrange(HOPS_ENTITIES) for _ in range(HOPS_ENTITIES * len(HOPS_RELATIONS))]
    chain = rng.sample(HOPS_RELATIONS, rng.randint(1, HOPS_MAX))
    return {"facts": facts, "start": rng.randrange(HOPS_ENTITIES), "chain": chain}


def follow(facts: list[int], entity: int, relation: str) -> int:
    """The entity `relation` of `entity` is in the fact base `facts`."""
    return facts[entity * len(HOPS_RELATIONS) + HOPS_RELATIONS.index(relation)]


def chain_end(row: dict) -> int:
    """The entity the row's question asks for: its chain followed from its start."""
    entity = row["start"]
    for relation in row["chain"]:
        entity = follow(row["facts"], entity, relation)
    return entity


class MultiHop:
    """Multi-hop questions answered by search (toy:hops): the environment contract, with state_key() the entity
    shown and the hops of the chain followed. The row holds the fact base, the start entity and the chain; a turn
    that is neither "search ENTITY RELATION" nor "answer ENTITY" costs the turn ("invalid")."""

    def reset(self, row: dict, seed: int) -> str:
        self.facts, self.chain, self.answer = row["facts"], row["chain"], chain_end(row)
        self.held, self.followed = row["start"], 0  # the entity last shown; the chain's hops done
        self.reached = row["start"]  # the chain's entity after those hops
        return self.message()

    def message(self) -> str:
        return " ".join([f"e{self.held}", *self.chain[self.followed:], "?"])

    def relations_left(self) -> int:
        return len(self.chain) - self.followed

    def state_key(self) -> tuple[int, int]:
        return self.held, self.followed

    def step(self, action: str) -> tuple[str | None, float, bool]:
        words = action.split()
        if len(words) == 2 and words[0] == "answer" and words[1] in ENTITIES:
            return None, float(ENTITIES.index(words[1]) == self.answer), True
        if len(words) != 3 or words[0] != "search" or words[1] not in ENTITIES or words[2] not in HOPS_RELATIONS:
            return "invalid " + self.message(), 0.0, False
        entity, relation = ENTITIES.index(words[1]), words[2]
        self.held = follow(self.facts, entity, relation)
        if self.relations_left() and (entity, relation) == (self.reached, self.chain[self.followed]):  # the next hop
            self.reached, self.followed = self.held, self.followed + 1
        return self.message(), 0.0, False


def give_up_share(relations_left: int, followed: int) -> float:
    """The share of the SFT policy's turns that answer the entity held with `relations_left` relations still to
    follow after `followed` hops: all with none left (rightly), none before its first hop, else
    GIVE_UP_PER_RELATION for each relation left, at most GIVE_UP_MOST."""
    if relations_left == 0 or followed == 0:
        return float(relations_left == 0)
    return min(GIVE_UP_MOST, GIVE_UP_PER_RELATION * relations_left)


def searched_on(env: MultiHop) -> str:
    """The search of the chain's next hop from the entity shown (the SFT policy's, and the policy RL should reach)."""
    return f"search e{env.held} {env.chain[env.followed]}"


def sft_turn(env: MultiHop, rng: random.Random) -> str:
    """The SFT policy's habit: search the next hop, or answer the entity held give_up_share of the time."""
    answers = rng.random() < give_up_share(env.relations_left(), env.followed)
    return f"answer e{env.held}" if answers else searched_on(env)


def follow_and_answer(env: MultiHop) -> str:
    """The policy that wins every game: search the chain through, then answer."""
    return searched_on(env) if env.relations_left() else f"answer e{env.held}"


def turn_starts(by_policy: list[int]) -> list[int]:
    """Where each of an episode's turns starts in its tokens (by play()'s marks of the policy's tokens)."""
    return [i for i, mark in enumerate(by_policy) if mark and not by_policy[i - 1]]


def sft_examples(rows: list[dict], rng: random.Random, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """The SFT examples of `rows`, two per row, as tokens and their marks (1: trained). The skill: the row's chain
    searched through and answered, every token of the policy's trained but each search's first word, so that
    searching is taught in every state and when to give up is not. The habit: the chain searched through up to a
    turn drawn uniformly (the 1st to the N + 1st of N hops), then that turn as sft_turn plays it, its tokens the
    only ones trained: the habit's share of giving up then holds in every state, however rarely the habit itself
    would reach it."""
    envs = [MultiHop() for _ in rows]
    last_turns = [rng.randint(1, len(row["chain"]) + 1) for row in rows]
    last_turn_of = {id(env): last_turn for env, last_turn in zip(envs, last_turns)}

    def habit_at_the_last_turn(env: MultiHop) -> str:  # searched through so far: the turn is the hops followed, + 1
        return sft_turn(env, rng) if env.followed + 1 == last_turn_of[id(env)] else follow_and_answer(env)

    skills = play([MultiHop() for _ in rows], rows, [0] * len(rows), HOPS_TURNS,
                  rule_turns(tokenizer, follow_and_answer), tokenizer)
    habits = play(envs, rows, [0] * len(rows), HOPS_TURNS, rule_turns(tokenizer, habit_at_the_last_turn), tokenizer)
    sequences, marks = [], []
    for skill in skills:
        searches = turn_starts(skill.by_policy)[:-1]  # the last turn answers
        sequences.append(skill.ids)
        marks.append([0 if i in searches else mark for i, mark in enumerate(skill.by_policy)])
    for habit, last_turn in zip(habits, last_turns):
        start = turn_starts(habit.by_policy)[last_turn - 1]
        end = next((i for i in range(start, len(habit.ids)) if not habit.by_policy[i]), len(habit.ids))
        sequences.append(habit.ids[:end])  # up to the environment's reply to that turn, or the episode's end
        marks.append([0] * start + [1] * (end - start))
    return sequences, marks


def build_hops(seed: int = 0) -> None:
    """Build the multi-hop environment's policy and rows into HOPS_DIR unless they are there."""
    built_once(HOPS_DIR, make_hops, seed, "the multi-hop environment")


def make_hops(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """Rows (the instances) and the SFT policy of the multi-hop environment into `folder`; returns what the policy
    and two rules win on the validation rows, the policy greedy and sampled at the scripts' temperature (0.7), and
    the policy's greedy return by the question's number of hops."""
    splits = DatasetDict({split: Dataset.from_list([make_instance(rng) for _ in range(size)])
                          for split, size in [("train", 4096), ("validation", 256)]})
    splits.save_to_disk(os.path.join(folder, "dataset"))
    tokenizer = make_tokenizer(HOPS_WORDS)
    policy = untrained_policy(llama_config(len(HOPS_WORDS), SMALL_SHAPE, tokenizer, max_positions=128), tokenizer)
    train_rows = list(splits["train"])

    def loss_of_batch(batch_size: int = 32) -> torch.Tensor:
        sequences, marks = sft_examples(rng.sample(train_rows, batch_size), rng, tokenizer)
        return masked_sft_loss(policy, sequences, marks, tokenizer.pad_token_id)

    loss = train(policy, loss_of_batch, steps=HOPS_SFT_STEPS, lr=3e-3)
    print(f"toy: multi-hop SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    return measure(policy, tokenizer, list(splits["validation"]), seed) | {"policy_parameters": parameter_count(policy)}


def measure(policy, tokenizer, rows: list[dict], seed: int) -> dict:
    """What the policy (greedy and sampled at 0.7), its habit and follow_and_answer win on `rows`, and the greedy
    policy's return on the questions of each number of hops."""
    habit_rng = random.Random(seed)
    numbers = {}
    for who, act in (("sft_greedy", policy_turns(policy, tokenizer, 4)),
                     ("sft_sampled", policy_turns(policy, tokenizer, 4, temperature=0.7)),
                     ("sft_habit", rule_turns(tokenizer, lambda env: sft_turn(env, habit_rng))),
                     ("follow_and_answer", rule_turns(tokenizer, follow_and_answer))):
        played = play([MultiHop() for _ in rows], rows, list(range(len(rows))), HOPS_TURNS, act, tokenizer)
        numbers |= {f"{who}_{what}": round(value, 3) for what, value in rates(played).items()}
        if who == "sft_greedy":
            for hops in range(1, HOPS_MAX + 1):
                of_hops = [e.episode_return for e, row in zip(played, rows) if len(row["chain"]) == hops]
                numbers[f"sft_greedy_return_{hops}_hops"] = round(sum(of_hops) / max(len(of_hops), 1), 3)
    return numbers
