"""Asynchronous vs synchronous RLHF on the toy task, measured in one run, for online DPO, RLOO or PPO.

Runs the same number of updates up to five ways: the synchronous script (HF generate, e.g. online_dpo.py),
its vLLM twin with --async_steps 0 (sync, vLLM on its own core) and with --async_steps 1 (the paper's
async), --vllm_device shared --async_steps 0 (sync, vLLM on the trainer's cores, taking turns), and
--async_steps 1 --inflight_updates (the engine takes each version between decode steps; `--settings k1
inflight` compares the two). Prints seconds per update, where the time goes, the final gold win-rate, the
speedups, and the overlap bound (G + T) / max(G, T) from the K=0 run's generation time G and trainer time T;
for the in-flight run also the engine's idle time and the tokens' staleness.

    python bench/async_speedup.py                          # online DPO, about 7 minutes on 2 CPU cores
    python bench/async_speedup.py --algorithm rloo         # rloo.py vs rloo_vllm.py
    python bench/async_speedup.py --algorithm ppo --updates 10    # quicker, noisier
    python bench/async_speedup.py --real_size --updates 6 --prompts_per_update 8 --extra='--response_length 32'
    python bench/async_speedup.py --real_size --updates 12 --settings hf shared --extra='--response_length 128'
    python bench/async_speedup.py --settings k1 inflight --repeats 3

With --real_size the runs use bench/real_size.py's setup (a SmolLM2-135M-shaped policy with its 49k
vocabulary, a chat template, an encoder reward model, prompt-only data; no gold scorer, no evaluation),
and it also prints the end-to-end times (start-up included) and the trainer's wait for each weight send
against the floor, one memory copy of the policy's bytes.
"""

import dataclasses
import functools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import off_policy_corrections  # noqa: E402  (bench/, this script's folder, is on the path: the toy build's sha256)
import real_size  # noqa: E402

import toy  # noqa: E402  (the kit's root on the path first)


@dataclasses.dataclass
class Args:
    algorithm: Literal["online_dpo", "rloo", "ppo"] = "online_dpo"
    """which pair to compare: <algorithm>.py and <algorithm>_vllm.py"""
    updates: int = 30
    """training updates per run (the first is excluded from the timings as warm-up)"""
    prompts_per_update: int = 64
    """prompts per update"""
    extra: str = ""
    """extra flags passed to every run, in one argument: --extra='--num_samples 4'"""
    real_size: bool = False
    """a researcher's setup at a real size instead of the toy (bench/real_size.py)"""
    repeats: int = 1
    """runs of each setting, interleaved; the table shows medians over them"""
    settings: tuple[Literal["hf", "k0", "k1", "shared", "inflight"], ...] = ("hf", "k0", "k1", "shared")
    """which settings to run (sync HF generate, vLLM K=0, K=1, shared K=0, K=1 with in-flight weight updates);
    the ratios that need a setting left out are not printed"""
    results_file: str | None = None
    """also write every run's numbers and each setting's medians here as JSON, with the command, the date, the
    machine and the toy build (bench/findings.py computes RESULTS.md's tables and ratios from such files)"""


def run(script: str, args: Args, folder: str, *flags: str) -> tuple[list[dict], float, str]:
    """The run's metrics, its seconds end to end (start-up included) and its output folder."""
    output_dir = tempfile.mkdtemp(dir=folder)
    setup = ["--eval_every", str(10**6)]  # evaluated before and after training, on the toy's gold scorer
    if args.real_size:
        setup = real_size.script_flags()
    command = [sys.executable, os.path.join(ROOT, script),
               "--total_episodes", str(args.updates * args.prompts_per_update),
               "--per_device_train_batch_size", str(args.prompts_per_update // 4), "--gradient_accumulation_steps", "4",
               *setup, "--output_dir", output_dir, *flags, *shlex.split(args.extra)]
    print("$", " ".join(command[1:]), flush=True)
    start = time.time()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    end_to_end = time.time() - start
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], end_to_end, output_dir


