"""A small grid world with a sparse goal (--env toy:lake, toy:lake_slippery): FrozenLake's 4x4 map (gymnasium's
"4x4", below), the start cell from the dataset row, the policy's turn a move (left, down, right or up; a move off the
grid stays), reward 1 on reaching the goal G and 0 on every other turn, the episode over on a hole H or the goal. The
environment tells the policy its cell after each move. Cells repeat across episodes and within them, so GiGPO's
anchor states (--turn_advantage gigpo) are the cells (state_key()).

On the slippery lake a move goes the way the policy said with probability 1 - LAKE_SLIP, else to one side of it
(half each): a third of the moves slip, half of gymnasium's two thirds, so that within LAKE_TURNS the best policy
wins about 0.6 of the episodes (with gymnasium's slips, 0.23) and there is room above the SFT policy. The slips are
drawn from the episode's reset seed: the same row, seed and moves give the same cells, as the environment contract
asks (a resumed run replays its episodes), and a group's k episodes (one row and seed) slip alike on the same turn.

The SFT policy knows the map: in each cell it takes a move of a shortest path to G LAKE_PATH_SHARE of the time, and
else its habit, right. Near-greedy it goes right everywhere, into a hole or against the east wall, and wins only
from the cells the goal is right of (about 17% of the episodes, in LAKE_TURNS turns); sampled at the scripts'
temperature it wins about 38% (the slippery lake: 30%, where the best policy wins 60%)."""

import os
import random
import time
from collections import deque

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
    parameter_count,
    train,
    untrained_policy,
)
from toy.play import play, policy_turns, rates, rule_turns, sft_loss_of_batch

LAKE_DIR = cache_folder("lake", __file__, os.path.join(os.path.dirname(__file__), "play.py"))
LAKE_POLICY = os.path.join(LAKE_DIR, "sft_policy")
LAKE_DATASET = os.path.join(LAKE_DIR, "dataset")
LAKE_MAP = ("SFFF",
            "FHFH",
            "FFFH",
            "HFFG")  # cell = 4 * row + column
SIDE = len(LAKE_MAP)
STARTS = [cell for cell, square in enumerate("".join(LAKE_MAP)) if square in "SF"]
MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}  # gymnasium's order, clockwise
LAKE_TURNS = 10  # the --max_turns its runs take (ENVIRONMENTS.md): the longest shortest path takes 6
LAKE_SLIP = 1 / 3  # the share of the slippery lake's moves that go to a side
LAKE_PATH_SHARE = 0.4  # of the SFT policy's moves, those along a shortest path (the rest: right)
LAKE_WORDS = [PAD, EOS, UNK, "lake", ":", "invalid", *MOVES, *(str(cell) for cell in range(SIDE * SIDE))]
LAKE_SFT_STEPS = 300


def moved(cell: int, move: str) -> int:
    """The cell a move leads to from `cell` (a move off the grid stays)."""
    row, column = divmod(cell, SIDE)
    down, right = MOVES[move]
    return min(max(row + down, 0), SIDE - 1) * SIDE + min(max(column + right, 0), SIDE - 1)


