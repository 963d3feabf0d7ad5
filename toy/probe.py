"""Guess-the-number where the policy decides when to stop (--env toy:probe_answer, toy:probe_answer_shaped): the
secret is a number from 1 to PROBE_RANGE; a bare number is a probe, which the environment answers "higher", "lower" or
"equal"; "answer N" ends the episode, reward 1 if N is the secret, else 0. An episode that never answers is cut off by
--max_turns with nothing. Three probes of a binary search always pin the secret (15 = 2^4 - 1), so a fourth turn can
always win; PROBE_TURNS, the --max_turns of its runs, leaves two to spare.

The SFT policy can search: it always probes the midpoint of the numbers still possible. Its fault is in stopping:
once the secret is known (one number left) it answers only ANSWER_SHARE of its turns, else it probes the known number
again, and before that it answers the midpoint EARLY_SHARE of its turns (mostly wrong). Near-greedy it answers in
almost no game (it wins about 5% of them, in PROBE_TURNS turns); sampled at the scripts' temperature it wins about
55%. What it has to learn is when to stop, which is where the credit a turn gets matters (ALGORITHMS.md, "Credit
per turn").

The shaped variant adds to each turn's reward F = Phi(after) - Phi(before), with the potential
Phi(low, high) = -(high - low) / (PROBE_RANGE - 1) of the numbers still possible (-1 at the start, 0 once one number
is left) and Phi = 0 once the episode has answered: a probe earns the part of the range it rules out, an answer earns
what was still open (its reward is the win plus that). This is potential-based shaping (Ng, Harada and Russell,
1999) with gamma = 1 and the potential 0 where the episode ends, so it does not change which policies are best: an
episode's shaping telescopes to Phi(end) - Phi(start), which is 1 for every episode that answers, whatever it probed
and whenever it answered. A policy's expected shaped return is then its sparse one plus 1, less the share still open,
(high - low) / (PROBE_RANGE - 1), of the episodes --max_turns cuts off before they answer; with --max_turns of at
least 4 some policies win every game (bisect, then answer), they alone reach the highest shaped return (2), and they
are the sparse game's best policies. A flat reward per probe that came closer to the secret (+0.1) or went further
(-0.1) is not a potential difference: it pays probing for its own sake, whatever a probe rules out, and a pilot run
with it learned to probe and never answer.
"""

import os
import random
import time

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

PROBE_DIR = cache_folder("probe", __file__, os.path.join(os.path.dirname(__file__), "play.py"))
PROBE_POLICY = os.path.join(PROBE_DIR, "sft_policy")
PROBE_DATASET = os.path.join(PROBE_DIR, "dataset")
PROBE_RANGE = 15
PROBE_TURNS = 6  # the --max_turns its runs take (ENVIRONMENTS.md): a sure win takes 4
ANSWER_SHARE = 0.35  # of the SFT policy's turns with the secret known, those that answer it
EARLY_SHARE = 0.1  # of its turns before, those that answer the midpoint
NUMBERS = [str(n) for n in range(1, PROBE_RANGE + 1)]
PROBE_WORDS = [PAD, EOS, UNK, "find", "the", "number", "from", "to", ":", "higher", "lower", "equal", "invalid",
               "answer", *NUMBERS]
PROBE_SFT_STEPS = 300