def steady_mean(steady: list[dict], key: str) -> float:
    """The mean of `key` over the updates after the first (0 where an update does not log it)."""
    return statistics.mean(m.get(key, 0.0) for m in steady)


def summarise(name: str, runs: list[tuple[list[dict], float, str]]) -> dict:
    """Medians over the repeated runs of one setting, and each run's numbers (`runs`, in the order they ran)."""
    rows = []
    for metrics, end_to_end, _ in runs:
        train = [m for m in metrics if "loss/policy_avg" in m]
        steady = train[1:]  # the first update pays for warm-up
        seconds = [b["time"] - a["time"] for a, b in zip(train, train[1:]) if "eval/gold_win_rate" not in b]
        mean = functools.partial(steady_mean, steady)
        finals = [m["eval/gold_win_rate"] for m in metrics if "eval/gold_win_rate" in m]
        # the sends after the first two, which touch each new shared buffer's pages for the first time
        sends = [m["time/weight_send"] for m in train[2:] if m.get("time/weight_send")]
        rows.append({"seconds_per_update": statistics.median(seconds), "generate": mean("time/generate"),
                     "weight_sync": mean("time/weight_sync"), "logprob_check": mean("time/logprob_check"),
                     "score": mean("time/score"), "train": mean("time/train"), "wait": mean("time/wait"),
                     "gold_win_rate": finals[-1] if finals else float("nan"), "staleness": mean("async/staleness"),
                     "engine_idle": mean("time/engine_idle"),
                     "token_staleness_mean": mean("async/token_staleness_mean"),
                     "token_staleness_max": max((m.get("async/token_staleness_max", 0.0) for m in steady), default=0),
                     "multi_version_share": mean("async/multi_version_share"),
                     "end_to_end": end_to_end, "weight_send": statistics.median(sends) if sends else float("nan")})
    return {"name": name, **{key: statistics.median(row[key] for row in rows) for key in rows[0]}, "runs": rows}


def memcpy_floor(policy: str) -> float:
    """Seconds of one copy of the policy's weights in memory, on one core (the trainer's): median of 5."""
    import torch
    from safetensors import safe_open

    with safe_open(os.path.join(policy, "model.safetensors"), "pt") as weights:
        numel = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    torch.set_num_threads(1)
    source, target = torch.randn(numel), torch.empty(numel)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(args: Args):
    with tempfile.TemporaryDirectory() as folder:
        sync, vllm = f"{args.algorithm}.py", f"{args.algorithm}_vllm.py"
        all_settings = {"hf": (f"sync, HF generate ({sync})", sync, ()),
                        "k0": ("sync, vLLM (K=0)", vllm, ("--async_steps", "0")),
                        "k1": ("async, vLLM (K=1)", vllm, ("--async_steps", "1")),
                        "shared": ("sync, vLLM shared (K=0)", vllm, ("--async_steps", "0", "--vllm_device", "shared")),
                        "inflight": ("async, vLLM in flight (K=1)", vllm, ("--async_steps", "1", "--inflight_updates"))}
        settings = [all_settings[key] for key in args.settings]
        runs = {name: [] for name, _, _ in settings}
        for _ in range(args.repeats):  # interleaved: the machine's drift spreads over every setting
            for name, script, flags in settings:
                runs[name].append(run(script, args, folder, *flags))
        results = [summarise(name, runs[name]) for name, _, _ in settings]
        if args.results_file:
            first_run = runs[settings[0][0]][0][2]
            write_results(args, dict(zip(args.settings, results)), off_policy_corrections.world(first_run))
    print(f"\n{'run':36} {'s/update':>9} {'end to end':>10} {'generate':>9} {'w-sync':>7} {'lp-check':>8}"
          f" {'score':>7} {'train':>7} {'wait':>7} {'stale':>6} {'gold win':>9}")
    for r in results:
        print(f"{r['name']:36} {r['seconds_per_update']:9.3f} {r['end_to_end']:10.1f} {r['generate']:9.3f}"
              f" {r['weight_sync']:7.3f} {r['logprob_check']:8.3f} {r['score']:7.3f} {r['train']:7.3f} {r['wait']:7.3f}"
              f" {r['staleness']:6.2f} {r['gold_win_rate']:9.3f}")
    report(args, dict(zip(args.settings, results)))


