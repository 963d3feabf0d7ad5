"""The paper's headline finding on the toy task: does asynchronous online DPO reach the same gold
win-rate as synchronous online DPO in less wall-clock time?

From the same SFT policy, with the same prompts and hyper-parameters, several seeds each:
  sync HF   online_dpo.py: generate with HF `generate`, then train (the synchronous baseline)
  sync vLLM online_dpo_vllm.py --async_steps 0: the same engine as async, but waiting for it
  async     online_dpo_vllm.py --async_steps 1: the engine samples batch t+1 while the trainer learns on t
Draws gold win-rate against wall-clock time since launch (win_rate_vs_time.png) and prints final
gold win-rate (mean and spread over seeds) and the time to first reach --target_win_rate.
"sync vLLM" separates the effect of asynchrony from that of the generation engine.

    python bench/sync_vs_async.py            # about 13 minutes on 2 CPU cores
    python bench/sync_vs_async.py --quick    # about a minute: 1 seed, 3 updates, no "sync vLLM" (a smoke test)
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"sync HF": ("online_dpo.py",), "sync vLLM": ("online_dpo_vllm.py", "--async_steps", "0"),
        "async": ("online_dpo_vllm.py", "--async_steps", "1")}


@dataclass
class Args:
    updates: int = 50
    """updates per run, of 64 prompts x 2 samples (the scripts' default batch)"""
    eval_every: int = 5
    """updates between evaluations (the points of the curves)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per arm"""
    target_win_rate: float = 0.5
    """the win-rate whose first crossing is timed"""
    quick: bool = False
    """smoke test: 1 seed, 3 updates of 16 prompts, 32 evaluation prompts, arms "sync HF" and "async" only"""
    output_dir: str | None = None
    """where the runs, win_rate_vs_time.png and results.json go (default runs/bench-sync-vs-async-<time>)"""


def train(arm: str, seed: int, args: Args) -> list[dict]:
    """One run's evaluations, each with the minutes since the run was launched (set-up included)."""
    output_dir = os.path.join(args.output_dir, f"{arm.replace(' ', '-')}-seed{seed}")
    size = ["--total_episodes", str(args.updates * 16), "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "2", "--eval_num_prompts", "32"] if args.quick else [
        "--total_episodes", str(args.updates * 64)]
    command = [sys.executable, os.path.join(ROOT, ARMS[arm][0]), *ARMS[arm][1:], *size, "--seed", str(seed),
               "--eval_every", str(args.eval_every), "--output_dir", output_dir]
    print("$", " ".join(command[1:]), flush=True)
    launched = time.time()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        evals = [m for m in map(json.loads, f) if "eval/gold_win_rate" in m]
    return [{**m, "minutes": (m["time"] - launched) / 60} for m in evals]


def minutes_to_target(evals: list[dict], target: float) -> float | None:
    return next((m["minutes"] for m in evals if m["eval/gold_win_rate"] >= target), None)


def plot(runs: dict[str, list[list[dict]]], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for color, (arm, seeds) in zip(("tab:blue", "tab:gray", "tab:orange"), runs.items()):
        for i, evals in enumerate(seeds):
            axis.plot([m["minutes"] for m in evals], [m["eval/gold_win_rate"] for m in evals], color=color,
                      marker="o", markersize=3, alpha=0.8, label=arm if i == 0 else None)
    axis.set_xlabel("wall-clock minutes since launch")
    axis.set_ylabel("gold win-rate")
    axis.set_title("online DPO on the toy task: synchronous vs asynchronous")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(args: Args):
    arms = list(ARMS)
    if args.quick:
        args.updates, args.eval_every, args.seeds, arms = 3, 3, (1,), ["sync HF", "async"]
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-sync-vs-async-{int(time.time())}")
    runs = {arm: [train(arm, seed, args) for seed in args.seeds] for arm in arms}
    plot(runs, os.path.join(args.output_dir, "win_rate_vs_time.png"))

    print(f"\n{args.updates} updates, seeds {list(args.seeds)}, target win-rate {args.target_win_rate}")
    print(f"{'arm':10} {'final win-rate':>16} {'minutes to target':>18} {'total minutes':>14}")
    table = {}
    for arm, seeds in runs.items():
        finals = [evals[-1]["eval/gold_win_rate"] for evals in seeds]
        to_target = [minutes_to_target(evals, args.target_win_rate) for evals in seeds]
        reached = [t for t in to_target if t is not None]
        total = statistics.mean(evals[-1]["minutes"] for evals in seeds)
        table[arm] = {"final_win_rates": finals, "minutes_to_target": to_target, "total_minutes": total}
        final = f"{statistics.mean(finals):.3f}" + (f" ± {statistics.stdev(finals):.3f}" if len(finals) > 1 else "")
        target = (f"{statistics.mean(reached):.2f} ({len(reached)}/{len(seeds)} runs)" if reached else "not reached")
        print(f"{arm:10} {final:>16} {target:>18} {total:14.2f}")
    base, fast = table["sync HF"], table["async"]
    print(f"\nasync vs sync HF: total time {base['total_minutes'] / fast['total_minutes']:.2f}x, final win-rate "
          f"{statistics.mean(fast['final_win_rates']) - statistics.mean(base['final_win_rates']):+.3f}")
    if "sync vLLM" in table:
        print(f"async vs sync vLLM (same engine): total time "
              f"{table['sync vLLM']['total_minutes'] / fast['total_minutes']:.2f}x")
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)
    print(f"figure and results in {args.output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
