"""Multi-turn GRPO, synchronous against asynchronous, where generation and the environment dominate: guess-the-number
with a simulated tool latency (toy:guess_number_slow, 25-75 ms a step, the steps of a turn concurrent). Does the
vLLM engine playing the episodes one update ahead reach the same return in less wall-clock time?

  sync        grpo_multiturn.py: the trainer plays each batch's episodes with HF generate, then trains
  async       grpo_multiturn_vllm.py --async_steps 1: the engine plays batch t+1 while the trainer learns on t,
              turn by turn (every episode's turn waits for the turn's slowest step)
  continuous  the same with --continuous_episodes: each episode's next turn goes into the engine as soon as its
              step returns
  inflight    grpo_multiturn_vllm.py --async_steps 1 --inflight_updates: a batch's worth of episodes always in
              flight, new weights taken between decode steps, a batch the next groups to end

Each arm from the same SFT policy with the same rows and hyper-parameters (the scripts' defaults: 40 updates of 32
rows x 4 episodes), several seeds, interleaved. Prints, per arm, the median over seeds of the final
eval/return_mean, of the minutes to first reach --target_return (since launch, and in training: the updates' own
time, set-up and evaluations left out), and where an update's time goes (the median update's time/* metrics);
then the ratios.

    python bench/multiturn_sync_vs_async.py            # about 9 minutes on 2 CPU cores
    python bench/multiturn_sync_vs_async.py --quick    # about a minute: 1 seed, 10 updates (a smoke test)
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"sync": ("grpo_multiturn.py",), "async": ("grpo_multiturn_vllm.py", "--async_steps", "1"),
        "continuous": ("grpo_multiturn_vllm.py", "--async_steps", "1", "--continuous_episodes"),
        "inflight": ("grpo_multiturn_vllm.py", "--async_steps", "1", "--inflight_updates")}
# where an update's time goes: the sync script's rollout is time/generate; the async trainer's, time/wait (for the
# engine's batch), while the engine's own time/generate runs beside the training. TRAINER_PHASES: an update's time
# on the trainer's path (what the training clock adds up)
TRAINER_PHASES = {"sync": ("time/generate", "time/score", "time/train"),
                  **dict.fromkeys(("async", "continuous", "inflight"),
                                  ("time/wait", "time/score", "time/train", "time/weight_send"))}
PHASES = {"sync": ("time/generate", "time/train"),
          **dict.fromkeys(("async", "continuous", "inflight"),
                          ("time/wait", "time/train", "time/weight_sync", "time/generate"))}


@dataclass
class Args:
    updates: int = 40
    """updates per run, of 32 rows x 4 episodes (the scripts' default batch)"""
    eval_every: int = 5
    """updates between evaluations (the points at which the target is looked for)"""
    arms: tuple[Literal["sync", "async", "continuous", "inflight"], ...] = tuple(ARMS)
    """the arms, each with every seed"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per arm, interleaved across the arms"""
    target_return: float = 0.6
    """the eval/return_mean whose first crossing is timed (the SFT policy's is 0.24, the ceiling 1)"""
    env: str = "toy:guess_number_slow"
    """the environment of both arms"""
    extra: str = ""
    """flags given to both arms, e.g. --extra="--num_epochs 4" (more training per batch: more for the engine to hide)"""
    quick: bool = False
    """smoke test: sync and async, 1 seed, 10 updates, evaluated at the start and the end on 32 rows"""
    output_dir: str | None = None
    """where the runs and results.json go (default runs/bench-multiturn-sync-vs-async-<time>)"""


def train(arm: str, seed: int, args: Args) -> dict:
    """One run (read_run's numbers)."""
    output_dir = os.path.join(args.output_dir, f"{arm}-seed{seed}")
    command = [sys.executable, os.path.join(ROOT, ARMS[arm][0]), *ARMS[arm][1:], "--env", args.env,
               "--total_episodes", str(args.updates * 32), "--seed", str(seed), "--eval_every", str(args.eval_every),
               *(["--eval_num_prompts", "32"] if args.quick else []), *shlex.split(args.extra),
               "--output_dir", output_dir]
    print("$", " ".join(command[1:]), flush=True)
    launched = time.time()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return read_run(output_dir, launched, arm)


def read_run(output_dir: str, launched: float, arm: str) -> dict:
    """A run's evaluations, each with the minutes since launch and its training minutes: the time of the updates
    before it on the trainer's path (TRAINER_PHASES: set-up, evaluations and logging left out; the trainer
    evaluates with HF generate in both arms, on one core beside the engine in the async one); and its updates'
    metrics."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    evals, training_seconds = [], 0.0
    for line in metrics:
        training_seconds += sum(line.get(phase, 0.0) for phase in TRAINER_PHASES[arm])
        if "eval/return_mean" in line:
            evals.append({"return": line["eval/return_mean"], "minutes": (line["time"] - launched) / 60,
                          "training_minutes": training_seconds / 60})
    return {"evals": evals, "updates": [m for m in metrics if "loss/policy_avg" in m]}


def minutes_to_target(run: dict, target: float, clock: str) -> float | None:
    return next((m[clock] for m in run["evals"] if m["return"] >= target), None)


def median_or_none(values: list) -> float | None:
    reached = [v for v in values if v is not None]
    return statistics.median(reached) if len(reached) == len(values) else None


def main(args: Args):
    if args.quick:
        args.arms, args.updates, args.eval_every, args.seeds = ("sync", "async"), 10, 10, (1,)
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-multiturn-sync-vs-async-{int(time.time())}")
    runs = {arm: [] for arm in args.arms}
    for seed in args.seeds:  # interleaved, so that a slow spell of a shared machine hits every arm alike
        for arm in args.arms:
            runs[arm].append(train(arm, seed, args))

    table = {}
    print(f"\n{args.updates} updates, seeds {list(args.seeds)}, {args.env} {args.extra}, target return "
          f"{args.target_return}")
    print(f"{'arm':10} {'final return':>13} {'min to target':>14} {'training min to target':>23} {'total min':>10}  "
          "median update (s)")
    for arm, seeds in runs.items():
        row = {"final_returns": [run["evals"][-1]["return"] for run in seeds],
               **{f"{clock}_to_target": [minutes_to_target(run, args.target_return, clock) for run in seeds]
                  for clock in ("minutes", "training_minutes")},
               "total_minutes": [run["evals"][-1]["minutes"] for run in seeds],
               "training_minutes_total": [run["evals"][-1]["training_minutes"] for run in seeds],
               "phases": {phase: statistics.median(m[phase] for run in seeds for m in run["updates"])
                          for phase in PHASES[arm]}}
        table[arm] = row
        to_target, training = (median_or_none(row[f"{clock}_to_target"]) for clock in ("minutes", "training_minutes"))
        print(f"{arm:10} {statistics.median(row['final_returns']):13.3f} "
              f"{'not reached' if to_target is None else f'{to_target:.2f}':>14} "
              f"{'not reached' if training is None else f'{training:.2f}':>23} "
              f"{statistics.median(row['total_minutes']):10.2f}  "
              + ", ".join(f"{phase.removeprefix('time/')} {value:.3f}" for phase, value in row["phases"].items()))
    for arm in (arm for arm in args.arms if arm != "sync" and "sync" in args.arms):
        for clock in ("minutes", "training_minutes"):
            sync, faster = (median_or_none(table[name][f"{clock}_to_target"]) for name in ("sync", arm))
            ratio = f"{sync / faster:.2f}x" if sync and faster else "not reached by both"
            print(f"{arm} vs sync, {clock.replace('_', ' ')} to return {args.target_return}: {ratio}")
        for clock in ("total_minutes", "training_minutes_total"):
            total = statistics.median(table["sync"][clock]) / statistics.median(table[arm][clock])
            print(f"{arm} vs sync, {clock.replace('_', ' ')}: {total:.2f}x")
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)
    print(f"results in {args.output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
