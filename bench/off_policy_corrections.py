"""Which off-policy correction keeps an asynchronous run stable as its samples grow staler? GRPO (dapo),
RLOO and PPO in their vLLM scripts at exact staleness K (`--async_steps`), each with every
`--off_policy_correction` (none, decoupled, pure_is, tis, mask, m2po, at their default caps), on the
arithmetic task (toy-math: final accuracy, and KL where the script has a reference policy) and the toy TL;DR
task (final gold win-rate and KL), a few seeds; the score a quarter of the way too, where the toy tasks still
learn. At K = 0 decoupled, tis and mask equal none (the tests prove it: the ratio is taken against the same
log-probs, every weight is 1), so K = 0 runs none, pure_is and m2po (which differ when an update takes several
optimizer steps), and none's runs stand for the other three. `--extra` adds flags to every run, named in the
output (the runs that tell why a correction collapses: `--extra="--correction_level sequence"`,
`--extra="--num_epochs 1 --learning_rate 1e-4"`).

Every run is the script's own preset (toy-math) or default (TL;DR) with only --async_steps,
--off_policy_correction and --seed changed; a finished run (its `done` marker) is not run again, so an
interrupted sweep goes on where it stopped when given the same --output_dir. Prints a table (mean ± std over
seeds) and writes results.json (with the world the runs were made in: the starting policy's weights' sha256 and
the CPU, since a toy task built on another CPU is another task) and a figure (scores, KL, mismatch KL and effective
sample size against K, and the final score against the mismatch KL, one line per correction) to --output_dir, and for
a full run also to
bench/results/off_policy_corrections.{json,png} (the name gains the task when not math, the algorithms when not
all three, the corrections when not all six, the values of K when not 0 1 4 16, and the --extra flags:
off_policy_corrections_grpo_rloo.png, off_policy_corrections_grpo_k4_total_episodes-8192.png).

    python bench/off_policy_corrections.py                          # GRPO, RLOO, PPO on toy-math: ~4 h on 2 cores
    python bench/off_policy_corrections.py --algorithms grpo --seeds 1    # ~40 minutes
    python bench/off_policy_corrections.py --tasks tldr --algorithms grpo --async_steps 0 4 16   # the TL;DR task
    python bench/off_policy_corrections.py --quick                  # a smoke test, not a result
"""

import glob
import hashlib
import json
import os
import platform
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
CORRECTIONS = ("none", "decoupled", "pure_is", "tis", "mask", "m2po")
SAME_AS_NONE_WHEN_FRESH = ("decoupled", "tis", "mask")
SCORE = {"math": "eval/accuracy", "tldr": "eval/gold_win_rate"}
# what results.json keeps of every update of every run (its curves), besides the evaluations
CURVES = ("async/staleness", "async/mismatch_kl", "async/ess", "async/is_ratio_max", "async/is_truncated_frac",
          "async/is_masked_frac", "async/m2po_masked_frac", "policy/clipfrac_avg", "policy/entropy_avg",
          "loss/policy_avg", "val/ratio", "objective/scores", "objective/kl", "objective/non_score_reward", "lr",
          # the drift per completion (its mean and largest token log-ratio), dynamic sampling's rounds and the groups
          # it drops, PPO's value model
          "async/seq_log_ratio_mean", "async/seq_log_ratio_peak", "async/seq_log_ratio_peak_max",
          "dynamic_sampling/rounds", "dynamic_sampling/dropped_groups", "dynamic_sampling/unfilled",
          "dynamic_sampling/sampled_scores", "objective/zero_std_groups", "loss/value_avg", "val/explained_variance",
          "val/clipfrac_avg")


@dataclass
class Args:
    algorithms: tuple[Literal["grpo", "rloo", "ppo"], ...] = ("grpo", "rloo", "ppo")
    """the scripts (their _vllm versions)"""
    tasks: tuple[Literal["math", "tldr"], ...] = ("math",)
    """math: the arithmetic task (--preset toy-math); tldr: the toy TL;DR task (the scripts' defaults)"""
    async_steps: tuple[int, ...] = (0, 1, 4, 16)
    """the values of K"""
    seeds: tuple[int, ...] = (1, 2)
    """seeds per cell"""
    corrections: tuple[Literal["none", "decoupled", "pure_is", "tis", "mask", "m2po"], ...] = CORRECTIONS
    """the values of --off_policy_correction"""
    extra: str = ""
    """flags added to every run, as on its command line (--extra="--num_epochs 1"); the run directories and
    result files name them"""
    save_every: int = 0
    """every run's --save_every: its policy every this many updates (policies/update-N) for bench/dip_diagnostics.py
    (0: none); the runs' numbers and the files' names stay the same"""
    quick: bool = False
    """smoke test: GRPO on toy-math, K = 2, none and m2po, 1 seed, 4 updates"""
    output_dir: str | None = None
    """where the runs, results.json and the figure go (default runs/bench-off-policy-corrections-<time>)"""


