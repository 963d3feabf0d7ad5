"""The latency sweep's table of bench/RESULTS.md ("Multi-turn with slow tools: a latency sweep"), drawn from the
results JSON of bench/multiturn_sync_vs_async.py: per step latency and arm, the final eval return (median over the
seeds, each seed's in brackets), the seconds per update on the trainer's path (the training clock: the median run's
total over the updates), the engine's time per batch, the wall minutes since update 1 to each target return (the
median over the seeds; "-" where a seed never reached it), and the ratios to sync: per update on the training
clock, and to --target on the wall clock since update 1 (each seed's ratio, paired: their median and range); then
the overlap's bound from sync's parts.

    python bench/latency_table.py bench/results/multiturn_latency.json --target 0.7
"""

import json
import statistics
from dataclasses import dataclass

import tyro
from multiturn_sync_vs_async import median_or_none  # None where a seed never reached the target


@dataclass
class Args:
    results: tyro.conf.Positional[str]
    """a results JSON of bench/multiturn_sync_vs_async.py"""
    target: float = 0.7
    """the return whose wall minutes since update 1 are compared with sync's (one of the sweep's --targets)"""


def shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: dict, target: float) -> list[str]:
    """The table's lines (markdown)."""
    targets, updates = results["args"]["targets"], results["args"]["updates"]
    if target not in targets:
        raise SystemExit(f"--target {target:g} is not one of the sweep's targets {targets}")
    lines = ["| step latency | arm | final return | s per update on the trainer's path | the engine's batch | "
             f"wall minutes since update 1 to {' / '.join(map(str, targets))} | x sync per update (training clock) | "
             f"x sync to {target:g} (wall since update 1; per seed, median (range)) |", "|" + " --- |" * 8]
    for latency, arms in results["table"].items():
        sync = arms["sync"]
        sync_per_update = statistics.median(sync["training_minutes_total"]) * 60 / updates
        for arm, row in arms.items():
            if arm == "bound":
                continue
            per_update = statistics.median(row["training_minutes_total"]) * 60 / updates
            to_targets = [median_or_none(row[f"wall_minutes_to_{t:g}"]) for t in targets]
            engine = row["phases"].get("time/generate") if arm != "sync" else None
            finals = ", ".join(f"{value:.2f}" for value in row["final_returns"])
            final = statistics.median(row["final_returns"])
            lines.append(f"| {latency} s | {arm} | {final:.3f} ({finals}) | {per_update:.2f} | {shown(engine)} | "
                         f"{' / '.join(map(shown, to_targets))} | {sync_per_update / per_update:.2f}x | "
                         f"{paired_ratio(sync, row, f'wall_minutes_to_{target:g}')} |")
        lines.append(f"| {latency} s | bound (G + T) / max(G, T), sync's parts | | | | | {arms['bound']:.2f}x | |")
    return lines


def paired_ratio(sync: dict, row: dict, key: str) -> str:
    """Sync's minutes over the arm's, seed by seed (the same seed: the same episodes before they diverge): their
    median and range; "-" where a seed of either never reached the target."""
    ratios = [s / a for s, a in zip(sync[key], row[key]) if s is not None and a is not None]
    if len(ratios) < len(row[key]):
        return "-"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


def main(args: Args):
    with open(args.results) as f:
        print("\n".join(table(json.load(f), args.target)))


if __name__ == "__main__":
    main(tyro.cli(Args))
