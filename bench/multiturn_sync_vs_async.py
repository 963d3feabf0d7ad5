"""Multi-turn GRPO, synchronous against asynchronous, where the environment's steps are slow: guess-the-number with
--env_latency seconds added to every step (the steps of a turn concurrent), swept over latencies. Where does the vLLM
engine playing the episodes one update ahead, or in flight, reach the same return in less time, and how close to
the overlap's bound?

  sync        grpo_multiturn.py: the trainer plays each batch's episodes with HF generate, then trains
  async       grpo_multiturn_vllm.py --async_steps 1: the engine plays batch t+1 while the trainer learns on t,
              turn by turn (every episode's turn waits for the turn's slowest step)
  continuous  the same with --continuous_episodes: each episode's next turn goes into the engine as soon as its
              step returns
  inflight    grpo_multiturn_vllm.py --async_steps 1 --inflight_updates: a batch's worth of episodes always in
              flight, new weights taken between decode steps, a batch the next groups to end

Each arm from the same SFT policy with the same rows and hyper-parameters (the scripts' defaults, 32 rows x 4
episodes an update), at each latency, several seeds, interleaved; evaluated every --eval_every updates on
--eval_rows rows (the evaluation plays with the same latency). Prints, per latency and arm, the median over seeds
of the final eval/return_mean and of the minutes to first reach each of --targets on three clocks (read_run): the
training clock (the updates' own time on the trainer's path), the wall clock since update 1 began (evaluations
in), and since launch; where an update's time goes, and the overlap's bound (G + T) / max(G, T) from the sync
arm's measured parts (G its generation, the environment's steps included; T its training); then the ratios.
A finished run (its `done` marker) is not run again, so an interrupted sweep goes on where it stopped when given
the same --output_dir. Writes results.json (with every run's per-update curves) there, and for a full run also
bench/results/multiturn_latency.json (multiturn_latency_engine_evaluation.json with --engine_evaluation).

    python bench/multiturn_sync_vs_async.py                                # about an hour on 2 CPU cores
    python bench/multiturn_sync_vs_async.py --latencies 0.5 --seeds 1 2    # one latency
    python bench/multiturn_sync_vs_async.py --quick                        # about a minute (a smoke test)
"""

import json
import os
import shlex
import shutil
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
# the clocks a target is timed on (read_run)
CLOCKS = ("training_minutes", "wall_minutes", "minutes")
# the per-update curves results.json keeps, besides the phases
CURVES = ("rollout/return_mean", "async/staleness", "async/token_staleness_mean", "env/step_time_median",
          "env/step_time_p95")
PHASES = {"sync": ("time/generate", "time/train"),
          **dict.fromkeys(("async", "continuous", "inflight"),
                          ("time/wait", "time/train", "time/weight_sync", "time/generate"))}


@dataclass
class Args:
    updates: int = 30
    """updates per run, of 32 rows x 4 episodes (the scripts' default batch)"""
    eval_every: int = 2
    """updates between evaluations (the points at which each target is looked for)"""
    eval_rows: int = 64
    """rows each evaluation plays (one near-greedy episode each)"""
    arms: tuple[Literal["sync", "async", "continuous", "inflight"], ...] = ("sync", "async", "inflight")
    """the arms, each with every seed"""
    latencies: tuple[float, ...] = (0.0, 0.1, 0.5, 2.0)
    """the values of --env_latency (seconds a step takes on top of the environment's own)"""
    latency_spread: float = 0.0
    """--env_latency_spread of every run (0: every step the latency; 1: log-normal with a heavy tail)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per arm, interleaved across the arms"""
    targets: tuple[float, ...] = (0.6, 0.8, 0.9)
    """the eval/return_mean values whose first crossing is timed (the SFT policy's is about 0.24, the ceiling 1)"""
    env: str = "toy:guess_number"
    """the environment of every arm"""
    extra: str = ""
    """flags given to every run, e.g. --extra="--num_epochs 4" (more training per batch: more for the engine to hide)"""
    engine_evaluation: bool = False
    """the vLLM arms evaluate in their engine (their scripts' default; in flight evaluates in the trainer anyway), so
    the wall clock leaves out their evaluations but not sync's; by default every arm evaluates in the trainer
    (--eval_in_trainer): the same work on every clock"""
    quick: bool = False
    """smoke test: sync and async at 0.1 s, 1 seed, 6 updates, evaluated at the start, update 3 and the end on 32
    rows"""
    output_dir: str | None = None
    """where the runs and results.json go (default runs/bench-multiturn-sync-vs-async-<time>)"""


