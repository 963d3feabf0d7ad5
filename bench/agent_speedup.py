"""Where asynchrony pays an agent: multi-hop questions answered by search (--env toy:hops, episodes of 2 to 9 turns,
tens of updates to learn) with a search step whose latency has a long tail, synchronous against the engine's ways of
playing ahead. Does an arm reach the same return sooner, on the clock from launch (engine start and pipeline fill
in) and from update 1, and by how much against the bound that overlap alone allows?

  sync        grpo_multiturn.py: the trainer plays each batch's episodes with HF generate, then trains
  k1          grpo_multiturn_vllm.py --async_steps 1: the engine plays batch t+1 turn by turn while the trainer learns
              on t (each turn waits for the turn's slowest step)
  continuous  the same with --continuous_episodes: an episode's next turn goes into the engine when its step returns
  inflight    --async_steps 1 --inflight_updates: a batch's worth of episodes always in flight, new weights taken
              between decode steps, a batch the first groups to end
  inflight2   the same with --inflight_batches 2: two batches' worth in flight, so that a batch waits less for the
              slowest groups (not among the default arms)

Every run starts from the same SFT policy with the same rows, seed and hyper-parameters (the scripts' defaults but a
constant learning rate), and saves its policy every --snapshot_every updates (no evaluation in the run: its clock
holds training alone). After a run, outside every clock, one evaluator plays each snapshot (and the SFT start)
near-greedy on the --eval_rows validation questions, with no latency, the same code for every arm
(grpo_multiturn.evaluate). A snapshot's times are its update's metrics line's, from launch and from update 1's
start. Per latency, printed and kept (results.json, with every run's curve):
- per arm, the median over seeds of the last return, the seconds per update, the fill (minutes from launch to the
  end of update 1), and the update and the minutes (both clocks) of each --levels return's first reaching (the first
  snapshot at or above it), over the seeds that reached it;
- per arm against sync, seed by seed (paired): sync's time to each level over the arm's, and the arm's mean return
  over sync's whole time (the area under return against time over it, the arm's last return held after its end)
  over sync's, each as the median with a bootstrap 95% interval (seeds resampled --bootstrap times), with the updates
  to the level (the arm's more: staleness's cost) and the seconds per update (sync's over the arm's);
- the overlap's bound: (G + T) / max(G, T) from sync's median generation G (its environment's steps included) and
  training T per update, what running them side by side alone can give; an arm that no longer waits for a turn's
  slowest step can beat it, which its seconds per update show.
Each finished and evaluated run leaves a record in --records_dir (bench/results/agent_speedup_runs: its evaluated
curve on both clocks, its curves per update, its command, the machine it ran on and its starting policy's sha256:
toy:hops is built the same on one CPU every time, not across CPUs), and a run with a record is not
made again, on this machine or another: the seeds of one benchmark can be run in several sittings, and an interrupted
one goes on where it stopped (within a sitting, a finished run's `done` marker and evaluations.json in --output_dir
are kept too). A ratio pairs an arm's run with sync's of the same seed only where both ran on one machine (one boot:
machines of one kind differ in speed); a pair that did not is left out and counted. Also writes --results_file
(bench/results/agent_speedup.json).

    python bench/agent_speedup.py                                   # 40 runs: over 10 hours on 2 CPU cores (sync's
                                                                    # and K=1's with latency near an hour each), in
                                                                    # as many sittings as it takes (the records)
    python bench/agent_speedup.py --latencies 0.5 --arms sync inflight --seeds 1 2
    python bench/agent_speedup.py --recorded_only --arms sync k1 continuous inflight inflight2   # the table of the
                                                                    # records there are, no run made
    python bench/agent_speedup.py --quick                           # a few minutes (a smoke test)
"""

import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multiturn_sync_vs_async import bound  # noqa: E402  (the overlap's bound from sync's parts, as its sweep's)
from off_policy_corrections import machine, world  # noqa: E402  (the CPU and boot; the starting policy's build)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)
import toy  # noqa: E402  (after bench/: the kit's root)

