"""The scripts' default runs on the toy tasks (and two with LoRA), one after another: `python <script>` with its
defaults (its task built first, so that no run pays for a build), each run's seconds from launch to exit, its
evaluated score (gold win-rate, accuracy or return: the task's) at the start, at update 10 and at the end, and its KL
at the end. The toy tasks are built the same on one CPU every time, not across CPUs, so where a run ends is a
property of the build: the results file names the machine and each task's build (its starting policy's sha256) beside
the numbers.

    python bench/default_runs.py                                   # every run, about 10 minutes on 2 CPU cores
    python bench/default_runs.py --runs online_dpo ppo             # some of them
    python bench/default_runs.py --results_file bench/results/default_runs.json

bench/findings.py renders RESULTS.md's table of the default runs from the results file.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import off_policy_corrections  # noqa: E402  (bench/, this script's folder, is on the path: a build's sha256)

import toy  # noqa: E402  (the kit's root on the path first)

# name -> the command's flags after `python`, and the toy task it trains on (built before it is timed)
RUNS = {"online_dpo": (("online_dpo.py",), "tldr"), "ppo": (("ppo.py",), "tldr"), "rloo": (("rloo.py",), "tldr"),
        "bok": (("bok.py",), "tldr"), "grpo": (("grpo.py",), "tldr"),
        "grpo_dr_grpo": (("grpo.py", "--loss_type", "dr_grpo", "--scale_rewards", "none"), "tldr"),
        "grpo_gspo": (("grpo.py", "--loss_type", "grpo", "--importance_sampling_level", "sequence"), "tldr"),
        "online_dpo_vllm": (("online_dpo_vllm.py",), "tldr"), "rloo_vllm": (("rloo_vllm.py",), "tldr"),
        "ppo_vllm": (("ppo_vllm.py",), "tldr"), "grpo_vllm": (("grpo_vllm.py",), "tldr"),
        "grpo_math": (("grpo.py", "--preset", "toy-math"), "math"),
        "grpo_multiturn": (("grpo_multiturn.py",), "guess"),
        "grpo_multiturn_vllm": (("grpo_multiturn_vllm.py",), "guess"),
        # LoRA on the toy task (its adapters learn at a higher rate than the full policy's default)
        "online_dpo_vllm_lora": (("online_dpo_vllm.py", "--use_peft", "--learning_rate", "1e-3"), "tldr"),
        "ppo_lora": (("ppo.py", "--use_peft", "--learning_rate", "1e-3"), "tldr")}
BUILDS = {"tldr": toy.build, "math": toy.build_math, "guess": toy.build_guess}
SCORES = ("eval/gold_win_rate", "eval/accuracy", "eval/return_mean")  # a run's score: the first its evaluations log


@dataclasses.dataclass
class Args:
    runs: tuple[Literal[tuple(RUNS)], ...] = tuple(RUNS)
    """which default runs to make, in this order"""
    results_file: str | None = None
    """also write each run's numbers here as JSON, with the date, the machine and each task's build"""


def default_run(name: str, folder: str) -> dict:
    """One default run in `folder`: its seconds from launch to exit, and its score and KL at each evaluation."""
    flags, _ = RUNS[name]
    output_dir = os.path.join(folder, name)
    command = [sys.executable, *flags, "--output_dir", output_dir]
    print("$ python", " ".join(command[1:]), flush=True)
    start = time.time()
    result = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.time() - start
    if result.returncode:
        sys.exit(f"python {' '.join(flags)} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        evaluations = [m for m in map(json.loads, f) if any(score in m for score in SCORES)]
    score = next(score for score in SCORES if score in evaluations[0])
    return {"command": ["python", *flags], "seconds": seconds, "score": score.removeprefix("eval/"),
            "updates": [m["update"] for m in evaluations], "scores": [m[score] for m in evaluations],
            "kl": [m.get("eval/kl") for m in evaluations], "world": off_policy_corrections.world(output_dir)}


def main(args: Args):
    for task in dict.fromkeys(RUNS[name][1] for name in args.runs):
        BUILDS[task]()
    with tempfile.TemporaryDirectory() as folder:
        runs = {name: default_run(name, folder) for name in args.runs}
    print(f"\n{'run':22} {'seconds':>8} {'score':>16} {'start':>6} {'at 10':>6} {'end':>6} {'KL at the end':>14}")
    for name, run in runs.items():
        at_10 = dict(zip(run["updates"], run["scores"])).get(10)
        kl = run["kl"][-1]
        print(f"{name:22} {run['seconds']:8.0f} {run['score']:>16} {run['scores'][0]:6.3f} "
              f"{'-' if at_10 is None else f'{at_10:.3f}':>6} {run['scores'][-1]:6.3f} "
              f"{'-' if kl is None else f'{kl:.2f}':>14}")
    if args.results_file:
        off_policy_corrections.write_whole(args.results_file, {"date": time.strftime("%Y-%m-%d"),
                                                               "machine": off_policy_corrections.machine(),
                                                               "runs": runs})


if __name__ == "__main__":
    main(tyro.cli(Args))
