"""What sft.py and reward_model.py start from, on the TL;DR-like world's prompts: an untrained policy of the
small shape (the "pretrained" model, with the world's tokenizer), SFT data and human-like preference pairs."""

import os
import random

from datasets import Dataset, DatasetDict, load_from_disk
from transformers import AutoTokenizer

from toy import tldr
from toy.builder import SMALL_SHAPE, built_once, cache_folder, untrained_policy

PIPELINE_DIR = cache_folder("pipeline", __file__, tldr.__file__)
BASE_POLICY = os.path.join(PIPELINE_DIR, "base_policy")
SFT_DATASET = os.path.join(PIPELINE_DIR, "sft_dataset")
PREFERENCE_DATASET = os.path.join(PIPELINE_DIR, "preference_dataset")
LABEL_NOISE = 0.25  # of the preference pairs, those whose "human" label disagrees with the gold judge


def build_pipeline(seed: int = 0) -> None:
    """Build the pipeline's starting points into PIPELINE_DIR unless they are there (the toy world first)."""
    tldr.build()
    built_once(PIPELINE_DIR, make_pipeline, seed, "the pipeline's data")


def make_pipeline(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """The base policy (with the toy world's tokenizer), SFT data (prompt, completion: the rambling targets the
    toy's own SFT policy learned from) and preference pairs (prompt, chosen, rejected: candidate pairs ordered by
    the gold judge, LABEL_NOISE of them swapped, as human labels disagree with a gold judge; relabelling with the
    gold scorer undoes that) into `folder`; returns their sizes."""
    toy_splits = load_from_disk(tldr.DATASET)
    splits = {"sft_dataset": {}, "preference_dataset": {}}
    for split in ("train", "validation"):
        queries = list(toy_splits[split]["query"])
        splits["sft_dataset"][split] = Dataset.from_dict(
            {"prompt": queries, "completion": [tldr.rambling_target(q, rng) for q in queries]})
        prompts, chosen, rejected = tldr.gold_labelled_pairs(queries, rng, len(queries) // 2)
        swapped = [rng.random() < LABEL_NOISE for _ in prompts]
        splits["preference_dataset"][split] = Dataset.from_dict({
            "prompt": prompts,
            "chosen": [r if swap else c for c, r, swap in zip(chosen, rejected, swapped)],
            "rejected": [c if swap else r for c, r, swap in zip(chosen, rejected, swapped)]})
    for name, dataset in splits.items():
        DatasetDict(dataset).save_to_disk(os.path.join(folder, name))
    tokenizer = AutoTokenizer.from_pretrained(tldr.SFT_POLICY)
    policy = untrained_policy(tldr.model_config(SMALL_SHAPE, tokenizer), tokenizer)
    policy.save_pretrained(os.path.join(folder, "base_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "base_policy"))
    return {"sft_examples": {split: len(d) for split, d in splits["sft_dataset"].items()},
            "preference_pairs": {split: len(d) for split, d in splits["preference_dataset"].items()},
            "label_noise": LABEL_NOISE}
