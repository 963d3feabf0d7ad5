"""Credit per turn: every --turn_advantage on the two embedded environments where it matters, the same episodes'
rows, seeds and hyper-parameters for each. Which estimator reaches a target return in the fewest updates, and does
the policy's number of turns drift where the estimator is biased (turn_index_norm normalises per turn index, which
is biased wherever the policy decides when the episode stops: ALGORITHMS.md, "Credit per turn")?

  probe  toy:probe_answer_shaped: guess-the-number where a bare number is a probe and "answer N" ends the episode,
         with a potential-based shaping reward each turn (an episode's best shaped return is 2)
  lake   toy:lake_slippery: FrozenLake's 4x4 map, a third of the moves slipping to a side; reward 1 at the goal

Phase one, synchronous (grpo_multiturn.py): every estimator on each environment, every seed. Phase two: `episode`
and the estimator that reached the target soonest in phase one and held it (soonest), each at K =
1 (grpo_multiturn_vllm.py --async_steps 1) and in flight (--inflight_updates), every seed. Every run evaluates in
the trainer every --eval_every updates on --eval_rows rows. Prints per environment, mode and estimator the updates
to the target per seed, and against `episode` of the same seed (paired) their difference's median and range; the
same for the last evaluation's return and for the drift of the evaluated number of turns (the last evaluation's
against the first). A finished run (its `done` marker) is not run again, so an interrupted benchmark goes on where
it stopped when given the same --output_dir. Writes results.json there, with every run's evaluations, and for a full
run bench/results/turn_credit.json.

    python bench/turn_credit.py                          # 54 runs of 1-3 minutes each on 2 CPU cores
    python bench/turn_credit.py --envs probe --seeds 1   # one environment, one seed
    python bench/turn_credit.py --async_seeds 1          # phase two on seed 1 alone (the others' runs kept)
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
sys.path.insert(0, ROOT)

from toy.lake import LAKE_TURNS  # noqa: E402  (the kit's root on the path first)
from toy.probe import PROBE_TURNS  # noqa: E402

# name -> (--env, its policy and rows, --max_turns)
ENVS = {"probe": ("toy:probe_answer_shaped", "toy:probe_policy", "toy:probe_dataset", PROBE_TURNS),
        "lake": ("toy:lake_slippery", "toy:lake_policy", "toy:lake_dataset", LAKE_TURNS)}
ESTIMATORS = ("episode", "reward_to_go", "turn_index_norm", "unbiased", "gigpo")
MODES = {"sync": ("grpo_multiturn.py",), "k1": ("grpo_multiturn_vllm.py", "--async_steps", "1"),
         "inflight": ("grpo_multiturn_vllm.py", "--async_steps", "1", "--inflight_updates")}


@dataclass
class Args:
    envs: tuple[Literal["probe", "lake"], ...] = ("probe", "lake")
    """the environments (ENVS)"""
    estimators: tuple[Literal["episode", "reward_to_go", "turn_index_norm", "unbiased", "gigpo"], ...] = ESTIMATORS
    """the --turn_advantage values of phase one (episode, the baseline of every comparison, among them)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds of every arm, interleaved across the arms"""
    updates: int = 30
    """updates per run, of 32 rows x 4 episodes (the scripts' default batch)"""
    eval_every: int = 2
    """updates between evaluations (the points at which the target is looked for)"""
    eval_rows: int = 256
    """rows each evaluation plays (one near-greedy episode each)"""
    probe_target: float = 1.8
    """the probe environment's target eval/return_mean (shaped: 1 for every episode that answers, plus its win)"""
    lake_target: float = 0.5
    """the lake's target eval/return_mean (the best policy's chance within its turns is about 0.6)"""
    asynchronous: bool = True
    """phase two: episode and phase one's soonest estimator at K = 1 and in flight"""
    async_seeds: tuple[int, ...] | None = None
    """phase two's seeds (default: --seeds), e.g. those an interrupted benchmark finished"""
    extra: str = ""
    """flags given to every run, e.g. --extra="--learning_rate 3e-4\""""
    output_dir: str | None = None
    """where the runs and results.json go (default runs/bench-turn-credit-<time>)"""


def run_command(env: str, mode: str, estimator: str, seed: int, args: Args, output_dir: str) -> list[str]:
    """The command line of one run."""
    env_name, policy, dataset, max_turns = ENVS[env]
    return [sys.executable, os.path.join(ROOT, MODES[mode][0]), *MODES[mode][1:], "--env", env_name,
            "--model_name_or_path", policy, "--dataset_name", dataset, "--max_turns", str(max_turns),
            "--turn_advantage", estimator, "--total_episodes", str(args.updates * 32), "--seed", str(seed),
            "--eval_every", str(args.eval_every), "--eval_num_prompts", str(args.eval_rows),
            *([] if mode == "sync" else ["--eval_in_trainer"]), *shlex.split(args.extra), "--output_dir", output_dir]


def train(env: str, mode: str, estimator: str, seed: int, args: Args) -> list[dict]:
    """One run's evaluations: update, eval/return_mean, eval/turns_mean."""
    output_dir = os.path.join(args.output_dir, f"{env}-{mode}-{estimator}-seed{seed}")
    if not os.path.exists(os.path.join(output_dir, "done")):
        command = run_command(env, mode, estimator, seed, args, output_dir)
        print("$", " ".join(command[1:]), flush=True)
        shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted run starts over
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        if result.returncode:
            sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        open(os.path.join(output_dir, "done"), "w").close()
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    evals = [{"update": m["update"], "return": m["eval/return_mean"], "turns": m["eval/turns_mean"]}
             for m in lines if "eval/return_mean" in m]
    return sorted(evals, key=lambda m: m["update"])


def updates_to(evals: list[dict], target: float) -> int | None:
    """The first evaluated update whose return reaches `target` (None: never)."""
    return next((m["update"] for m in evals if m["return"] >= target), None)


def turn_drift(evals: list[dict]) -> float:
    """The evaluated number of turns at the end less at the start."""
    return evals[-1]["turns"] - evals[0]["turns"]


def spread(values: list[float], form: str = "{:+.1f}") -> str:
    """Median and range of per-seed values, or how many seeds have none."""
    if not values:
        return "-"
    return f"{form.format(statistics.median(values))} ({form.format(min(values))} to {form.format(max(values))})"


def soonest(arms: dict[str, dict[int, list[dict]]], target: float) -> str:
    """The estimator whose median over seeds of the updates to `target` is lowest, among those that reach it in
    every seed and hold it (the median over seeds of their last evaluation's return at `target` or above: a biased
    estimator can cross it on its way down); episode where none does."""
    reached = {name: statistics.median(updates_to(evals, target) for evals in by_seed.values())
               for name, by_seed in arms.items()
               if all(updates_to(evals, target) is not None for evals in by_seed.values())
               and statistics.median(evals[-1]["return"] for evals in by_seed.values()) >= target}
    return min(reached, key=lambda name: (reached[name], name != "episode")) if reached else "episode"


def table(runs: dict, targets: dict[str, float]) -> list[str]:
    """Per environment and mode, each estimator's updates to the target per seed, its last evaluation's return, and
    the drift of the turns; each against episode of the same seed: the paired difference (updates over the seeds
    where both reach the target). runs: env -> mode -> estimator -> seed -> evaluations."""
    rows = []
    for env, by_mode in runs.items():
        for mode, arms in by_mode.items():
            rows += [f"{env} ({ENVS[env][0]}), {mode}: target return {targets[env]:g}", "",
                     "| estimator | updates to target, per seed | minus episode's (paired) | last return | "
                     "minus episode's (paired) | turns drift | minus episode's (paired) |",
                     "|---|---|---|---|---|---|---|"]
            baseline = arms.get("episode", {})
            for estimator, by_seed in arms.items():
                reached = {seed: updates_to(evals, targets[env]) for seed, evals in by_seed.items()}
                last = {seed: evals[-1]["return"] for seed, evals in by_seed.items()}
                drift = {seed: turn_drift(evals) for seed, evals in by_seed.items()}
                per_seed = ", ".join(f"{seed}: {'-' if n is None else n}" for seed, n in sorted(reached.items()))
                theirs = {seed: updates_to(evals, targets[env]) for seed, evals in baseline.items()}
                paired = [n - theirs[seed] for seed, n in reached.items()
                          if n is not None and theirs.get(seed) is not None]
                last_paired = [r - baseline[seed][-1]["return"] for seed, r in last.items() if seed in baseline]
                drift_paired = [d - turn_drift(baseline[seed]) for seed, d in drift.items() if seed in baseline]
                against_episode = estimator != "episode"
                rows.append(f"| {estimator} | {per_seed} | {spread(paired) if against_episode else ''} | "
                            f"{spread(list(last.values()), '{:.2f}')} | "
                            f"{spread(last_paired, '{:+.2f}') if against_episode else ''} | "
                            f"{spread(list(drift.values()), '{:+.2f}')} | "
                            f"{spread(drift_paired, '{:+.2f}') if against_episode else ''} |")
            rows.append("")
    return rows


def main(args: Args):
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-turn-credit-{int(time.time())}")
    os.makedirs(args.output_dir, exist_ok=True)
    targets = {"probe": args.probe_target, "lake": args.lake_target}
    runs = {env: {"sync": {estimator: {} for estimator in args.estimators}} for env in args.envs}
    for seed in args.seeds:  # interleaved, so that a slow spell of a shared machine hits every arm alike
        for env in args.envs:
            for estimator in args.estimators:
                runs[env]["sync"][estimator][seed] = train(env, "sync", estimator, seed, args)
    if args.asynchronous:
        best = {env: soonest(runs[env]["sync"], targets[env]) for env in args.envs}
        for env in args.envs:
            for mode in ("k1", "inflight"):
                runs[env][mode] = {estimator: {} for estimator in dict.fromkeys(("episode", best[env]))}
        for seed in args.seeds if args.async_seeds is None else args.async_seeds:
            for env in args.envs:
                for mode in ("k1", "inflight"):
                    for estimator in runs[env][mode]:
                        runs[env][mode][estimator][seed] = train(env, mode, estimator, seed, args)
    print("\n".join(table(runs, targets)))
    destinations = [os.path.join(args.output_dir, "results.json")]
    if set(args.envs) == set(ENVS) and set(args.estimators) == set(ESTIMATORS) and len(args.seeds) >= 3:
        destinations.append(os.path.join(ROOT, "bench", "results", "turn_credit.json"))
    for destination in destinations:
        with open(destination, "w") as f:
            json.dump({"args": vars(args), "targets": targets, "runs": runs}, f)
    print(f"results in {' and '.join(destinations)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