def train(algorithm: str, task: str, k: int, correction: str, seed: int, args: Args) -> dict:
    """The final evaluation of one run."""
    output_dir = os.path.join(args.output_dir, run_name(algorithm, task, k, correction, seed, args))
    if not os.path.exists(os.path.join(output_dir, "done")):
        command = run_command(algorithm, task, k, correction, seed, args, output_dir)
        print("$", " ".join(command[1:]), flush=True)
        shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted run starts over
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        if result.returncode:
            sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        open(os.path.join(output_dir, "done"), "w").close()
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    evaluations = sorted((m for m in metrics if SCORE[task] in m), key=lambda m: m["update"])
    final = evaluations[-1]
    train_metrics = [m for m in metrics if "async/mismatch_kl" in m]
    curves = {"update": [m["update"] for m in train_metrics],
              # (the learning rate unrounded: ~1e-5, it would keep 1-2 digits)
              **{name: [(m[name] if name == "lr" else round(m[name], 6)) if name in m else None for m in train_metrics]
                 for name in CURVES if any(name in m for m in train_metrics)},
              "eval_update": [m["update"] for m in evaluations],
              **{name: [round(m[name], 6) for m in evaluations] for name in (SCORE[task], "eval/kl")
                 if name in final}}
    return {"curves": curves, "score": final[SCORE[task]], "kl": final.get("eval/kl"),
            # a quarter of the way (toy-math: update 8), where the toy tasks are still learning
            "early_score": evaluations[(len(evaluations) - 1) // 4][SCORE[task]],
            "mismatch_kl": statistics.mean(m["async/mismatch_kl"] for m in train_metrics),
            "truncated_frac": statistics.mean(m["async/is_truncated_frac"] for m in train_metrics),
            "ess": statistics.mean(m["async/ess"] for m in train_metrics),
            # the share of terms a correction dropped: mask's out of bounds, m2po's tokens
            "dropped_frac": statistics.mean(m.get("async/is_masked_frac", m.get("async/m2po_masked_frac", 0.0))
                                            for m in train_metrics)}


def run_name(algorithm: str, task: str, k: int, correction: str, seed: int, args: Args) -> str:
    """A run's folder in --output_dir: grpo-math-k16-decoupled_total_episodes-8192-seed1."""
    return f"{algorithm}-{task}-k{k}-{correction}{extra_suffix(args)}-seed{seed}"


def cpu() -> tuple[str, str]:
    """This machine's CPU model (its architecture where /proc/cpuinfo names none) and /proc/cpuinfo's text."""
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.machine())
    return model, cpuinfo


