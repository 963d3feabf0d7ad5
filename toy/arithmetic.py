"""The arithmetic task (`--preset toy-math`): problems "Q: 37 + 48 = ? A:" with GSM8k-style worked solutions
" 7 + 8 = 15 , 3 + 4 + 1 = 8 #### 85". The SFT policy has the skill but a visible fault: in problems that carry
from the units column it often forgets the carry, as its SFT data did (most often when the units sum to 10-14), so
near-greedy it is right on about a third of the problems, and sampling finds the right answer often enough for RL.
(reasoning-gym's procedural generators were considered: 11 pinned dependencies for ~100 puzzle families, and no
worked solutions to train the SFT policy on; two-number addition is a few lines.)"""

import os
import random
import re
import time

import torch
from datasets import Dataset, DatasetDict, load_from_disk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

from toy.builder import (
    EOS,
    PAD,
    SMALL_SHAPE,
    UNK,
    built_once,
    cache_folder,
    llama_config,
    masked_sft_loss,
    parameter_count,
    train,
    untrained_policy,
)

MATH_DIR = cache_folder("math", __file__)
MATH_POLICY = os.path.join(MATH_DIR, "sft_policy")
MATH_DATASET = os.path.join(MATH_DIR, "dataset")
MATH_RESPONSE_LENGTH = 24  # new tokens: a solution is at most 19 with its stop token
MATH_SFT_STEPS = 2000
CARRY_SHARE = 0.85  # of the problems, those that carry from the units column
DIGITS = [str(d) for d in range(10)]
MATH_WORDS = [PAD, EOS, UNK, "Q:", "A:", "+", "=", "?", ",", "####", *DIGITS, *(f"~{d}" for d in DIGITS)]


def forgets_carry_probability(units_sum: int) -> float:
    """How often the SFT solutions forget a carry: mostly for small carries, so that greedy decoding is
    wrong there and right for units summing to 15-18."""
    return 0.7 if units_sum < 15 else 0.2


def make_problem(rng: random.Random) -> tuple[int, int]:
    """Two 2-digit numbers; CARRY_SHARE of the problems carry from the units column."""
    carries = rng.random() < CARRY_SHARE
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a % 10 + b % 10 >= 10) == carries:
            return a, b


def math_question(a: int, b: int) -> str:
    return f"Q: {a} + {b} = ? A:"


def worked_solution(a: int, b: int, forget_carry: bool = False) -> str:
    """Column addition, units then tens, ending in GSM8k's `#### N` (wrong when the carry is forgotten)."""
    units = a % 10 + b % 10
    carry = 0 if forget_carry else units // 10
    tens = a // 10 + b // 10 + carry
    carried = f" + {carry}" if carry else ""
    return f" {a % 10} + {b % 10} = {units} , {a // 10} + {b // 10}{carried} = {tens} #### {tens * 10 + units % 10}"


def math_splits(rng: random.Random) -> DatasetDict:
    """8192 train and 512 test problems: the prompt ("question"), the worked solution ("answer", GSM8k's
    column names) and the two numbers."""
    splits = {}
    for split, size in [("train", 8192), ("test", 512)]:
        problems = [make_problem(rng) for _ in range(size)]
        splits[split] = Dataset.from_dict({
            "question": [math_question(a, b) for a, b in problems],
            "answer": [worked_solution(a, b).strip() for a, b in problems],
            "a": [a for a, _ in problems], "b": [b for _, b in problems]})
    return DatasetDict(splits)


def make_math_tokenizer() -> PreTrainedTokenizerFast:
    """Words and single digits; a number is its digits ("85" -> "8", "~5"), decoded back to "85" (not "##" as
    the continuation prefix: it would glue "####" to the word before it)."""
    wordpiece = Tokenizer(models.WordPiece({w: i for i, w in enumerate(MATH_WORDS)}, unk_token=UNK,
                                           continuing_subword_prefix="~"))
    wordpiece.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wordpiece.decoder = decoders.WordPiece(prefix="~", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=wordpiece, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", clean_up_tokenization_spaces=False)


def math_sft_loss(policy, tokenizer, problems, rng, batch_size=32) -> torch.Tensor:
    """Next-token loss on the solution tokens of SFT targets with the fault."""
    batch = rng.sample(problems, batch_size)
    query_ids = tokenizer([math_question(a, b) for a, b in batch])["input_ids"]
    targets = [worked_solution(a, b, forget_carry=rng.random() < forgets_carry_probability(a % 10 + b % 10))
               + f" {EOS}" for a, b in batch]
    response_ids = tokenizer(targets)["input_ids"]
    return masked_sft_loss(policy, [q + r for q, r in zip(query_ids, response_ids)],
                           [[0] * len(q) + [1] * len(r) for q, r in zip(query_ids, response_ids)],
                           tokenizer.pad_token_id)


def states_the_sum(completion: str, a: int, b: int) -> bool:
    """Whether the number after the completion's first `####` (GSM8k's answer format) is a + b."""
    match = re.search(r"####\s*(-?[\d,]*\.?\d+)", completion)
    return match is not None and float(match.group(1).replace(",", "")) == a + b


def measure_math(folder: str) -> dict:
    """The SFT policy's accuracy on the test problems, from the saved artefacts."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "sft_policy"))
    policy = LlamaForCausalLM.from_pretrained(os.path.join(folder, "sft_policy"))
    test = load_from_disk(os.path.join(folder, "dataset"))["test"]
    inputs = tokenizer(list(test["question"]), return_tensors="pt", padding=True)
    accuracy = {}
    for name, sampling in [("greedy", dict(do_sample=False)), ("sampled", dict(do_sample=True, temperature=0.7))]:
        with torch.no_grad():
            output = policy.generate(**inputs, max_new_tokens=MATH_RESPONSE_LENGTH, **sampling)
        completions = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        accuracy[name] = sum(map(states_the_sum, completions, test["a"], test["b"])) / len(test)
    carrying = [a % 10 + b % 10 >= 10 for a, b in zip(test["a"], test["b"])]
    return {"sft_greedy_accuracy": accuracy["greedy"], "sft_sampled_accuracy": accuracy["sampled"],
            "carrying_share": sum(carrying) / len(carrying), "policy_parameters": parameter_count(policy),
            "example": test["question"][0] + completions[0]}


def build_math(seed: int = 0) -> None:
    """Build the arithmetic task into MATH_DIR unless it is already there."""
    built_once(MATH_DIR, make_math, seed, "the arithmetic task")


def make_math(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """The arithmetic task into `folder`: problems with gold answers, its tokenizer, the SFT policy;
    returns the numbers measured on it."""
    splits = math_splits(rng)
    splits.save_to_disk(os.path.join(folder, "dataset"))
    train_problems = list(zip(splits["train"]["a"], splits["train"]["b"]))

    tokenizer = make_math_tokenizer()
    policy = untrained_policy(llama_config(len(MATH_WORDS), SMALL_SHAPE, tokenizer, max_positions=64), tokenizer)
    loss = train(policy, lambda: math_sft_loss(policy, tokenizer, train_problems, rng), steps=MATH_SFT_STEPS,
                 lr=3e-3)
    print(f"toy: arithmetic SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    return measure_math(folder)
