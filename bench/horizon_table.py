"""The long-horizon table of bench/RESULTS.md ("The corrections on a long horizon"), drawn from the per-update curves
that bench/off_policy_corrections.py keeps in its results JSON: for each run (algorithm, K, correction, the seeds
pooled), accuracy at a few updates (mean ± std over the seeds), each seed's lowest accuracy after update 8 and where,
the first update after it evaluated at 0.95 or more, `async/mismatch_kl` and `async/ess` averaged over windows of
updates (1-(K+1): the starting policy's samples; (K+2)-32, 33-64, 65-128: samples of weights the run trained), and
the final eval KL where the script has a reference. Flags that differ between the files (an --extra of one of them)
name its rows, and so does the toy build (`[toy <sha256 of the starting policy>]`) where a file records one other
than STORED_BUILD's.

    python bench/horizon_table.py bench/results/off_policy_corrections_*k16_total_episodes-8192_eval_in_trainer*.json
"""

import collections
import json
import shlex
import statistics
import sys

UPDATES = (8, 16, 24, 32, 64, 128)
BACK = 0.95  # the accuracy whose first return after a run's lowest is shown
# the build of the arithmetic task the unlabelled runs were made on (an AVX-512 machine's: the starting policy's
# sha256 begins so). The first files did not record it; runs of theirs made again on a build with this hash give
# their curves again to rounding (bench/findings.py checks it in `reproduced`), so a file of this build is theirs.
STORED_BUILD = "bef384c7"


def build_label(world: dict | None) -> str:
    """How a run's row names the build its file records: "" for the stored build (or none recorded), else
    "[toy <sha256[:8]>]"."""
    sha = world["policy_sha256"][:8] if world else STORED_BUILD
    return "" if sha == STORED_BUILD else f"[toy {sha}]"


def mean_std(values: list[float], form: str = "{:.3f}") -> str:
    return form.format(statistics.mean(values)) + (f" ± {form.format(statistics.stdev(values))}"
                                                   if len(values) > 1 else "")


def window_mean(curve: dict, name: str, first: int, last: int) -> float:
    return statistics.mean(value or 0.0 for update, value in zip(curve["update"], curve[name])
                           if first <= update <= last)


def flags(extra: str) -> list[str]:
    """`extra`'s flags, each with its values: "--a 1 --b" -> ["--a 1", "--b"]."""
    grouped = []
    for token in shlex.split(extra):
        if token.startswith("--") or not grouped:
            grouped.append(token)
        else:
            grouped[-1] += f" {token}"
    return grouped


def load(paths: list[str]) -> list[dict]:
    """The results JSON of each of `paths`."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    return results


def rows(results: list[dict]) -> dict:
    """Each run's seeds' curves, by (algorithm, K, correction, the flags that set its file apart): {seed: curve}, a
    run that two files hold (a sweep of a few corrections on more seeds) counted once."""
    extras = [set(flags(result["args"]["extra"])) for result in results]
    common = set.intersection(*extras)
    runs = collections.defaultdict(dict)
    for result, extra in zip(results, extras):
        # the world a run was made in, where its file names one (a toy task built on another CPU is another task)
        own = " ".join([*sorted(extra - common), build_label(result.get("world"))]).strip()
        for name, curve in result["curves"].items():
            algorithm, _, k, correction, seed = name.split()
            runs[(algorithm, int(k[1:]), correction, own)][int(seed.removeprefix("seed"))] = curve
    return runs


def table(results: list[dict]) -> list[str]:
    """The table's lines (markdown), its rows sorted by algorithm, K, correction and flags."""
    def windows(k: int) -> tuple:  # the first K + 1 updates train on the starting policy's samples
        return (1, k + 1), (k + 2, 32), (33, 64), (65, 128)

    lines = ["| run | seeds | " + " | ".join(map(str, UPDATES)) + f" | lowest after 8 (update) | back to {BACK} "
             "(update) | mismatch KL 1-(K+1) / (K+2)-32 / 33-64 / 65-128 | ESS (K+2)-32 / 65-128 | final eval KL |",
             "|" + " --- |" * (len(UPDATES) + 7)]
    for (algorithm, k, correction, own), by_seed in sorted(rows(results).items()):
        seeds = sorted(by_seed.items())
        curves = [curve for _, curve in seeds]
        accuracy = [dict(zip(curve["eval_update"], curve["eval/accuracy"])) for curve in curves]
        lows = [min((score, update) for update, score in by_update.items() if update > 8) for by_update in accuracy]
        lowest = ", ".join(f"{score:.2f} ({update})" for score, update in lows)
        back = ", ".join(str(next((update for update in sorted(by_update)
                                   if update > low and by_update[update] >= BACK), "-"))
                         for by_update, (_, low) in zip(accuracy, lows))
        starting, trained, middle, late = windows(k)
        drift = " / ".join(mean_std([window_mean(curve, "async/mismatch_kl", *window) for curve in curves])
                           for window in (starting, trained, middle, late))
        ess = " / ".join(mean_std([window_mean(curve, "async/ess", *window) for curve in curves], "{:.2f}")
                         for window in (trained, late))
        kl = mean_std([curve["eval/kl"][-1] for curve in curves], "{:.2f}") if "eval/kl" in curves[0] else "-"
        scores = " | ".join(mean_std([by_update[update] for by_update in accuracy]) for update in UPDATES)
        lines.append(f"| {algorithm} k{k} {correction}{' ' + own if own else ''} | "
                     f"{','.join(str(s) for s, _ in seeds)} | {scores} | {lowest} | {back} | {drift} | {ess} | {kl} |")
    return lines


if __name__ == "__main__":
    print("\n".join(table(load(sys.argv[1:]))))