ARMS = {"sync": ("grpo_multiturn.py",), "k1": ("grpo_multiturn_vllm.py", "--async_steps", "1"),
        "continuous": ("grpo_multiturn_vllm.py", "--async_steps", "1", "--continuous_episodes"),
        "inflight": ("grpo_multiturn_vllm.py", "--async_steps", "1", "--inflight_updates"),
        "inflight2": ("grpo_multiturn_vllm.py", "--async_steps", "1", "--inflight_updates", "--inflight_batches", "2")}
# an update's time on the trainer's path (from the sync script's or the engine's metrics): its start is the end of
# the update before it
UPDATE_PHASES = {"sync": ("time/generate", "time/score", "time/train"),
                 **dict.fromkeys(("k1", "continuous", "inflight", "inflight2"),
                                 ("time/wait", "time/score", "time/train", "time/weight_send"))}
# the per-update curves results.json keeps
CURVES = ("rollout/return_mean", "rollout/turns_mean", "async/staleness", "async/token_staleness_mean",
          "env/step_time_median", "env/step_time_p95", "time/generate", "time/train", "time/wait")
CLOCKS = ("minutes", "minutes_from_update_1")
TASK = ["--env", "toy:hops", "--model_name_or_path", "toy:hops_policy", "--dataset_name", "toy:hops_dataset",
        "--max_turns", "10", "--max_episode_tokens", "96"]
# a constant learning rate: when a run reaches a level then does not depend on its length (decaying linearly over
# its updates, the rate is all but 0 by the last ones, where the later levels are reached)
TRAINING = ["--lr_scheduler_type", "constant"]


@dataclass
class Args:
    arms: tuple[Literal["sync", "k1", "continuous", "inflight", "inflight2"], ...] = (
        "sync", "k1", "continuous", "inflight")
    """the arms, each with every seed at every latency"""
    latencies: tuple[float, ...] = (0.0, 0.5)
    """the medians of --env_latency, seconds a search step takes (0: no latency)"""
    latency_spread: float = 1.0
    """--env_latency_spread of the runs with latency: the log-normal's sigma (1: the slowest of 100 steps about 10
    times the median)"""
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    """seeds per arm, interleaved across the arms"""
    updates: int = 70
    """updates per run, of the scripts' default batch (32 rows x 4 episodes): room past the levels (a synchronous
    probe run without latency, seed 1, first evaluated at 0.6 at update 50)"""
    snapshot_every: int = 5
    """updates between the policy snapshots that are evaluated"""
    eval_rows: int = 256
    """validation questions each evaluation plays (one near-greedy episode each; the dataset has 256)"""
    levels: tuple[float, ...] = (0.5, 0.6)
    """the evaluated returns whose first reaching is timed (the SFT policy's is about 0.31, the ceiling 1)"""
    bootstrap: int = 10000
    """resamples of the seeds for each ratio's interval"""
    extra: str = ""
    """flags given to every run (and its evaluation), e.g. --extra="--num_epochs 2\""""
    quick: bool = False
    """smoke test: sync and inflight at 0.1 s, 1 seed, 4 updates, snapshots every 2, 32 rows"""
    output_dir: str | None = None
    """where the runs and results.json go (default runs/bench-agent-speedup-<time>)"""
    results_file: str | None = os.path.join(ROOT, "bench", "results", "agent_speedup.json")
    """where results.json is copied, the curves RESULTS.md's table is drawn from (None, and with --quick: nowhere)"""
    records_dir: str = os.path.join(ROOT, "bench", "results", "agent_speedup_runs")
    """where each finished run's record goes, one file per run, read instead of running it again (with --quick:
    --output_dir's records/)"""
    recorded_only: bool = False
    """make no run: the table of the runs --records_dir holds, an arm's latency and seed without a record left out
    (the arms of a benchmark run in several sittings, some seeds of an arm not yet made)"""


def run_command(arm: str, latency: float, seed: int, args: Args, output_dir: str) -> list[str]:
    """The command line of one run."""
    latency_flags = ["--env_latency", str(latency), "--env_latency_spread", str(args.latency_spread)] if latency else []
    return [sys.executable, os.path.join(ROOT, ARMS[arm][0]), *ARMS[arm][1:], *TASK, *TRAINING, *latency_flags,
            "--total_episodes", str(args.updates * 32), "--seed", str(seed), "--eval_every", "0",
            "--save_every", str(args.snapshot_every), *shlex.split(args.extra), "--output_dir", output_dir]


