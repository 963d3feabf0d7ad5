"""A 7.7x larger SFT policy of the TL;DR-like world (LARGE_SHAPE), for questions about scale: the same dataset
and reward model, so only the policy's size differs between the two."""

import os
import random
import time

from datasets import load_from_disk
from transformers import AutoTokenizer

from toy import tldr
from toy.builder import LARGE_SHAPE, built_once, cache_folder

LARGE_DIR = cache_folder("large", __file__, tldr.__file__)
LARGE_SFT_POLICY = os.path.join(LARGE_DIR, "sft_policy")


def build_large(seed: int = 0) -> None:
    """Build the larger SFT policy into LARGE_DIR unless it is already there (the toy world first)."""
    tldr.build()
    built_once(LARGE_DIR, make_large, seed, "the larger SFT policy")


def make_large(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """The same world's SFT policy at LARGE_SHAPE, trained on the same targets; the toy world's dataset and
    reward model stay where they are."""
    train_queries = list(load_from_disk(tldr.DATASET)["train"]["query"])
    tokenizer = AutoTokenizer.from_pretrained(tldr.SFT_POLICY)
    policy, loss = tldr.sft_policy(LARGE_SHAPE, tokenizer, train_queries, rng, lr=1e-3)
    print(f"toy: larger SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    return tldr.measure(os.path.join(folder, "sft_policy"), tldr.REWARD_MODEL, tldr.DATASET, seed)
