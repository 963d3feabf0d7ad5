"""The latency sweep's table of bench/RESULTS.md ("Multi-turn with slow tools: a latency sweep"), drawn from the
results JSON of bench/multiturn_sync_vs_async.py: per step latency and arm, the final eval return (median over the
seeds, each seed's in brackets), the seconds per update on the trainer's path (the training clock: the median run's
total over the updates), the engine's time per batch, the wall minutes since update 1 to each target return (the
median over the seeds; "-" where a seed never reached it), and the ratios to sync: per update on the training
clock, and to --target on the wall clock since update 1; then the overlap's bound from sync's parts.

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


def main(args: Args):
    with open(args.results) as f:
        results = json.load(f)
    targets, updates = results["args"]["targets"], results["args"]["updates"]
    if args.target not in targets:
        raise SystemExit(f"--target {args.target:g} is not one of the sweep's targets {targets}")
    print("| step latency | arm | final return | s per update on the trainer's path | the engine's batch | "
          f"wall minutes since update 1 to {' / '.join(map(str, targets))} | x sync per update (training clock) | "
          f"x sync to {args.target:g} (wall since update 1) |")
    print("|" + " --- |" * 8)
    for latency, arms in results["table"].items():
        sync = arms["sync"]
        sync_per_update = statistics.median(sync["training_minutes_total"]) * 60 / updates
        sync_to_target = median_or_none(sync[f"wall_minutes_to_{args.target:g}"])
        for arm, row in arms.items():
            if arm == "bound":
                continue
            per_update = statistics.median(row["training_minutes_total"]) * 60 / updates
            to_targets = [median_or_none(row[f"wall_minutes_to_{target:g}"]) for target in targets]
            to_target = median_or_none(row[f"wall_minutes_to_{args.target:g}"])
            ratio = f"{sync_to_target / to_target:.2f}x" if sync_to_target and to_target else "-"
            engine = row["phases"].get("time/generate") if arm != "sync" else None
            finals = ", ".join(f"{value:.2f}" for value in row["final_returns"])
            final = statistics.median(row["final_returns"])
            print(f"| {latency} s | {arm} | {final:.3f} ({finals}) | {per_update:.2f} | {shown(engine)} | "
                  f"{' / '.join(map(shown, to_targets))} | {sync_per_update / per_update:.2f}x | {ratio} |")
        print(f"| {latency} s | bound (G + T) / max(G, T), sync's parts | | | | | {arms['bound']:.2f}x | |")


if __name__ == "__main__":
    main(tyro.cli(Args))
