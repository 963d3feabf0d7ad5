"""What every embedded task's build shares: where it is cached, one build of a task at a time in a process of its own,
the word-level tokenizers, the policies' shapes and their training loop. Imports no other module of the kit."""

import fcntl
import glob
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import datasets
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# ASYNC_RLHF_TOY_DIR: the TL;DR-like world's folder, the other tasks' beside it (its path and "-math", ...)
MOVED_TO = os.environ.get("ASYNC_RLHF_TOY_DIR")
CACHE = os.path.dirname(os.path.abspath(MOVED_TO)) if MOVED_TO else os.path.expanduser("~/.cache/async-rlhf-kit")
# A build's torch threads, whatever its caller's: one. With two, OpenMP's threads wait on each other at every
# operation of these tiny models, spinning, wherever another process wants a core (bench/toy_build_load.py); the
# weights do not depend on it.
BUILD_THREADS = 1

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Policy shapes. Heads of size 32: vLLM's CPU backend rejects 16.
SMALL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4)  # 0.45M parameters
LARGE_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8)  # 3.45M parameters, 7.7x


def cache_folder(task: str, *sources: str) -> str:
    """The folder `task` ("": the TL;DR-like world) is built into: beside ASYNC_RLHF_TOY_DIR when it is set, else
    one named by the hash of the code that builds it (this module and `sources`, the task's module and those it
    builds on), so that an edited task builds again and the others stay built."""
    if MOVED_TO:
        return os.path.abspath(MOVED_TO) + (f"-{task}" if task else "")
    code = hashlib.sha256()
    for source in (__file__, *sources):
        with open(source, "rb") as f:
            code.update(f.read())
    return os.path.join(CACHE, f"toy-{task + '-' if task else ''}{code.hexdigest()[:10]}")


def built_once(folder: str, make, seed: int, name: str):
    """Build `name` into `folder` unless it is there. Builds of the same task wait for each other (the lock file
    `folder`.lock), and one that finds its folder built when its turn comes does nothing; builds of different tasks
    run at once (each one thread: beside a busy process a build took 1.04x its time alone, bench/toy_build_load.py).
    It runs in a Python process of its own, which holds the lock with its caller, so the caller's thread count,
    random state and memory stay as they were."""
    if os.path.exists(os.path.join(folder, "summary.json")):
        return
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(folder, "summary.json")):  # built while this one waited
            return
        for leftover in glob.glob(folder + ".building-*"):  # of a build that was killed: nothing builds it now
            shutil.rmtree(leftover, ignore_errors=True)
        kit = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        environment = os.environ | {"PYTHONPATH": os.pathsep.join([kit, os.environ.get("PYTHONPATH", "")])}
        code = (f"from toy.builder import build_in_this_process; from {make.__module__} import {make.__name__}; "
                f"build_in_this_process({folder!r}, {make.__name__}, {seed}, {name!r})")
        exit_code = subprocess.run([sys.executable, "-c", code], env=environment, pass_fds=[lock.fileno()]).returncode
    if exit_code != 0:
        raise RuntimeError(f"toy: building {name} into {folder} failed (exit code {exit_code}); its output is above")


def build_in_this_process(folder: str, make, seed: int, name: str, threads: int = BUILD_THREADS):
    """`make(building, seed, rng, start)` builds `name` into a scratch folder beside `folder`, seeded, with
    `threads` torch threads, and returns the numbers it measured; they go to summary.json and the folder
    becomes `folder` in one rename. Called in built_once's process, which holds the task's lock, or by
    bench/toy_build_load.py."""
    start = time.time()
    datasets.disable_progress_bars()  # the build's output: what it builds, and in how long
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    building = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".building-", dir=os.path.dirname(folder))
    try:
        print(f"toy: building {name} into {folder} (seed {seed})", flush=True)
        numbers = make(building, seed, rng, start) | {"seed": seed, "build_seconds": round(time.time() - start, 1)}
        with open(os.path.join(building, "summary.json"), "w") as f:
            json.dump(numbers, f, indent=2)
        os.rename(building, folder)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    print(f"toy: {name} built in {time.time() - start:.0f} s", flush=True)


def make_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `words` (the special tokens first), left-padding as the trainers do."""
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: decode joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", clean_up_tokenization_spaces=False)


def llama_config(vocab_size: int, shape: dict, tokenizer, max_positions: int, **extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, **shape, head_dim=32, max_position_embeddings=max_positions,
                       tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id, **extra)


def untrained_policy(config: LlamaConfig, tokenizer) -> LlamaForCausalLM:
    """A freshly initialised policy (from torch's random state) that generates up to the tokenizer's stop token."""
    policy = LlamaForCausalLM(config)
    policy.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return policy


def left_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and position_ids in the layout the trainers use."""
    width = max(map(len, sequences))
    input_ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in sequences])
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


def masked_sft_loss(policy, sequences: list[list[int]], trained: list[list[int]], pad_id: int) -> torch.Tensor:
    """Next-token loss of `sequences` on the tokens `trained` marks 1 (a row of marks per sequence)."""
    input_ids, attention_mask, position_ids = left_padded(sequences, pad_id)
    mask = left_padded(trained, 0)[0]  # (batch, width)
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    token_losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
    return (token_losses * mask[:, 1:]).sum() / mask[:, 1:].sum()


def train(model, loss_of_batch, steps: int, lr: float) -> float:
    """AdamW with a learning rate decaying linearly to zero; returns the last batch's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    for _ in range(steps):
        loss = loss_of_batch()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    return loss.item()


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
