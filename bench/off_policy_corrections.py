"""Which off-policy correction keeps an asynchronous run stable as its samples grow staler? GRPO (dapo),
RLOO and PPO in their vLLM scripts at exact staleness K (`--async_steps`), each with every
`--off_policy_correction` (none, decoupled, tis, mask, at their default caps), on the arithmetic task
(toy-math: final accuracy, and KL where the script has a reference policy) and the toy TL;DR task (final
gold win-rate and KL), a few seeds; the score a quarter of the way too, where the toy tasks still learn.
At K = 0 the corrections equal none (the tests prove it: every weight is
1), so K = 0 runs none only, which stands for every correction in the table and figure.

Every run is the script's own preset (toy-math) or default (TL;DR) with only --async_steps,
--off_policy_correction and --seed changed; a finished run (its `done` marker) is not run again, so an
interrupted sweep goes on where it stopped when given the same --output_dir. Prints a table (mean ± std over
seeds) and writes results.json and a figure (scores, KL and mismatch KL against K, one line per correction) to
--output_dir, and for a full run also to bench/results/off_policy_corrections.{json,png} (the name gains the
task when not math, the algorithms when not all three, and the corrections when not all four:
off_policy_corrections_grpo_rloo.png).

    python bench/off_policy_corrections.py                          # GRPO, RLOO, PPO on toy-math: ~2 h on 2 cores
    python bench/off_policy_corrections.py --algorithms grpo --seeds 1    # ~20 minutes
    python bench/off_policy_corrections.py --tasks tldr --algorithms grpo --async_steps 0 4 16   # the TL;DR task
    python bench/off_policy_corrections.py --quick                  # a smoke test, not a result
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORRECTIONS = ("none", "decoupled", "tis", "mask")
SCORE = {"math": "eval/accuracy", "tldr": "eval/gold_win_rate"}


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
    corrections: tuple[Literal["none", "decoupled", "tis", "mask"], ...] = CORRECTIONS
    """the values of --off_policy_correction"""
    quick: bool = False
    """smoke test: GRPO on toy-math, K = 2, none and tis, 1 seed, 4 updates"""
    output_dir: str | None = None
    """where the runs, results.json and the figure go (default runs/bench-off-policy-corrections-<time>)"""


def train(algorithm: str, task: str, k: int, correction: str, seed: int, args: Args) -> dict:
    """The final evaluation of one run."""
    name = f"{algorithm}-{task}-k{k}-{correction}-seed{seed}"
    output_dir = os.path.join(args.output_dir, name)
    if not os.path.exists(os.path.join(output_dir, "done")):
        command = [sys.executable, os.path.join(ROOT, f"{algorithm}_vllm.py"),
                   *(["--preset", "toy-math"] if task == "math" else []), "--async_steps", str(k),
                   "--off_policy_correction", correction, "--seed", str(seed), "--output_dir", output_dir,
                   *(["--total_episodes", "256", "--eval_every", "4", "--eval_num_prompts", "64"]
                     if args.quick else [])]
        print("$", " ".join(command[1:]), flush=True)
        shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted run starts over
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        if result.returncode:
            sys.exit(f"this run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        open(os.path.join(output_dir, "done"), "w").close()
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    evaluations = [m for m in metrics if SCORE[task] in m]
    final = evaluations[-1]
    train_metrics = [m for m in metrics if "async/mismatch_kl" in m]
    return {"score": final[SCORE[task]], "kl": final.get("eval/kl"),
            # a quarter of the way (toy-math: update 8), where the toy tasks are still learning
            "early_score": evaluations[(len(evaluations) - 1) // 4][SCORE[task]],
            "mismatch_kl": statistics.mean(m["async/mismatch_kl"] for m in train_metrics),
            "truncated_frac": statistics.mean(m["async/is_truncated_frac"] for m in train_metrics)}


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
    fig, axes = plt.subplots(4, len(cells), figsize=(5 * len(cells), 16), squeeze=False)
    for column, (algorithm, task) in enumerate(cells):
        for correction in args.corrections:
            for row, (metric, label) in enumerate((("early_score", f"{SCORE[task]} a quarter of the way"),
                                                   ("score", f"final {SCORE[task]}"), ("kl", "final eval/kl"),
                                                   ("mismatch_kl", "async/mismatch_kl, mean over updates"))):
                points = [(k, table[f"{algorithm} {task}"][k][correction][metric]) for k in args.async_steps
                          if table[f"{algorithm} {task}"][k].get(correction)
                          and table[f"{algorithm} {task}"][k][correction][metric]]
                if points:
                    ks, values = zip(*points)
                    axes[row][column].errorbar([k + 0.5 for k in ks], [v[0] for v in values],
                                               yerr=[v[1] for v in values], marker="o", capsize=3, label=correction)
                axes[row][column].set_xscale("log", base=2)
                axes[row][column].set_xticks([k + 0.5 for k in args.async_steps], [str(k) for k in args.async_steps])
                axes[row][column].set_xlabel("K (--async_steps)")
                axes[row][column].set_ylabel(label)
                axes[row][column].set_title(f"{algorithm}_vllm.py, {task}")
        axes[0][column].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(args: Args):
    if args.quick:
        args.algorithms, args.tasks, args.async_steps, args.seeds = ("grpo",), ("math",), (2,), (1,)
        args.corrections = ("none", "tis")
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-off-policy-corrections-{int(time.time())}")
    os.makedirs(args.output_dir, exist_ok=True)
    start = time.time()
    table = {}
    for algorithm in args.algorithms:
        for task in args.tasks:
            table[f"{algorithm} {task}"] = {k: {} for k in args.async_steps}
            for k in args.async_steps:
                for correction in ("none",) if k == 0 else args.corrections:
                    runs = [train(algorithm, task, k, correction, seed, args) for seed in args.seeds]
                    table[f"{algorithm} {task}"][k][correction] = {
                        name: summary([run[name] for run in runs]) for name in runs[0]}
            if 0 in args.async_steps:  # nothing is stale: none's runs stand for every correction
                table[f"{algorithm} {task}"][0] = dict.fromkeys(args.corrections,
                                                                table[f"{algorithm} {task}"][0]["none"])
    print(f"the runs took {(time.time() - start) / 60:.1f} min; mean ± std over seeds {list(args.seeds)}")
    for cell, by_k in table.items():
        print(f"\n{cell}: score a quarter of the way / final (final KL), mean mismatch KL and truncated share")
        print(f"{'K':>3} " + "".join(f"{correction:>44}" for correction in args.corrections))
        for k, by_correction in by_k.items():
            row = []
            for correction in args.corrections:
                cell_values = by_correction.get(correction)
                if cell_values is None:
                    row.append(f"{'-':>44}")
                    continue
                kl = f" ({cell_values['kl'][0]:.2f})" if cell_values["kl"] else ""
                row.append(f"{cell_values['early_score'][0]:.3f} / {cell_values['score'][0]:.3f} ± "
                           f"{cell_values['score'][1]:.3f}{kl} {cell_values['mismatch_kl'][0]:.1e} "
                           f"{cell_values['truncated_frac'][0]:.2f}".rjust(44))
            print(f"{k:>3} " + "".join(row))
    destinations = [os.path.join(args.output_dir, "results")]
    if not args.quick:  # another task's, or a subset of the algorithms', in a file of their own
        name = "off_policy_corrections" + "".join(f"_{task}" for task in args.tasks if task != "math")
        if set(args.algorithms) != {"grpo", "rloo", "ppo"}:
            name += "".join(f"_{algorithm}" for algorithm in args.algorithms)
        if set(args.corrections) != set(CORRECTIONS):
            name += "".join(f"_{correction}" for correction in args.corrections)
        destinations.append(os.path.join(ROOT, "bench", "results", name))
    for destination in destinations:
        with open(destination + ".json", "w") as f:
            json.dump({"args": vars(args), "table": table}, f, indent=1)
        figure(table, args, destination + ".png")
        print(f"results in {destination}.json and .png")


if __name__ == "__main__":
    main(tyro.cli(Args))