def train(arm: str, latency: float, seed: int, args: Args) -> str:
    """One run, made unless done: its output directory."""
    output_dir = os.path.join(args.output_dir, f"{arm}-latency{latency:g}-seed{seed}")
    if not os.path.exists(os.path.join(output_dir, "done")):
        command = run_command(arm, latency, seed, args, output_dir)
        print("$", " ".join(command[1:]), flush=True)
        shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted run starts over
        toy.build_hops()  # built on first use: before the clock starts, not inside the first run's
        launched = time.time()
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        if result.returncode:
            sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        with open(os.path.join(output_dir, "done"), "w") as f:
            json.dump({"launched": launched}, f)
    return output_dir


def evaluate_snapshots(output_dir: str, seed: int, args: Args) -> dict[int, float]:
    """The evaluated return of each snapshot of a run (update -> return; 0: the SFT policy), made once, in a process
    of its own (after the run, on no clock): grpo_multiturn.evaluate with the run's seed, no latency."""
    path = os.path.join(output_dir, "evaluations.json")
    if not os.path.exists(path):
        command = [sys.executable, os.path.join(ROOT, "bench", "evaluate_episodes.py"),
                   output_dir, str(seed), str(args.eval_rows), *TASK, *shlex.split(args.extra)]
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        if result.returncode:
            sys.exit(f"evaluating {output_dir} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(path) as f:
        return {int(update): value for update, value in json.load(f).items()}


def record(arm: str, latency: float, seed: int, args: Args) -> dict | None:
    """One run's record (read_run's numbers, its command, machine and world): read from --records_dir where it is
    there, else the run made, evaluated and recorded (with --recorded_only: None). A record made with other flags is an
    error, not a run to reuse."""
    name = f"{arm}-latency{latency:g}-seed{seed}"
    path = os.path.join(args.records_dir, name + ".json")
    command = run_command(arm, latency, seed, args, "OUTPUT_DIR")[2:]  # the script's flags, the interpreter's path out
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
        if kept["command"] != command:
            sys.exit(f"{path} was made with other flags ({' '.join(kept['command'])}), not {' '.join(command)}: "
                     "remove it or give another --records_dir")
        return kept
    if args.recorded_only:
        return None
    output_dir = train(arm, latency, seed, args)
    kept = read_run(output_dir, arm, evaluate_snapshots(output_dir, seed, args)) | {
        "command": command, "machine": machine(), "world": world(output_dir)}
    os.makedirs(args.records_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:  # written whole, then moved: an interrupted write leaves no record
        json.dump(kept, f)
    os.replace(path + ".tmp", path)
    return kept


def read_run(output_dir: str, arm: str, returns: dict[int, float]) -> dict:
    """A run's evaluated snapshots on both clocks (minutes since launch, since update 1 began; the SFT policy at 0
    on both), its fill (minutes from launch to update 1's end), its median seconds per update after the first, and
    its curves per update."""
    with open(os.path.join(output_dir, "done")) as f:
        launched = json.load(f)["launched"]
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        updates = [line for line in map(json.loads, f) if "loss/policy_avg" in line]
    ended = {m["update"]: m["time"] for m in updates}
    began = ended[1] - sum(updates[0].get(phase, 0.0) for phase in UPDATE_PHASES[arm])  # update 1's start
    points = [{"update": 0, "return": returns[0], "minutes": 0.0, "minutes_from_update_1": 0.0}]
    points += [{"update": u, "return": returns[u], "minutes": (ended[u] - launched) / 60,
                "minutes_from_update_1": (ended[u] - began) / 60} for u in sorted(returns) if u > 0]
    return {"points": points, "fill_minutes": (ended[1] - launched) / 60,
            "seconds_per_update": statistics.median(ended[u] - ended[u - 1] for u in ended if u > 1),
            "phases": {phase: statistics.median(m.get(phase, 0.0) for m in updates)
                       for phase in ("time/generate", "time/train")},
            "curves": {"update": [m["update"] for m in updates],
                       **{name: [m.get(name) for m in updates] for name in CURVES}}}


def first_reaching(run: dict, level: float, key: str) -> float | None:
    """`key` (a clock, or "update") of the first evaluated point at or above `level`; None where none is."""
    return next((p[key] for p in run["points"] if p["return"] >= level), None)


def mean_over(points: list[tuple[float, float]], horizon: float) -> float:
    """The area under (time, return) points from 0 to `horizon` (trapezoids between points, cut at `horizon`), over
    `horizon`: the mean return over that time."""
    area = 0.0
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if t0 >= horizon:
            break
        if t1 > horizon:
            r1, t1 = r0 + (r1 - r0) * (horizon - t0) / (t1 - t0), horizon
        area += (t1 - t0) * (r0 + r1) / 2
    return area / horizon


def mean_return(run: dict, clock: str, horizon: float) -> float:
    """The run's mean evaluated return against `clock` from 0 to `horizon` (mean_over), its last return held after
    its last point."""
    points = [(p[clock], p["return"]) for p in run["points"]]
    return mean_over([*points, (max(horizon, points[-1][0]), points[-1][1])], horizon)


def median_interval(values: list[float], resamples: int, seed: int = 0) -> tuple[float, float, float]:
    """The median of per-seed values and its bootstrap 95% interval: the 2.5th and 97.5th percentiles of the medians
    of `resamples` resamples of the seeds, with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return statistics.median(values), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def compare(sync: dict[int, dict], arm: dict[int, dict], args: Args) -> dict:
    """The arm against sync (or another baseline: inflight2 against inflight), seed by seed (seed -> run), each of the
    arm's runs paired with sync's of the same seed made on the same machine (the others left out, their number
    `unpaired`): per level and clock, sync's time to it over the arm's (where both reached it), and the updates to it
    (the arm's minus sync's); per clock, the arm's mean return over sync's time over sync's; the seconds per update,
    sync's over the arm's."""
    pairs = [(sync[seed], run) for seed, run in sorted(arm.items())
             if seed in sync and sync[seed].get("machine") == run.get("machine")]
    out = {"levels": {}, "mean_return": {}, "unpaired": len(arm) - len(pairs)}
    sync, arm = [s for s, _ in pairs], [a for _, a in pairs]
    for level in args.levels:
        entry = {"updates_more": [], **{clock: [] for clock in CLOCKS}}
        for s, a in zip(sync, arm):
            if first_reaching(s, level, "update") is not None and first_reaching(a, level, "update") is not None:
                entry["updates_more"].append(first_reaching(a, level, "update") - first_reaching(s, level, "update"))
                for clock in CLOCKS:
                    entry[clock].append(first_reaching(s, level, clock) / first_reaching(a, level, clock))
        out["levels"][level] = entry
    for clock in CLOCKS:
        out["mean_return"][clock] = [mean_return(a, clock, s["points"][-1][clock]) /
                                     mean_return(s, clock, s["points"][-1][clock]) for s, a in zip(sync, arm)]
    out["seconds_per_update"] = [s["seconds_per_update"] / a["seconds_per_update"] for s, a in zip(sync, arm)]
    return out


def interval_text(values: list[float], args: Args, form: str = "{:.2f}x") -> str:
    if not values:
        return "not reached by both"
    middle, low, high = median_interval(values, args.bootstrap)
    return f"{form.format(middle)} [{form.format(low)}, {form.format(high)}] ({len(values)} seeds)"


def main(args: Args):
    if args.quick:
        args.arms, args.latencies, args.seeds = ("sync", "inflight"), (0.1,), (1,)
        args.updates, args.snapshot_every = 4, 2
        args.eval_rows, args.bootstrap, args.results_file = 32, 100, None
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-agent-speedup-{int(time.time())}")
    if args.quick:
        args.records_dir = os.path.join(args.output_dir, "records")
    os.makedirs(args.output_dir, exist_ok=True)
    runs = {latency: {arm: {} for arm in args.arms} for latency in args.latencies}  # latency -> arm -> seed -> run
    for seed in args.seeds:  # interleaved, so that a slow spell of a shared machine hits every arm alike
        for latency in args.latencies:
            for arm in args.arms:
                if (run := record(arm, latency, seed, args)) is not None:
                    runs[latency][arm][seed] = run

    table = {}
    for latency, by_arm in runs.items():
        spread = f", spread {args.latency_spread:g}" if latency else ""
        print(f"\n--env_latency {latency:g} s{spread}: {args.updates} updates, seeds {list(args.seeds)}, evaluated on "
              f"{args.eval_rows} rows every {args.snapshot_every} updates {args.extra}")
        table[latency] = {}
        for arm, by_seed in by_arm.items():
            if not by_seed:
                print(f"{arm:10} no run recorded")
                continue
            arm_runs = [by_seed[seed] for seed in sorted(by_seed)]
            horizon = {clock: statistics.median(run["points"][-1][clock] for run in arm_runs) for clock in CLOCKS}
            row = {"seeds": sorted(by_seed), "last_return": [run["points"][-1]["return"] for run in arm_runs],
                   "fill_minutes": [run["fill_minutes"] for run in arm_runs],
                   "seconds_per_update": [run["seconds_per_update"] for run in arm_runs],
                   "phases": {phase: statistics.median(run["phases"][phase] for run in arm_runs)
                              for phase in ("time/generate", "time/train")},
                   "runs": arm_runs}
            table[latency][arm] = row
            reached = []
            for level in args.levels:
                found = {key: [value for run in arm_runs if (value := first_reaching(run, level, key)) is not None]
                         for key in ("update", *CLOCKS)}
                reached.append(f"{level}: {len(found['update'])}/{len(arm_runs)} seeds" + (
                    f", median update {statistics.median(found['update']):g}, {statistics.median(found['minutes']):.1f}"
                    f" min from launch, {statistics.median(found['minutes_from_update_1']):.1f} from update 1"
                    if found["update"] else ""))
            print(f"{arm:10} last return {statistics.median(row['last_return']):.3f}, "
                  f"{statistics.median(row['seconds_per_update']):.1f} s per update, fill "
                  f"{statistics.median(row['fill_minutes']):.2f} min, {horizon['minutes']:.1f} min in all; "
                  + "; ".join(reached))
        if not by_arm.get("sync"):
            continue
        sync_phases = table[latency]["sync"]["phases"]
        table[latency]["bound"] = bound(sync_phases)
        print(f"the overlap's bound from sync's parts (generation {sync_phases['time/generate']:.2f} s, training "
              f"{sync_phases['time/train']:.2f} s an update): {table[latency]['bound']:.2f}x")
        pairs = [(arm, "sync") for arm in args.arms if arm != "sync" and by_arm[arm]]
        if by_arm.get("inflight") and by_arm.get("inflight2"):  # what two batches in flight change
            pairs.append(("inflight2", "inflight"))
        for arm, baseline in pairs:
            versus = compare(by_arm[baseline], by_arm[arm], args)
            table[latency][f"{arm}_vs_{baseline}"] = versus
            unpaired = (f" ({versus['unpaired']} seeds left out: no {baseline} run on their machine)"
                        if versus["unpaired"] else "")
            print(f"{arm} vs {baseline}, per seed (median [bootstrap 95%]){unpaired}: seconds per update "
                  f"{interval_text(versus['seconds_per_update'], args)}")
            for level, entry in versus["levels"].items():
                print(f"  to return {level}: from launch {interval_text(entry['minutes'], args)}, from update 1 "
                      f"{interval_text(entry['minutes_from_update_1'], args)}, updates more "
                      f"{interval_text(entry['updates_more'], args, '{:+.0f}')}")
            print(f"  mean return over {baseline}'s time: from launch "
                  f"{interval_text(versus['mean_return']['minutes'], args)}"
                  f", from update 1 {interval_text(versus['mean_return']['minutes_from_update_1'], args)}")
    destinations = [os.path.join(args.output_dir, "results.json"), *([args.results_file] if args.results_file else [])]
    for destination in destinations:
        with open(destination, "w") as f:
            json.dump({"args": vars(args), "table": table}, f)
    print(f"results in {' and '.join(destinations)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
