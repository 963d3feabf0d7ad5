"""The paper's robustness finding on the toy task: how much does each algorithm lose when it learns
from off-policy data, and does that change with the policy's size?

Every arm trains from the same SFT policy on the same prompts with the same optimizer steps and
learning schedule; only N, the mini-batches per generated batch (`--num_mini_batches`), varies: one
generation of N mini-batches, then N optimizer steps, so the i-th step trains on data i-1 updates
stale. N = 1 is on-policy. The arms: online DPO, PPO, RLOO, best-of-k, GRPO with the dapo loss and as
Dr. GRPO (dr_grpo loss, unscaled advantages), both with DeepSeekMath's KL penalty (beta 0.04), all one
epoch each, as in the paper's TL;DR runs, so every arm takes the same steps; and PPO and RLOO with pure
importance sampling (`--off_policy_correction pure_is`: the ratio against each step's own weights, each term
weighted by the capped pi_step / pi_sampling; until flags_format 2 the kit called it `decoupled`, and the
tables in bench/RESULTS.md were measured under that name). One learning rate per algorithm, the same
across N and sizes, as in the paper. Two sizes: the toy's 0.45M-parameter SFT policy and the 7.7x larger
one (`python -m toy large`), with the same reward model and prompts.

Prints, per size, gold win-rate half-way and at the end, and final KL, per arm and N (mean ± standard
deviation over seeds), and each arm's drop in final win-rate from N = 1 to the largest N; writes
results.json and a figure (win-rate and KL against N, and the win-rate-vs-KL frontier) to --output_dir,
and for a full run also to bench/results/off_policy.{json,png}. A finished run (its `done` marker) is
not run again, so an interrupted sweep goes on where it stopped when given the same --output_dir.

    python bench/off_policy.py             # about an hour on 2 CPU cores (OMP_NUM_THREADS=1 on a busy machine)
    python bench/off_policy.py --quick     # about a minute: a smoke test, not a result
"""

import contextlib
import importlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the algorithm scripts
import cli  # noqa: E402  (after the path)
import toy  # noqa: E402


@dataclass
class Args:
    sizes: tuple[Literal["small", "large"], ...] = ("small", "large")
    """SFT policy sizes: the toy's (0.45M parameters) and the toy's larger one (3.45M)"""
    mini_batches: tuple[int, ...] = (1, 4, 16, 32)
    """the values of N (mini-batches per generated batch); each must divide half of --optimizer_steps"""
    optimizer_steps: int = 64
    """optimizer steps per run: twice the largest N, so even N = 32 generates twice (evaluated half-way,
    before its second generation, and at the end)"""
    prompts_per_step: int = 16
    """prompts per optimizer step (k samples each where the algorithm takes k)"""
    learning_rates: dict[str, float] = field(default_factory=lambda: {
        "online_dpo": 3e-5, "ppo": 3e-5, "rloo": 3e-5, "bok": 3e-5, "grpo": 3e-5})
    """one learning rate per algorithm (the pure_is arms take their algorithm's); 3e-5 brings every
    on-policy run of the small policy to the task's plateau (win-rate ~0.55) in 32-48 of the 64 steps"""
    is_cap: float = 5.0
    """the pure_is arms' cap on the importance weight from the sampling weights to each step's"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds per arm, N and size"""
    eval_num_prompts: int = 256
    """validation prompts of each evaluation"""
    quick: bool = False
    """smoke test: small size, N in {1, 2}, 1 seed, 4 steps of 8 prompts, 32 evaluation prompts"""
    output_dir: str | None = None
    """where the runs, results.json and the figure go (default runs/bench-off-policy-<time>)"""


