"""The paper's math finding on the embedded arithmetic task: does asynchronous RL reach the same accuracy
as synchronous RL in less wall-clock time? (The paper: online DPO on GSM8k with Rho-1B, about 70%
faster at matched accuracy.)

Online DPO, RLOO and GRPO (as DAPO, the preset: dapo loss, clip-higher, dynamic sampling; and as Dr.
GRPO: dr_grpo loss, unscaled advantages, neither extra), each from the same SFT policy with the same prompts
and hyper-parameters (the scripts' `--preset toy-math`), several seeds each:
  sync   online_dpo.py / rloo.py / grpo.py: generate with HF `generate`, then train
  async  online_dpo_vllm.py / rloo_vllm.py / grpo_vllm.py --async_steps 1: the vLLM engine samples batch t+1
         while the trainer learns on t
  inflight (with --arms ... inflight) the same with --inflight_updates: the engine takes each new version
         between two decode steps (GRPO as Dr. GRPO only: DAPO's dynamic sampling needs whole batches)
Draws eval/accuracy against wall-clock time since launch (accuracy_vs_time.png) and prints the final
accuracy (mean and spread over seeds) and the time to first reach --target_accuracy.

    python bench/math_sync_vs_async.py            # about 20 minutes on 2 CPU cores
    python bench/math_sync_vs_async.py --quick    # about a minute: online DPO, 1 seed, 16 updates (a smoke test)
    python bench/math_sync_vs_async.py --arms async inflight --algorithms online_dpo grpo_dr_grpo
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = {  # name: (script, its flags beyond the preset)
    "online_dpo": ("online_dpo", ()), "rloo": ("rloo", ()), "grpo_dapo": ("grpo", ()),
    "grpo_dr_grpo": ("grpo", ("--loss_type", "dr_grpo", "--scale_rewards", "none", "--epsilon_high", "0.2",
                              "--no_dynamic_sampling")),
}
ARMS = {"sync": ("{algorithm}.py",), "async": ("{algorithm}_vllm.py", "--async_steps", "1"),
        "inflight": ("{algorithm}_vllm.py", "--async_steps", "1", "--inflight_updates")}


@dataclass
class Args:
    algorithms: tuple[Literal["online_dpo", "rloo", "grpo_dapo", "grpo_dr_grpo"], ...] = tuple(ALGORITHMS)
    """the algorithms, each in every arm"""
    arms: tuple[Literal["sync", "async", "inflight"], ...] = ("sync", "async")
    """the arms: sync, async (K=1 whole batches), inflight (K=1 with in-flight weight updates)"""
    updates: int = 24
    """updates per run, of 64 prompts x 4 samples (the toy-math presets' batch)"""
    eval_every: int = 2
    """updates between evaluations (the points of the curves)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per arm"""
    target_accuracy: float = 0.9
    """the accuracy whose first crossing is timed"""
    quick: bool = False
    """smoke test: online DPO, sync and async, 1 seed, 16 updates, evaluated at the start and the end on 64
    problems"""
    output_dir: str | None = None
    """where the runs, accuracy_vs_time.png and results.json go (default runs/bench-math-sync-vs-async-<time>)"""


def train(algorithm: str, arm: str, seed: int, args: Args) -> list[dict]:
    """One run's evaluations, each with the minutes since the run was launched (set-up included)."""
    output_dir = os.path.join(args.output_dir, f"{algorithm}-{arm}-seed{seed}")
    script, *flags = ARMS[arm]
    name, algorithm_flags = ALGORITHMS[algorithm]
    command = [sys.executable, os.path.join(ROOT, script.format(algorithm=name)), *flags, "--preset", "toy-math",
               *algorithm_flags,
               "--total_episodes", str(args.updates * 64), "--seed", str(seed), "--eval_every", str(args.eval_every),
               *(["--eval_num_prompts", "64"] if args.quick else []), "--output_dir", output_dir]
    print("$", " ".join(command[1:]), flush=True)
    launched = time.time()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        evals = [m for m in map(json.loads, f) if "eval/accuracy" in m]
    return [{**m, "minutes": (m["time"] - launched) / 60} for m in evals]


def minutes_to_target(evals: list[dict], target: float) -> float | None:
    return next((m["minutes"] for m in evals if m["eval/accuracy"] >= target), None)


def plot(runs: dict[tuple[str, str], list[list[dict]]], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algorithms = list(dict.fromkeys(algorithm for algorithm, _ in runs))
    figure, axes = plt.subplots(1, len(algorithms), figsize=(6 * len(algorithms), 4.5), constrained_layout=True,
                                sharey=True, squeeze=False)  # one algorithm: still a row of axes
    for axis, algorithm in zip(axes[0], algorithms):
        for color, arm in zip(("tab:blue", "tab:orange", "tab:green"), dict.fromkeys(arm for _, arm in runs)):
            for i, evals in enumerate(runs[algorithm, arm]):
                axis.plot([m["minutes"] for m in evals], [m["eval/accuracy"] for m in evals], color=color,
                          marker="o", markersize=3, alpha=0.8, label=arm if i == 0 else None)
        axis.set_title(f"{algorithm} on the arithmetic task")
        axis.set_xlabel("wall-clock minutes since launch")
        axis.grid(alpha=0.3)
        axis.legend()
    axes[0][0].set_ylabel("eval/accuracy (greedy, held-out problems)")
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(args: Args):
    if args.quick:
        args.algorithms, args.updates, args.eval_every, args.seeds = ("online_dpo",), 16, 16, (1,)
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-math-sync-vs-async-{int(time.time())}")
    # seeds interleaved across arms, so that a slow spell of a shared machine hits every arm alike
    if "inflight" in args.arms and "grpo_dapo" in args.algorithms:
        sys.exit("grpo_dapo's dynamic sampling needs whole batches: run grpo_dr_grpo in the inflight arm")
    runs = {(algorithm, arm): [] for algorithm in args.algorithms for arm in args.arms}
    for seed in args.seeds:
        for algorithm, arm in runs:
            runs[algorithm, arm].append(train(algorithm, arm, seed, args))
    plot(runs, os.path.join(args.output_dir, "accuracy_vs_time.png"))

    print(f"\n{args.updates} updates, seeds {list(args.seeds)}, target accuracy {args.target_accuracy}")
    print(f"{'run':18} {'start':>6} {'final accuracy':>16} {'minutes to target':>18} {'total minutes':>14}")
    table = {}
    for (algorithm, arm), seeds in runs.items():
        finals = [evals[-1]["eval/accuracy"] for evals in seeds]
        to_target = [minutes_to_target(evals, args.target_accuracy) for evals in seeds]
        reached = [t for t in to_target if t is not None]
        total = statistics.mean(evals[-1]["minutes"] for evals in seeds)
        table[f"{algorithm} {arm}"] = {"start_accuracy": seeds[0][0]["eval/accuracy"], "final_accuracies": finals,
                                       "minutes_to_target": to_target, "total_minutes": total}
        final = f"{statistics.mean(finals):.3f}" + (f" ± {statistics.stdev(finals):.3f}" if len(finals) > 1 else "")
        target = (f"{statistics.mean(reached):.2f} ({len(reached)}/{len(seeds)} runs)" if reached else "not reached")
        print(f"{algorithm + ' ' + arm:18} {seeds[0][0]['eval/accuracy']:6.3f} {final:>16} {target:>18} {total:14.2f}")
    pairs = [(slow, fast) for slow, fast in (("sync", "async"), ("async", "inflight"), ("sync", "inflight"))
             if {slow, fast} <= set(args.arms)]
    for algorithm in args.algorithms:
        for slow_arm, fast_arm in pairs:
            slow, fast = table[f"{algorithm} {slow_arm}"], table[f"{algorithm} {fast_arm}"]
            reached = [[t for t in row["minutes_to_target"] if t is not None] for row in (slow, fast)]
            to_target = (f"{statistics.mean(reached[0]) / statistics.mean(reached[1]):.2f}x" if all(reached)
                         else "not reached by both")
            print(f"{algorithm} {fast_arm} vs {slow_arm}: total time "
                  f"{slow['total_minutes'] / fast['total_minutes']:.2f}x, time to target {to_target}, final accuracy "
                  f"{statistics.mean(fast['final_accuracies']) - statistics.mean(slow['final_accuracies']):+.3f}")
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)
    print(f"figure and results in {args.output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