class ProbeAnswer:
    """Probe with a number, then "answer N" (toy:probe_answer): the environment contract, with state_key() the
    numbers still possible, (low, high). The row holds the secret; a turn that is neither one number in range nor
    "answer" and one costs the turn ("invalid")."""

    shaped = False  # ProbeAnswerShaped: the potential-based shaping of the module's docstring

    def reset(self, row: dict, seed: int) -> str:
        self.secret, self.low, self.high = row["secret"], 1, PROBE_RANGE
        return f"find the number from 1 to {PROBE_RANGE} :"

    def state_key(self) -> tuple[int, int]:
        return self.low, self.high

    def potential(self) -> float:
        return -(self.high - self.low) / (PROBE_RANGE - 1)

    def step(self, action: str) -> tuple[str | None, float, bool]:
        words, before = action.split(), self.potential()
        if len(words) == 2 and words[0] == "answer" and words[1] in NUMBERS:
            return None, float(int(words[1]) == self.secret) - before * self.shaped, True  # Phi(the end) = 0
        if len(words) != 1 or words[0] not in NUMBERS:
            return "invalid :", 0.0, False
        probe = int(words[0])
        if probe == self.secret:
            self.low = self.high = probe
            reply = "equal :"
        elif probe < self.secret:
            self.low, reply = max(self.low, probe + 1), "higher :"
        else:
            self.high, reply = min(self.high, probe - 1), "lower :"
        return reply, (self.potential() - before) * self.shaped, False


class ProbeAnswerShaped(ProbeAnswer):
    """ProbeAnswer with a potential-based shaping reward each turn (toy:probe_answer_shaped): a probe earns the
    share of the range it rules out, the answer what was still possible (the module's docstring says why)."""

    shaped = True


def sft_probe(env: ProbeAnswer, rng: random.Random) -> str:
    """The SFT policy's habit: probe the midpoint of the numbers still possible; answer the known secret only
    ANSWER_SHARE of the time (else probe it again), and the midpoint before it is known EARLY_SHARE of the time."""
    middle = (env.low + env.high) // 2
    answers = rng.random() < (ANSWER_SHARE if env.low == env.high else EARLY_SHARE)
    return f"answer {middle}" if answers else str(middle)


def build_probe(seed: int = 0) -> None:
    """Build the probe-and-answer environments' policy and rows into PROBE_DIR unless they are there."""
    built_once(PROBE_DIR, make_probe, seed, "the probe-and-answer environments")


def make_probe(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """Rows (the secrets) and the SFT policy of the probe-and-answer environments into `folder`; returns what the
    policy and two rules win, greedy and sampled at the scripts' temperature (0.7), on the validation rows."""
    splits = DatasetDict({split: Dataset.from_dict({"secret": [rng.randint(1, PROBE_RANGE) for _ in range(size)]})
                          for split, size in [("train", 4096), ("validation", 256)]})
    splits.save_to_disk(os.path.join(folder, "dataset"))
    tokenizer = make_tokenizer(PROBE_WORDS)
    policy = untrained_policy(llama_config(len(PROBE_WORDS), SMALL_SHAPE, tokenizer, max_positions=64), tokenizer)
    train_rows = list(splits["train"])
    habit = rule_turns(tokenizer, lambda env: sft_probe(env, rng))

    loss_of_batch = sft_loss_of_batch(ProbeAnswer, train_rows, PROBE_TURNS, habit, policy, tokenizer, rng)
    loss = train(policy, loss_of_batch, steps=PROBE_SFT_STEPS, lr=3e-3)
    print(f"toy: probe-and-answer SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    rows = list(splits["validation"])

    def measured(act) -> dict:
        return rates(play([ProbeAnswer() for _ in rows], rows, list(range(len(rows))), PROBE_TURNS, act, tokenizer))

    bisect_and_answer = lambda env: (f"answer {env.low}" if env.low == env.high  # noqa: E731
                                     else str((env.low + env.high) // 2))
    habit_rng = random.Random(seed)
    numbers = {"sft_greedy": measured(policy_turns(policy, tokenizer, 3)),
               "sft_sampled": measured(policy_turns(policy, tokenizer, 3, temperature=0.7)),
               "sft_habit": measured(rule_turns(tokenizer, lambda env: sft_probe(env, habit_rng))),
               "bisect_and_answer": measured(rule_turns(tokenizer, bisect_and_answer))}
    return {f"{who}_{what}": round(value, 3) for who, rates_of in numbers.items() for what, value in rates_of.items()
            } | {"policy_parameters": parameter_count(policy)}