def run_command(arm: str, latency: float, seed: int, args: Args, output_dir: str) -> list[str]:
    """The command line of one run."""
    return [sys.executable, os.path.join(ROOT, ARMS[arm][0]), *ARMS[arm][1:], "--env", args.env,
            "--env_latency", str(latency), "--env_latency_spread", str(args.latency_spread),
            "--total_episodes", str(args.updates * 32), "--seed", str(seed),
            "--eval_every", str(args.eval_every), "--eval_num_prompts", str(args.eval_rows),
            *([] if arm == "sync" or args.engine_evaluation else ["--eval_in_trainer"]),
            *shlex.split(args.extra), "--output_dir", output_dir]


def train(arm: str, latency: float, seed: int, args: Args) -> dict:
    """One run (read_run's numbers)."""
    output_dir = os.path.join(args.output_dir, f"{arm}-latency{latency:g}-seed{seed}")
    if not os.path.exists(os.path.join(output_dir, "done")):
        command = run_command(arm, latency, seed, args, output_dir)
        print("$", " ".join(command[1:]), flush=True)
        shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted run starts over
        launched = time.time()
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        if result.returncode:
            sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        with open(os.path.join(output_dir, "done"), "w") as f:
            json.dump({"launched": launched}, f)
    with open(os.path.join(output_dir, "done")) as f:
        return read_run(output_dir, json.load(f)["launched"], arm)


