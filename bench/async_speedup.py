"""Asynchronous vs synchronous RLHF on the toy task, measured in one run, for online DPO, RLOO or PPO.

Runs the same number of updates four ways: the synchronous script (HF generate, e.g. online_dpo.py),
its vLLM twin with --async_steps 0 (sync, vLLM on its own core) and with --async_steps 1 (the paper's
async), and --vllm_device shared --async_steps 0 (sync, vLLM on the trainer's cores, taking turns).
Prints seconds per update, where the time goes, the final gold win-rate, the speedups, and the
overlap bound (G + T) / max(G, T) from the K=0 run's generation time G and trainer time T.

    python bench/async_speedup.py                          # online DPO, about 7 minutes on 2 CPU cores
    python bench/async_speedup.py --algorithm rloo         # rloo.py vs rloo_vllm.py
    python bench/async_speedup.py --algorithm ppo --updates 10    # quicker, noisier
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    algorithm: Literal["online_dpo", "rloo", "ppo"] = "online_dpo"
    """which pair to compare: <algorithm>.py and <algorithm>_vllm.py"""
    updates: int = 30
    """training updates per run (the first is excluded from the timings as warm-up)"""
    prompts_per_update: int = 64
    """prompts per update"""
    extra: str = ""
    """extra flags passed to every run, in one argument: --extra='--num_samples 4'"""


def run(script: str, args: Args, folder: str, *flags: str) -> list[dict]:
    output_dir = os.path.join(folder, os.path.basename(script) + "".join(flags).replace("-", "_"))
    command = [sys.executable, os.path.join(ROOT, script),
               "--total_episodes", str(args.updates * args.prompts_per_update),
               "--per_device_train_batch_size", str(args.prompts_per_update // 4), "--gradient_accumulation_steps", "4",
               "--eval_every", str(10**6), "--output_dir", output_dir, *flags, *shlex.split(args.extra)]
    print("$", " ".join(command[1:]), flush=True)
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarise(name: str, metrics: list[dict]) -> dict:
    train = [m for m in metrics if "loss/policy_avg" in m]
    steady = train[1:]  # the first update pays for warm-up
    seconds = [b["time"] - a["time"] for a, b in zip(train, train[1:]) if "eval/gold_win_rate" not in b]

    def mean(key):
        return statistics.mean(m.get(key, 0.0) for m in steady)

    final = [m for m in metrics if "eval/gold_win_rate" in m][-1]
    return {"name": name, "seconds_per_update": statistics.median(seconds), "generate": mean("time/generate"),
            "weight_sync": mean("time/weight_sync"), "logprob_check": mean("time/logprob_check"),
            "score": mean("time/score"), "train": mean("time/train"), "wait": mean("time/wait"),
            "gold_win_rate": final["eval/gold_win_rate"], "staleness": mean("async/staleness")}


def main(args: Args):
    with tempfile.TemporaryDirectory() as folder:
        sync, vllm = f"{args.algorithm}.py", f"{args.algorithm}_vllm.py"
        results = [summarise(f"sync, HF generate ({sync})", run(sync, args, folder)),
                   summarise("sync, vLLM (K=0)", run(vllm, args, folder, "--async_steps", "0")),
                   summarise("async, vLLM (K=1)", run(vllm, args, folder, "--async_steps", "1")),
                   summarise("sync, vLLM shared (K=0)",
                             run(vllm, args, folder, "--async_steps", "0", "--vllm_device", "shared"))]
    print(f"\n{'run':36} {'s/update':>9} {'generate':>9} {'w-sync':>7} {'lp-check':>8} {'score':>7} {'train':>7}"
          f" {'wait':>7} {'stale':>6} {'gold win':>9}")
    for r in results:
        print(f"{r['name']:36} {r['seconds_per_update']:9.3f} {r['generate']:9.3f} {r['weight_sync']:7.3f}"
              f" {r['logprob_check']:8.3f} {r['score']:7.3f} {r['train']:7.3f} {r['wait']:7.3f} {r['staleness']:6.2f}"
              f" {r['gold_win_rate']:9.3f}")
    hf, k0, k1, shared = results
    generation = k0["generate"] + k0["weight_sync"] + k0["logprob_check"]  # G: the generator's side of one update
    trainer = k0["score"] + k0["train"]  # T: the trainer's side of one update
    bound = (generation + trainer) / max(generation, trainer)
    speedup = k0["seconds_per_update"] / k1["seconds_per_update"]
    print(f"\nK=0 run: G = {generation:.3f} s (generate + weight sync + log-prob check), "
          f"T = {trainer:.3f} s (score + train)")
    print(f"overlap bound (G + T) / max(G, T) = {bound:.2f}x")
    print(f"K=1 over K=0: {speedup:.2f}x = {speedup / bound:.0%} of the bound")
    k1_seconds = k1["seconds_per_update"]
    print(f"K=1 over sync HF generate: {hf['seconds_per_update'] / k1_seconds:.2f}x; over the engine sharing "
          f"the trainer's cores (K=0): {shared['seconds_per_update'] / k1_seconds:.2f}x")
    # why K=1 falls short of the bound: contention slows both sides when they run at once
    print(f"contention: in the K=1 run generation took {k1['generate'] / k0['generate']:.2f}x and training "
          f"{(k1['score'] + k1['train']) / trainer:.2f}x their K=0 times; the trainer waited {k1['wait']:.3f} s "
          "per update for the engine")


if __name__ == "__main__":
    main(tyro.cli(Args))
