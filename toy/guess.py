"""The guess-the-number environment, the multi-turn scripts' default (grpo_multiturn*.py): the policy guesses a
secret number from 1 to GUESS_RANGE, the environment answers "higher" or "lower", and the episode ends with reward 1
when a guess is right (within GUESS_TURNS turns: binary search always wins, the ceiling is 1). The SFT policy knows
the game but has a visible fault: it guesses the midpoint of the numbers still possible only MIDPOINT_SHARE of the
time, else the lowest of them (a linear search), so near-greedy it wins about GUESS_TURNS / GUESS_RANGE of the
games. GuessTheNumber is the environment contract's example."""

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

GUESS_DIR = cache_folder("guess", __file__)
GUESS_POLICY = os.path.join(GUESS_DIR, "sft_policy")
GUESS_DATASET = os.path.join(GUESS_DIR, "dataset")
GUESS_RANGE = 15
GUESS_TURNS = 4
MIDPOINT_SHARE = 0.35
GUESS_WORDS = [PAD, EOS, UNK, "guess", "a", "number", "from", "to", ":", "higher", "lower", "invalid",
               *(str(n) for n in range(1, GUESS_RANGE + 1))]
GUESS_SFT_STEPS = 700  # near-greedy a linear search (0.24), as after 1500 steps


class GuessTheNumber:
    """The environment contract (README, "Multi-turn environments"): reset(row, seed) -> the first message;
    step(action) -> (next message, reward, done). The row holds the secret; an action that is not one number
    in range costs the turn ("invalid")."""

    latency = 0.0  # seconds a step takes (a simulated tool), jittered by the episode's seed

    def reset(self, row: dict, seed: int) -> str:
        self.secret, self.rng = row["secret"], random.Random(seed)
        return f"guess a number from 1 to {GUESS_RANGE} :"

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self.latency:
            time.sleep(self.latency * self.rng.uniform(0.5, 1.5))
        words = action.split()
        if len(words) != 1 or words[0] not in GUESS_WORDS[-GUESS_RANGE:]:
            return "invalid :", 0.0, False
        guess = int(words[0])
        if guess == self.secret:
            return None, 1.0, True
        return ("higher :" if self.secret > guess else "lower :"), 0.0, False


class SlowGuessTheNumber(GuessTheNumber):
    """GuessTheNumber whose steps take 25-75 ms (50 on average), as a tool call would."""

    latency = 0.05


def sft_guess(low: int, high: int, rng: random.Random) -> int:
    """The SFT policy's habit: the midpoint of the numbers still possible, or (mostly) the lowest of them."""
    return (low + high) // 2 if rng.random() < MIDPOINT_SHARE else low


def guess_episode(secret: int, rng: random.Random) -> list[tuple[str, bool]]:
    """A game played by the SFT habit, as (text, whether the policy wrote it) pieces, in the format the
    multi-turn scripts build (each action ends with its stop token; no message after the last turn)."""
    env = GuessTheNumber()
    pieces, low, high = [(env.reset({"secret": secret}, 0), False)], 1, GUESS_RANGE
    for turn in range(GUESS_TURNS):
        guess = sft_guess(low, high, rng)
        pieces.append((f"{guess} {EOS}", True))
        message, _, done = env.step(str(guess))
        if done or turn == GUESS_TURNS - 1:
            return pieces
        pieces.append((message, False))
        low, high = (guess + 1, high) if message.startswith("higher") else (low, guess - 1)
    return pieces


def guess_sft_loss(policy, tokenizer, secrets, rng, batch_size=32) -> torch.Tensor:
    """Next-token loss on the policy's own tokens (the guesses and their stop tokens) of SFT games."""
    sequences, is_action = [], []
    for secret in rng.sample(secrets, batch_size):
        ids, action = [], []
        for text, by_policy in guess_episode(secret, rng):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, action = ids + piece, action + [int(by_policy)] * len(piece)
        sequences.append(ids)
        is_action.append(action)
    return masked_sft_loss(policy, sequences, is_action, tokenizer.pad_token_id)


def play_greedy(policy, tokenizer, secrets: list[int], strategy=None) -> float:
    """The share of games won by the policy's greedy guesses (or by strategy(low, high) when given)."""
    wins = 0
    for secret in secrets:
        env, low, high = GuessTheNumber(), 1, GUESS_RANGE
        text = env.reset({"secret": secret}, 0)
        for _ in range(GUESS_TURNS):
            if strategy is None:
                inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
                with torch.no_grad():
                    output = policy.generate(**inputs, max_new_tokens=3, do_sample=False)
                action = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            else:
                action = str(strategy(low, high))
            message, reward, done = env.step(action)
            if done:
                wins += reward == 1.0
                break
            text += f" {action} {EOS} {message}"
            if action.isdigit():
                low, high = (int(action) + 1, high) if message.startswith("higher") else (low, int(action) - 1)
    return wins / len(secrets)


def build_guess(seed: int = 0) -> None:
    """Build the guess-the-number environment's policy and rows into GUESS_DIR unless they are there."""
    built_once(GUESS_DIR, make_guess, seed, "the guess-the-number environment")


def make_guess(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """Rows (the secrets) and the SFT policy of the guess-the-number environment into `folder`; returns the
    win rates measured on it."""
    splits = DatasetDict({split: Dataset.from_dict({"secret": [rng.randint(1, GUESS_RANGE) for _ in range(size)]})
                          for split, size in [("train", 4096), ("validation", 256)]})
    splits.save_to_disk(os.path.join(folder, "dataset"))
    tokenizer = make_tokenizer(GUESS_WORDS)
    policy = untrained_policy(llama_config(len(GUESS_WORDS), SMALL_SHAPE, tokenizer, max_positions=64), tokenizer)
    secrets = list(splits["train"]["secret"])
    loss = train(policy, lambda: guess_sft_loss(policy, tokenizer, secrets, rng), steps=GUESS_SFT_STEPS, lr=3e-3)
    print(f"toy: guess-the-number SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    validation = list(splits["validation"]["secret"])
    return {"sft_greedy_win_rate": play_greedy(policy, tokenizer, validation),
            "linear_search_win_rate": play_greedy(None, None, validation, lambda low, high: low),
            "binary_search_win_rate": play_greedy(None, None, validation, lambda low, high: (low + high) // 2),
            "policy_parameters": parameter_count(policy)}