ARMS = {  # arm: (script, its flags; "is_cap" takes --is_cap's value)
    "online_dpo": ("online_dpo", {}),
    "ppo": ("ppo", {}),
    "rloo": ("rloo", {}),
    "bok": ("bok", {}),
    # GRPO with DeepSeekMath's KL penalty (beta 0.04): a reference policy, and a KL, like every other arm
    "grpo_dapo": ("grpo", {"loss_type": "dapo", "beta": 0.04}),
    "grpo_dr_grpo": ("grpo", {"loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.04}),
    "ppo_pure_is": ("ppo", {"off_policy_correction": "pure_is", "is_cap": None}),
    "rloo_pure_is": ("rloo", {"off_policy_correction": "pure_is", "is_cap": None}),
}


def train(arm: str, size: str, mini_batches: int, seed: int, args: Args) -> dict:
    """{"half": evaluation after half the optimizer steps, "final": after the last} of one run. The
    script's main() runs in this process (its output goes to <run>.log), so the many short runs do not
    each pay for imports."""
    name = f"{size}-{arm}-mb{mini_batches}-seed{seed}"
    output_dir = os.path.join(args.output_dir, name)
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(os.path.join(output_dir, "done")):
        script, extra = ARMS[arm]
        extra = {key: args.is_cap if key == "is_cap" else value for key, value in extra.items()}
        module = importlib.import_module(script)
        policy = toy.LARGE_SFT_POLICY if size == "large" else toy.SFT_POLICY
        run_args = cli.with_flags(module.Args(), seed=seed, output_dir=output_dir, model_name_or_path=policy,
                                  total_episodes=args.optimizer_steps * args.prompts_per_step,
                                  per_device_train_batch_size=args.prompts_per_step, gradient_accumulation_steps=1,
                                  num_mini_batches=mini_batches, learning_rate=args.learning_rates[script],
                                  eval_every=args.optimizer_steps // 2 // mini_batches,
                                  eval_num_prompts=args.eval_num_prompts, num_epochs=1, **extra)
        print(f"{name}: {script}.py --num_mini_batches {mini_batches} --seed {seed} "
              + " ".join(f"--{key} {value}" for key, value in extra.items()), flush=True)
        shutil.rmtree(output_dir, ignore_errors=True)  # an interrupted run starts over
        with open(os.path.join(args.output_dir, name + ".log"), "w") as log, \
                contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            module.main(run_args)
        open(os.path.join(output_dir, "done"), "w").close()
    with open(metrics) as f:
        evaluations = {m["episode"]: m for m in map(json.loads, f) if "eval/gold_win_rate" in m}
    episodes = args.optimizer_steps * args.prompts_per_step
    return {"half": evaluations[episodes // 2], "final": evaluations[episodes]}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table_of(results: dict, args: Args) -> dict:
    """{size: {arm: {"half_win_rate" | "win_rate" | "kl": {N: [mean, std]}, "drop": [mean, std]}}}:
    gold win-rate after half the steps and at the end, final KL, and the drop in final win-rate from the
    smallest N to the largest (seeds paired, so its spread is over seeds too)."""
    smallest, largest = min(args.mini_batches), max(args.mini_batches)
    table = {}
    for size, arms in results.items():
        table[size] = {}
        for arm, by_n in arms.items():
            column = {name: {n: [run[point][metric] for run in runs] for n, runs in by_n.items()}
                      for name, point, metric in (("half_win_rate", "half", "eval/gold_win_rate"),
                                                  ("win_rate", "final", "eval/gold_win_rate"),
                                                  ("kl", "final", "eval/kl"))}
            table[size][arm] = {name: {n: mean_std(values) for n, values in by_n.items()}
                                for name, by_n in column.items()}
            table[size][arm]["drop"] = mean_std([a - b for a, b in zip(column["win_rate"][smallest],
                                                                         column["win_rate"][largest])])
    return table


def report(table: dict, args: Args) -> None:
    smallest, largest = min(args.mini_batches), max(args.mini_batches)
    for size, arms in table.items():
        print(f"\n{size} policy, {args.optimizer_steps} steps of {args.prompts_per_step} prompts, mean ± std over "
              f"seeds {list(args.seeds)}; rows by drop, the most robust first (the paper: online DPO drops least)")
        for name, title, digits in (("half_win_rate", f"gold win-rate after {args.optimizer_steps // 2} steps", 3),
                                    ("win_rate", "final gold win-rate", 3), ("kl", "final KL", 2)):
            print(f"{title:38}" + "".join(f"{f'N={n}':>15}" for n in args.mini_batches)
                  + (f"{f'drop N={smallest}->{largest}':>18}" if name == "win_rate" else ""))
            for arm, row in sorted(arms.items(), key=lambda item: item[1]["drop"][0]):
                print(f"  {arm:36}" + "".join(f"{m:8.{digits}f} ± {s:.{digits}f}" for m, s in row[name].values())
                      + (f"{row['drop'][0]:11.3f} ± {row['drop'][1]:.3f}" if name == "win_rate" else ""))


def figure(table: dict, results: dict, args: Args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("half_win_rate", f"gold win-rate after {args.optimizer_steps // 2} steps"),
              ("win_rate", "final gold win-rate"), ("kl", "final KL"))
    fig, axes = plt.subplots(len(table), len(panels) + 1, figsize=(20, 4.2 * len(table)), squeeze=False)
    colors = dict(zip(ARMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for (size, arms), row_axes in zip(table.items(), axes):
        for arm, row in arms.items():
            corrected = "is_cap" in ARMS[arm][1]
            for axis, (name, _) in zip(row_axes, panels):
                means, stds = zip(*row[name].values())
                axis.errorbar(args.mini_batches, means, yerr=stds, color=colors[arm], marker="o", capsize=3,
                              linestyle="--" if corrected else "-", label=arm)
            for n, runs in results[size][arm].items():
                row_axes[-1].scatter([run["final"]["eval/kl"] for run in runs],
                                     [run["final"]["eval/gold_win_rate"] for run in runs],
                                     color=colors[arm], s=12 + 4 * n, alpha=0.6, marker="^" if corrected else "o")
        for axis, (_, label) in zip(row_axes, panels):
            axis.set_xscale("log", base=2)
            axis.set_xticks(args.mini_batches, [str(n) for n in args.mini_batches])
            axis.set_xlabel("N (mini-batches per generated batch)")
            axis.set_ylabel(label)
            axis.set_title(f"{size} policy")
        row_axes[-1].set_xlabel("final KL")
        row_axes[-1].set_ylabel("final gold win-rate")
        row_axes[-1].set_title(f"{size} policy: one point per run (larger: larger N)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(args: Args):
    if args.quick:
        args.sizes, args.mini_batches, args.optimizer_steps, args.prompts_per_step = ("small",), (1, 2), 4, 8
        args.seeds, args.eval_num_prompts = (1,), 32
    for n in args.mini_batches:
        if n <= 0 or args.optimizer_steps % (2 * n):
            raise SystemExit(f"error: --mini_batches {n} must be positive and divide half of --optimizer_steps "
                             f"{args.optimizer_steps} (the runs are evaluated half-way too)")
    missing = {script for script, _ in ARMS.values()} - args.learning_rates.keys()
    if missing:
        raise SystemExit(f"error: --learning_rates has no rate for {', '.join(sorted(missing))}")
    args.output_dir = args.output_dir or os.path.join(ROOT, "runs", f"bench-off-policy-{int(time.time())}")
    os.makedirs(args.output_dir, exist_ok=True)
    if "large" in args.sizes:
        toy.build_large()
    start = time.time()
    results = {size: {arm: {n: [train(arm, size, n, seed, args) for seed in args.seeds] for n in args.mini_batches}
                      for arm in ARMS} for size in args.sizes}
    print(f"the runs took {(time.time() - start) / 60:.1f} min")
    table = table_of(results, args)
    report(table, args)
    destinations = [os.path.join(args.output_dir, "results")]
    if not args.quick:
        destinations.append(os.path.join(ROOT, "bench", "results", "off_policy"))
    for destination in destinations:
        with open(destination + ".json", "w") as f:
            json.dump({"args": vars(args), "table": table, "runs": results}, f, indent=1)
        figure(table, results, args, destination + ".png")
        print(f"results in {destination}.json and .png")


if __name__ == "__main__":
    main(tyro.cli(Args))