def square(cell: int) -> str:
    """What is on `cell`: S (the usual start), F (frozen), H (a hole) or G (the goal)."""
    return LAKE_MAP[cell // SIDE][cell % SIDE]


def sides(move: str) -> tuple[str, str]:
    """The two moves at right angles to `move`, where a slip takes it."""
    clockwise = list(MOVES)
    at = clockwise.index(move)
    return clockwise[at - 1], clockwise[(at + 1) % len(clockwise)]


def best_win_chances(slip: float, turns: int) -> dict[int, float]:
    """Each start cell's highest chance of reaching the goal within `turns` moves when `slip` of them go to a side
    (value iteration, one move at a time)."""
    chance = dict.fromkeys(STARTS, 0.0)  # with no move left
    worth = lambda cell: 1.0 if square(cell) == "G" else chance.get(cell, 0.0)  # noqa: E731  (a hole's: 0)
    for _ in range(turns):
        chance = {cell: max((1 - slip) * worth(moved(cell, move))
                            + sum(slip / 2 * worth(moved(cell, side)) for side in sides(move)) for move in MOVES)
                  for cell in STARTS}
    return chance


def shortest_path_moves() -> dict[int, str]:
    """Each start cell's first move of a shortest path to the goal that steps on no hole (the first such move in
    MOVES' order), from a breadth-first search back from the goal."""
    goal = SIDE * SIDE - 1
    distance, frontier = {goal: 0}, deque([goal])
    while frontier:
        cell = frontier.popleft()
        for before in STARTS:
            if before not in distance and any(moved(before, move) == cell for move in MOVES):
                distance[before] = distance[cell] + 1
                frontier.append(before)
    return {cell: next(move for move in MOVES if distance.get(moved(cell, move)) == distance[cell] - 1)
            for cell in STARTS}


SHORTEST_PATH = shortest_path_moves()


class FrozenLake:
    """The grid world (toy:lake): the environment contract, with state_key() the cell. The row holds the start
    cell; a turn that is not one move costs the turn ("invalid")."""

    slip = 0.0  # FrozenLakeSlippery: LAKE_SLIP

    def reset(self, row: dict, seed: int) -> str:
        self.cell, self.rng = row["start"], random.Random(seed)
        return f"lake {self.cell} :"

    def state_key(self) -> int:
        return self.cell

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if action.strip() not in MOVES:
            return f"invalid {self.cell} :", 0.0, False
        move = action.strip()
        if self.slip and self.rng.random() < self.slip:
            move = self.rng.choice(sides(move))
        self.cell = moved(self.cell, move)
        if square(self.cell) in "HG":
            return None, float(square(self.cell) == "G"), True
        return f"{self.cell} :", 0.0, False


class FrozenLakeSlippery(FrozenLake):
    """The slippery grid world (toy:lake_slippery): LAKE_SLIP of the moves go to a side, drawn from the reset seed."""

    slip = LAKE_SLIP


def sft_move(env: FrozenLake, rng: random.Random) -> str:
    """The SFT policy's habit: a shortest path's move LAKE_PATH_SHARE of the time, else right."""
    return SHORTEST_PATH[env.cell] if rng.random() < LAKE_PATH_SHARE else "right"


def build_lake(seed: int = 0) -> None:
    """Build the grid worlds' policy and rows into LAKE_DIR unless they are there."""
    built_once(LAKE_DIR, make_lake, seed, "the grid worlds")


def make_lake(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """Rows (the start cells) and the SFT policy of the grid worlds into `folder`; returns what the policy and two
    rules win on the validation rows of each lake, the policy greedy and sampled at the scripts' temperature (0.7), and
    the best policy's expected return there."""
    splits = DatasetDict({split: Dataset.from_dict({"start": [rng.choice(STARTS) for _ in range(size)]})
                          for split, size in [("train", 4096), ("validation", 256)]})
    splits.save_to_disk(os.path.join(folder, "dataset"))
    tokenizer = make_tokenizer(LAKE_WORDS)
    policy = untrained_policy(llama_config(len(LAKE_WORDS), SMALL_SHAPE, tokenizer, max_positions=64), tokenizer)
    train_rows = list(splits["train"])
    habit = rule_turns(tokenizer, lambda env: sft_move(env, rng))

    loss_of_batch = sft_loss_of_batch(FrozenLake, train_rows, LAKE_TURNS, habit, policy, tokenizer, rng)
    loss = train(policy, loss_of_batch, steps=LAKE_SFT_STEPS, lr=3e-3)
    print(f"toy: grid-world SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    rows = list(splits["validation"])
    habit_rng = random.Random(seed)
    numbers = {}
    for lake, env_class in (("lake", FrozenLake), ("slippery", FrozenLakeSlippery)):
        for who, act in (("sft_greedy", policy_turns(policy, tokenizer, 2)),
                         ("sft_sampled", policy_turns(policy, tokenizer, 2, temperature=0.7)),
                         ("sft_habit", rule_turns(tokenizer, lambda env: sft_move(env, habit_rng))),
                         ("shortest_path", rule_turns(tokenizer, lambda env: SHORTEST_PATH[env.cell]))):
            played = play([env_class() for _ in rows], rows, list(range(len(rows))), LAKE_TURNS, act, tokenizer)
            numbers |= {f"{lake}_{who}_{what}": round(value, 3) for what, value in rates(played).items()}
        best = best_win_chances(env_class.slip, LAKE_TURNS)
        numbers[f"{lake}_best_return"] = round(sum(best[row["start"]] for row in rows) / len(rows), 3)
    return numbers | {"policy_parameters": parameter_count(policy)}
