"""The paper's robustness finding on the toy task: how much does each algorithm lose when it
learns from off-policy data?

Every algorithm (online DPO, PPO, RLOO, best-of-k) trains from the same SFT policy on the same
prompts twice: with 1 mini-batch per generated batch (on-policy) and with N mini-batches, where the
i-th mini-batch is trained on after i-1 optimizer steps, so it is i-1 updates stale. Same
episodes, same batch per generation, same learning rate. Prints final gold win-rate and KL per
algorithm and setting (mean over seeds, with the spread) and the drop from 1 to N. The paper's
claim: online DPO is the most robust to off-policy data.

    python bench/off_policy.py             # about 12 minutes on 2 CPU cores
    python bench/off_policy.py --quick     # about a minute: 1 seed, 2 updates (a smoke test, not a result)
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
SCRIPTS = ("online_dpo.py", "ppo.py", "rloo.py", "bok.py")


@dataclass
class Args:
    updates: int = 10
    """generated batches per run; short enough that no run has reached the toy task's ceiling"""
    prompts_per_update: int = 64
    """prompts per generated batch (k samples each where the algorithm takes k)"""
    off_policy_mini_batches: int = 4
    """N: mini-batches per generated batch in the off-policy setting"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per algorithm and setting"""
    eval_num_prompts: int = 256
    """validation prompts of the final evaluation"""
    quick: bool = False
    """smoke test: 1 seed, 2 updates of 16 prompts, 32 evaluation prompts"""
    output_dir: str | None = None
    """where the runs and results.json go (default runs/bench-off-policy-<time>)"""


def train(script: str, mini_batches: int, seed: int, args: Args) -> dict:
    """Final evaluation of one run, with the batch arithmetic chosen so that only the number of
    mini-batches per generated batch differs between settings."""
    output_dir = os.path.join(args.output_dir, f"{script.removesuffix('.py')}-mb{mini_batches}-seed{seed}")
    micro_batch = args.prompts_per_update // args.off_policy_mini_batches
    command = [sys.executable, os.path.join(ROOT, script), "--seed", str(seed), "--output_dir", output_dir,
               "--total_episodes", str(args.updates * args.prompts_per_update),
               "--per_device_train_batch_size", str(micro_batch), "--num_mini_batches", str(mini_batches),
               "--gradient_accumulation_steps", str(args.prompts_per_update // (micro_batch * mini_batches)),
               "--eval_every", str(10**6), "--eval_num_prompts", str(args.eval_num_prompts)]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "eval/gold_win_rate" in m][-1]


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def main(args: Args):
    if args.quick:
        args.updates, args.prompts_per_update, args.seeds, args.eval_num_prompts = 2, 16, (1,), 32
    if args.prompts_per_update % args.off_policy_mini_batches:
        raise SystemExit(f"error: --prompts_per_update {args.prompts_per_update} is not a multiple of "
                         f"--off_policy_mini_batches {args.off_policy_mini_batches}")
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-off-policy-{int(time.time())}")
    settings = (1, args.off_policy_mini_batches)
    results = {script: {n: [train(script, n, seed, args) for seed in args.seeds] for n in settings}
               for script in SCRIPTS}

    n = args.off_policy_mini_batches
    print(f"\n{args.updates} updates x {args.prompts_per_update} prompts, seeds {list(args.seeds)}; "
          f"{n} mini-batches: the i-th is i-1 updates stale")
    print(f"{'algorithm':12} {'win-rate, 1 mb':>16} {f'win-rate, {n} mb':>16} {'drop':>7} "
          f"{'KL, 1 mb':>8} {f'KL, {n} mb':>8}")
    table = {}
    for script, by_setting in results.items():
        win = {s: [r["eval/gold_win_rate"] for r in runs] for s, runs in by_setting.items()}
        kl = {s: statistics.mean(r["eval/kl"] for r in runs) for s, runs in by_setting.items()}
        drop = statistics.mean(win[1]) - statistics.mean(win[n])
        table[script] = {"win_rate": win, "kl": kl, "drop": drop}
        print(f"{script.removesuffix('.py'):12} {spread(win[1]):>16} {spread(win[n]):>16} {drop:7.3f} "
              f"{kl[1]:8.2f} {kl[n]:8.2f}")
    most_robust = min(table, key=lambda script: table[script]["drop"])
    print(f"\nsmallest drop from 1 to {n} mini-batches: {most_robust.removesuffix('.py')} "
          f"({'as' if most_robust == 'online_dpo.py' else 'unlike'} the paper, where online DPO drops least)")
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)
    print(f"results in {args.output_dir}/results.json")


if __name__ == "__main__":
    main(tyro.cli(Args))
