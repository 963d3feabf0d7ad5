"""The paper's robustness finding on the toy task: how much does each algorithm lose when it
learns from off-policy data?

Every algorithm (online DPO, PPO, RLOO, best-of-k) trains from the same SFT policy on the same
number of prompts with the same optimizer steps and learning rate, twice: generating one mini-batch per optimizer
step (on-policy), and generating N mini-batches at once and then taking N steps, so the i-th step
trains on data i-1 updates stale (`--num_mini_batches`). PPO and RLOO take one epoch, as
in the paper's TL;DR runs, so every algorithm takes the same steps. Prints final gold win-rate and
KL per algorithm and setting (mean over seeds, with the spread) and the drop in win-rate from 1 to
N mini-batches. The paper's claim: online DPO is the most robust to off-policy data.

    python bench/off_policy.py             # about 5 minutes on 2 CPU cores
    python bench/off_policy.py --quick     # under a minute: 1 seed, 4 steps of 8 prompts (a smoke test, not a result)
"""

import contextlib
import importlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the algorithm scripts
SCRIPTS = ("online_dpo.py", "ppo.py", "rloo.py", "bok.py")


@dataclass
class Args:
    optimizer_steps: int = 16
    """optimizer steps per run (a multiple of --off_policy_mini_batches); few enough that no run reaches the
    toy task's ceiling"""
    prompts_per_step: int = 32
    """prompts per optimizer step (k samples each where the algorithm takes k)"""
    learning_rate: float = 6e-5
    """one learning rate for every algorithm: on-policy, each then ends this budget mid-way (about 20-45% gold
    win-rate), where staleness can show, rather than at the toy task's plateau or still at the SFT policy"""
    off_policy_mini_batches: int = 4
    """N: mini-batches per generated batch in the off-policy setting"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per algorithm and setting"""
    eval_num_prompts: int = 256
    """validation prompts of the final evaluation"""
    quick: bool = False
    """smoke test: 1 seed, 4 steps of 8 prompts, 32 evaluation prompts"""
    output_dir: str | None = None
    """where the runs and results.json go (default runs/bench-off-policy-<time>)"""


def train(script: str, mini_batches: int, seed: int, args: Args) -> dict:
    """Final evaluation of one run, with the batch arithmetic chosen so that only the number of
    mini-batches per generated batch differs between settings. The script's main() runs in this
    process (its output goes to <run>.log), so the many short runs do not each pay for imports."""
    name = f"{script.removesuffix('.py')}-mb{mini_batches}-seed{seed}"
    output_dir = os.path.join(args.output_dir, name)
    module = importlib.import_module(script.removesuffix(".py"))
    run_args = module.Args(seed=seed, output_dir=output_dir,
                           total_episodes=args.optimizer_steps * args.prompts_per_step,
                           per_device_train_batch_size=args.prompts_per_step, gradient_accumulation_steps=1,
                           num_mini_batches=mini_batches, learning_rate=args.learning_rate,
                           eval_every=10**6, eval_num_prompts=args.eval_num_prompts, num_epochs=1)
    print(f"{name}: {script} --num_mini_batches {mini_batches} --seed {seed}", flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, name + ".log"), "w") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        module.main(run_args)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "eval/gold_win_rate" in m][-1]


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def main(args: Args):
    if args.quick:
        args.optimizer_steps, args.prompts_per_step, args.seeds, args.eval_num_prompts = 4, 8, (1,), 32
    if args.optimizer_steps % args.off_policy_mini_batches:
        raise SystemExit(f"error: --optimizer_steps {args.optimizer_steps} is not a multiple of "
                         f"--off_policy_mini_batches {args.off_policy_mini_batches}")
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-off-policy-{int(time.time())}")
    settings = (1, args.off_policy_mini_batches)
    results = {script: {n: [train(script, n, seed, args) for seed in args.seeds] for n in settings}
               for script in SCRIPTS}

    n = args.off_policy_mini_batches
    print(f"\n{args.optimizer_steps} optimizer steps of {args.prompts_per_step} prompts, seeds {list(args.seeds)}; "
          f"{n} mini-batches: one generation per {n} steps, the i-th step i-1 updates stale")
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
    smallest = min(row["drop"] for row in table.values())
    most_robust = [script.removesuffix(".py") for script, row in table.items() if row["drop"] == smallest]
    verdict = ("as in the paper" if most_robust == ["online_dpo"] else
               "tied, so this run does not decide" if len(most_robust) > 1 else "unlike the paper")
    print(f"\nsmallest drop from 1 to {n} mini-batches: {', '.join(most_robust)} "
          f"({verdict}; the paper finds online DPO drops least)")
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)
    print(f"results in {args.output_dir}/results.json")


if __name__ == "__main__":
    main(tyro.cli(Args))