def write_results(args: Args, results: dict[str, dict], world: dict):
    """--results_file: the command, the date, the machine, the starting policy's build, each setting's medians and
    runs."""
    kept = {"command": ["python", "bench/async_speedup.py", *sys.argv[1:]], "args": dataclasses.asdict(args),
            "date": time.strftime("%Y-%m-%d"), "machine": off_policy_corrections.machine(), "world": world,
            "settings": results}
    off_policy_corrections.write_whole(args.results_file, kept)


def report(args: Args, results: dict[str, dict]):
    """The ratios between the settings that ran."""
    hf, k0, k1, inflight = (results.get(key) for key in ("hf", "k0", "k1", "inflight"))
    if k0 and k1:
        generation = k0["generate"] + k0["weight_sync"] + k0["logprob_check"]  # G: the generator's side of one update
        trainer = k0["score"] + k0["train"]  # T: the trainer's side of one update
        bound = (generation + trainer) / max(generation, trainer)
        speedup = k0["seconds_per_update"] / k1["seconds_per_update"]
        print(f"\nK=0 run: G = {generation:.3f} s (generate + weight sync + log-prob check), "
              f"T = {trainer:.3f} s (score + train)")
        print(f"overlap bound (G + T) / max(G, T) = {bound:.2f}x")
        print(f"K=1 over K=0: {speedup:.2f}x = {speedup / bound:.0%} of the bound")
        # why K=1 falls short of the bound: contention slows both sides when they run at once
        print(f"contention: in the K=1 run generation took {k1['generate'] / k0['generate']:.2f}x and training "
              f"{(k1['score'] + k1['train']) / trainer:.2f}x their K=0 times; the trainer waited {k1['wait']:.3f} s "
              "per update for the engine")
    if hf:
        for key, result in results.items():
            if key != "hf":
                print(f"{result['name']} over sync HF generate: "
                      f"{hf['seconds_per_update'] / result['seconds_per_update']:.2f}x per update, "
                      f"{hf['end_to_end'] / result['end_to_end']:.2f}x end to end")
    if k1 and inflight:
        print(f"in flight over K=1 whole batches: {k1['seconds_per_update'] / inflight['seconds_per_update']:.2f}x per "
              f"update, {k1['end_to_end'] / inflight['end_to_end']:.2f}x end to end; the trainer waited "
              f"{inflight['wait']:.3f} s per update (K=1: {k1['wait']:.3f} s), the engine idled "
              f"{inflight['engine_idle']:.3f} s per update; token staleness mean "
              f"{inflight['token_staleness_mean']:.2f}, "
              f"max {inflight['token_staleness_max']:.0f} (K=1: {k1['staleness']:.2f} for every token), "
              f"{inflight['multi_version_share']:.0%} of completions sampled by more than one version; final gold "
              f"win-rate {inflight['gold_win_rate']:.3f} (K=1: {k1['gold_win_rate']:.3f})")
    if k1:
        floor = memcpy_floor(real_size.build()["policy"] if args.real_size else toy.SFT_POLICY)
        print(f"the trainer's wait for a weight send (K=1, after the first two): {k1['weight_send']:.3f} s, "
              f"{k1['weight_send'] / floor:.1f}x one memory copy of the weights ({floor:.3f} s), "
              f"{k1['weight_send'] / k1['seconds_per_update']:.1%} of its update")

if __name__ == "__main__":
    main(tyro.cli(Args))