def machine() -> dict:
    """The machine a run is timed on: its CPU and this boot of it (two machines of one kind differ in speed)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return {"cpu": cpu()[0], "boot_id": f.read().strip()}


def write_whole(path: str, kept: dict):
    """`kept` as JSON at `path`, written whole, then moved: an interrupted write leaves no file."""
    with open(path + ".tmp", "w") as f:
        json.dump(kept, f, indent=1)
    os.replace(path + ".tmp", path)


def world(run_dir: str) -> dict:
    """What a run's numbers depend on besides its flags: the starting policy's weights (the toy tasks are built the
    same on one CPU every time, not across CPUs) and the CPU (float rounding in sampling and training)."""
    with open(os.path.join(run_dir, "args.json")) as f:
        policy = json.load(f)["args"]["model_name_or_path"]
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(policy, "*.safetensors"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    model, cpuinfo = cpu()
    return {"policy_sha256": digest.hexdigest(), "cpu": model, "avx512": "avx512f" in cpuinfo}


def run_command(algorithm: str, task: str, k: int, correction: str, seed: int, args: Args, output_dir: str) -> list:
    """One run's command line: the script's preset (toy-math) or defaults, K, the correction, the seed, --extra."""
    return [sys.executable, os.path.join(ROOT, f"{algorithm}_vllm.py"),
            *(["--preset", "toy-math"] if task == "math" else []), "--async_steps", str(k),
            "--off_policy_correction", correction, "--seed", str(seed), "--output_dir", output_dir,
            *shlex.split(args.extra), *(["--save_every", str(args.save_every)] if args.save_every else []),
            *(["--total_episodes", "256", "--eval_every", "4", "--eval_num_prompts", "64"] if args.quick else [])]


def extra_suffix(args) -> str:
    """What --extra adds to a run's and a result file's name: `_correction_level-sequence`."""
    return "".join(f"_{word.lstrip('-')}" if word.startswith("--") else f"-{word}" for word in shlex.split(args.extra))


def result_name(args: Args) -> str:
    """The name of a full sweep's files in bench/results: another task's, a subset of the algorithms', the
    corrections' or the values of K, or other --extra flags, each in files of their own; so are seeds that add to a
    sweep of the first ones (seeds not from 1: `_seeds-3`), which must not overwrite it."""
    name = "off_policy_corrections" + "".join(f"_{task}" for task in args.tasks if task != "math")
    if set(args.algorithms) != {"grpo", "rloo", "ppo"}:
        name += "".join(f"_{algorithm}" for algorithm in args.algorithms)
    if set(args.corrections) != set(CORRECTIONS):
        name += "".join(f"_{correction}" for correction in args.corrections)
    if set(args.async_steps) != {0, 1, 4, 16}:
        name += "_k" + "-".join(str(k) for k in args.async_steps)
    name += extra_suffix(args)
    return name + ("_seeds-" + "-".join(map(str, args.seeds)) if args.seeds[0] != 1 else "")


def summary(values: list) -> list | None:
    """[mean, std] over seeds (None where the script logs no such number)."""
    if any(value is None for value in values):
        return None
    return [statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0]


def figure(table: dict, args: Args, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(algorithm, task) for algorithm in args.algorithms for task in args.tasks]
    against_k = [(metric, label) for metric, label in (
        ("early_score", "{score} a quarter of the way"), ("score", "final {score}"), ("kl", "final eval/kl"),
        ("mismatch_kl", "async/mismatch_kl, mean over updates"), ("ess", "async/ess, mean over updates"))
        if any(cell and cell[metric] for by_k in table.values() for row in by_k.values() for cell in row.values())]
    fig, axes = plt.subplots(len(against_k) + 1, len(cells), figsize=(5 * len(cells), 4 * (len(against_k) + 1)),
                             squeeze=False)
    for column, (algorithm, task) in enumerate(cells):
        by_k = table[f"{algorithm} {task}"]
        for correction in args.corrections:
            measured = [k for k in args.async_steps if by_k[k].get(correction)]
            for row, (metric, label) in enumerate(against_k):
                points = [(k, by_k[k][correction][metric]) for k in measured if by_k[k][correction][metric]]
                if points:
                    ks, values = zip(*points)
                    axes[row][column].errorbar([k + 0.5 for k in ks], [v[0] for v in values],
                                               yerr=[v[1] for v in values], marker="o", capsize=3, label=correction)
                axes[row][column].set_xscale("log", base=2)
                axes[row][column].set_xticks([k + 0.5 for k in args.async_steps], [str(k) for k in args.async_steps])
                axes[row][column].set_xlabel("K (--async_steps)")
                axes[row][column].set_ylabel(label.format(score=SCORE[task]))
                axes[row][column].set_title(f"{algorithm}_vllm.py, {task}")
            # the final score against the drift it met: the toy's K read as an LLM run's mismatch KL
            drift = [(by_k[k][correction]["mismatch_kl"][0], by_k[k][correction]["score"][0]) for k in measured]
            axes[-1][column].plot(*zip(*sorted(drift)), marker="o", label=correction)
        axes[-1][column].set_xscale("log")
        axes[-1][column].set_xlabel("async/mismatch_kl, mean over updates")
        axes[-1][column].set_ylabel(f"final {SCORE[task]}")
        axes[-1][column].set_title(f"{algorithm}_vllm.py, {task}: score against drift")
        axes[0][column].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def curves_figure(curves: dict, args: Args, path: str):
    """Per update, one column per algorithm, task and K, one line per correction (each seed its own, thin): the
    score, the mismatch KL, the ESS, the share of weights above the cap (capped by tis and pure_is, dropped by
    decoupled and m2po), the share mask and m2po dropped, the clip fraction and the entropy; a dotted
    line where the run's own samples start to arrive (update K + 2: the first batch sampled by trained weights)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("score", None), ("async/mismatch_kl", "log"), ("async/ess", None), ("async/is_truncated_frac", None),
            ("dropped", None), ("policy/clipfrac_avg", None), ("policy/entropy_avg", None)]
    columns = [(algorithm, task, k) for algorithm in args.algorithms for task in args.tasks for k in args.async_steps]
    fig, axes = plt.subplots(len(rows), len(columns), figsize=(5 * len(columns), 3 * len(rows)), squeeze=False)
    colours = dict(zip(CORRECTIONS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for column, (algorithm, task, k) in enumerate(columns):
        for name, run in curves.items():
            run_algorithm, run_task, run_k, correction, _ = name.split()
            if (run_algorithm, run_task, run_k) != (algorithm, task, f"k{k}"):
                continue
            for row, (metric, _) in enumerate(rows):
                if metric == "score":
                    x, y = run["eval_update"], run[SCORE[task]]
                elif metric == "dropped":
                    x, y = run["update"], run.get("async/is_masked_frac", run.get("async/m2po_masked_frac"))
                else:
                    x, y = run["update"], run.get(metric)
                if y is None:
                    continue
                axes[row][column].plot(x, y, color=colours[correction], linewidth=0.8, alpha=0.8,
                                       label=correction if name.endswith(f"seed{args.seeds[0]}") else None)
        for row, (metric, scale) in enumerate(rows):
            axis = axes[row][column]
            axis.axvline(k + 2, color="grey", linestyle=":", linewidth=0.8)
            axis.set_ylabel(SCORE[task] if metric == "score" else "dropped share" if metric == "dropped" else metric)
            if scale:
                axis.set_yscale(scale)
            axis.set_xlabel("update")
        axes[0][column].set_title(f"{algorithm}_vllm.py, {task}, K = {k}")
        axes[0][column].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(args: Args):
    if args.quick:
        args.algorithms, args.tasks, args.async_steps, args.seeds = ("grpo",), ("math",), (2,), (1,)
        args.corrections = ("none", "m2po")
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-off-policy-corrections-{int(time.time())}")
    os.makedirs(args.output_dir, exist_ok=True)
    start = time.time()
    table, curves = {}, {}  # curves: every run's per-update metrics, by "algorithm task kK correction seedS"
    for algorithm in args.algorithms:
        for task in args.tasks:
            table[f"{algorithm} {task}"] = {k: {} for k in args.async_steps}
            for k in args.async_steps:
                for correction in args.corrections:
                    if k == 0 and correction in SAME_AS_NONE_WHEN_FRESH:
                        continue
                    runs = [train(algorithm, task, k, correction, seed, args) for seed in args.seeds]
                    for seed, run in zip(args.seeds, runs):
                        curves[f"{algorithm} {task} k{k} {correction} seed{seed}"] = run.pop("curves")
                    table[f"{algorithm} {task}"][k][correction] = {
                        name: summary([run[name] for run in runs]) for name in runs[0]}
            if 0 in args.async_steps and "none" in args.corrections:  # nothing stale: none's runs stand for these
                fresh = table[f"{algorithm} {task}"][0]
                fresh.update({c: fresh["none"] for c in args.corrections if c in SAME_AS_NONE_WHEN_FRESH})
    print(f"the runs took {(time.time() - start) / 60:.1f} min; mean ± std over seeds {list(args.seeds)}")
    for cell, by_k in table.items():
        print(f"\n{cell}: score a quarter of the way / final (final KL), mean mismatch KL, truncated share, "
              "ESS and dropped share")
        print(f"{'K':>3} " + "".join(f"{correction:>56}" for correction in args.corrections))
        for k, by_correction in by_k.items():
            row = []
            for correction in args.corrections:
                cell_values = by_correction.get(correction)
                if cell_values is None:
                    row.append(f"{'-':>56}")
                    continue
                kl = f" ({cell_values['kl'][0]:.2f})" if cell_values["kl"] else ""
                row.append(f"{cell_values['early_score'][0]:.3f} / {cell_values['score'][0]:.3f} ± "
                           f"{cell_values['score'][1]:.3f}{kl} {cell_values['mismatch_kl'][0]:.1e} "
                           f"{cell_values['truncated_frac'][0]:.2f} {cell_values['ess'][0]:.2f} "
                           f"{cell_values['dropped_frac'][0]:.2f}".rjust(56))
            print(f"{k:>3} " + "".join(row))
    algorithm, task, k, correction, seed = next(iter(curves)).split()  # one of the runs: all share the machine
    first_world = world(os.path.join(args.output_dir, run_name(algorithm, task, int(k[1:]), correction,
                                                               int(seed.removeprefix("seed")), args)))
    destinations = [os.path.join(args.output_dir, "results")]
    if not args.quick:
        destinations.append(os.path.join(ROOT, "bench", "results", result_name(args)))
    for destination in destinations:
        with open(destination + ".json", "w") as f:
            json.dump({"args": vars(args), "world": first_world, "table": table, "curves": curves}, f)
        figure(table, args, destination + ".png")
        curves_figure(curves, args, destination + "_curves.png")
        print(f"results in {destination}.json and .png")


if __name__ == "__main__":
    main(tyro.cli(Args))