def read_run(output_dir: str, launched: float, arm: str) -> dict:
    """A run's evaluations, each with three clocks: its training minutes, the time of the updates before it on the
    trainer's path (TRAINER_PHASES: set-up, evaluations and logging left out; while the trainer evaluates, the
    engine of a vLLM arm goes on playing, so this clock flatters the vLLM arms by the earlier evaluations' time);
    its wall minutes since update 1 began (the earlier evaluations included, the same work in every arm, and the
    engine's start left out); and its minutes since launch. Also its updates' metrics, and its curves, per update,
    as results.json keeps them."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    evals, training_seconds, trained = [], 0.0, {}
    for line in metrics:
        if "loss/policy_avg" in line:
            training_seconds += sum(line.get(phase, 0.0) for phase in TRAINER_PHASES[arm])
            trained[line["update"]] = training_seconds
    first = next(line for line in metrics if line.get("update") == 1 and "loss/policy_avg" in line)
    began = first["time"] - sum(first.get(phase, 0.0) for phase in TRAINER_PHASES[arm])  # update 1's start
    for line in metrics:
        if "eval/return_mean" in line:  # an evaluation's line carries its update's time
            evals.append({"update": line["update"], "return": line["eval/return_mean"],
                          "minutes": (line["time"] - launched) / 60,
                          "training_minutes": trained.get(line["update"], 0.0) / 60,
                          "wall_minutes": max(line["time"] - began, 0.0) / 60})
    updates = [m for m in metrics if "loss/policy_avg" in m]
    curves = {"update": [m["update"] for m in updates],
              **{name: [m.get(name) for m in updates] for name in (*CURVES, *PHASES[arm], *TRAINER_PHASES[arm])}}
    return {"evals": sorted(evals, key=lambda m: m["update"]), "updates": updates, "curves": curves}


def minutes_to_target(run: dict, target: float, clock: str) -> float | None:
    return next((m[clock] for m in run["evals"] if m["return"] >= target), None)


def median_or_none(values: list) -> float | None:
    reached = [v for v in values if v is not None]
    return statistics.median(reached) if len(reached) == len(values) else None


def bound(phases: dict) -> float:
    """The overlap's bound from a sync run's parts: (G + T) / max(G, T), G its generation (the environment's steps
    included), T its training."""
    generate, train_ = phases["time/generate"], phases["time/train"]
    return (generate + train_) / max(generate, train_)


def main(args: Args):
    if args.quick:
        args.arms, args.latencies, args.updates, args.eval_every, args.seeds = ("sync", "async"), (0.1,), 6, 3, (1,)
        args.eval_rows = 32
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-multiturn-sync-vs-async-{int(time.time())}")
    os.makedirs(args.output_dir, exist_ok=True)
    runs = {latency: {arm: [] for arm in args.arms} for latency in args.latencies}
    for seed in args.seeds:  # interleaved, so that a slow spell of a shared machine hits every arm alike
        for latency in args.latencies:
            for arm in args.arms:
                runs[latency][arm].append(train(arm, latency, seed, args))

    table = {}
    for latency, by_arm in runs.items():
        print(f"\n--env_latency {latency:g} s (spread {args.latency_spread:g}), {args.updates} updates, seeds "
              f"{list(args.seeds)}, {args.env} {args.extra}")
        print(f"{'arm':10} {'final return':>13} " + "".join(f"{f'to {target} (train / wall min)':>28}"
                                                             for target in args.targets) + "  median update (s)")
        table[latency] = {}
        for arm, seeds in by_arm.items():
            row = {"final_returns": [run["evals"][-1]["return"] for run in seeds],
                   **{f"{clock}_to_{target}": [minutes_to_target(run, target, clock) for run in seeds]
                      for clock in CLOCKS for target in args.targets},
                   "total_minutes": [run["evals"][-1]["minutes"] for run in seeds],
                   "training_minutes_total": [run["evals"][-1]["training_minutes"] for run in seeds],
                   "phases": {phase: statistics.median(m[phase] for run in seeds for m in run["updates"])
                              for phase in PHASES[arm]},
                   "curves": [{"evals": run["evals"], **run["curves"]} for run in seeds]}
            table[latency][arm] = row
            reached = []
            for target in args.targets:
                training, wall = (median_or_none(row[f"{clock}_to_{target}"]) for clock in ("training_minutes",
                                                                                               "wall_minutes"))
                reached.append("not reached" if training is None else f"{training:.2f} / {wall:.2f}")
            print(f"{arm:10} {statistics.median(row['final_returns']):13.3f} "
                  + "".join(f"{text:>28}" for text in reached) + "  "
                  + ", ".join(f"{phase.removeprefix('time/')} {value:.3f}" for phase, value in row["phases"].items()))
        if "sync" in by_arm:
            table[latency]["bound"] = bound(table[latency]["sync"]["phases"])
            print(f"the overlap's bound from sync's parts: {table[latency]['bound']:.2f}x")
        for arm in (arm for arm in args.arms if arm != "sync" and "sync" in args.arms):
            for target in args.targets:
                for clock in CLOCKS:
                    sync, faster = (median_or_none(table[latency][name][f"{clock}_to_{target}"])
                                    for name in ("sync", arm))
                    ratio = f"{sync / faster:.2f}x" if sync and faster else "not reached by both"
                    print(f"{arm} vs sync, {clock.replace('_', ' ')} to return {target}: {ratio}")
            per_update = (statistics.median(table[latency]["sync"]["training_minutes_total"])
                          / statistics.median(table[latency][arm]["training_minutes_total"]))
            print(f"{arm} vs sync, training minutes of the {args.updates} updates: {per_update:.2f}x")
    destinations = [os.path.join(args.output_dir, "results.json")]
    if not args.quick:
        name = "multiturn_latency_engine_evaluation" if args.engine_evaluation else "multiturn_latency"
        destinations.append(os.path.join(ROOT, "bench", "results", f"{name}.json"))
    for destination in destinations:
        with open(destination, "w") as f:
            json.dump({"args": vars(args), "table": table}, f)
    print(f"results in {' and '.join(destinations)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
