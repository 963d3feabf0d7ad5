"""A toy build beside a busy process: how much longer it takes than alone, for each thread setting of the build.

Builds one embedded task (default: the guess-the-number environment, the quickest) from scratch, with each setting
(torch threads in the build; OMP_WAIT_POLICY), alone and beside --busy processes that spin on a core each
(`while True: pass`), and prints per setting the wall and CPU seconds (user + system, of the build's process) and
the ratios beside / alone, measured in this one run; and whether every setting built the same weights (the
builds must not depend on the thread count: the tasks are cached by their code alone). The machine's load average
is printed beside each build, since "alone" means without the bench's busy processes, not on an idle machine.

    python bench/toy_build_load.py                         # guess env: 1 thread, 2 threads, 2 passive threads
    python bench/toy_build_load.py --task math --settings 1 2 --repeats 2
"""

import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from toy import builder  # noqa: E402  (the kit's root on the path first)

TASKS = {"guess": ("toy.guess", "make_guess"), "math": ("toy.arithmetic", "make_math"),
         "tools": ("toy.tools", "make_tools"), "tldr": ("toy.tldr", "make_toy"), "large": ("toy.large", "make_large")}
# a setting: torch threads in the build, and the environment it starts with (OpenMP reads it at start-up)
SETTINGS = {"1": (1, {}), "2": (2, {}), "2-passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
            "2-active": (2, {"OMP_WAIT_POLICY": "ACTIVE"})}


@dataclass
class Args:
    task: Literal["guess", "math", "tools", "tldr", "large"] = "guess"
    """the embedded task to build (large: the larger SFT policy, the TL;DR-like world built first)"""
    settings: tuple[Literal["1", "2", "2-passive", "2-active"], ...] = ("1", "2", "2-passive")
    """thread settings: 1 or 2 torch threads, with OpenMP's default wait policy or OMP_WAIT_POLICY set"""
    busy: int = 1
    """busy processes beside the build (each spins on one core)"""
    repeats: int = 1
    """builds per setting alone and beside the busy ones, interleaved"""
    output: str = os.path.join(ROOT, "bench", "results", "toy_build_load.json")
    """where the measurements go (JSON)"""


def timed_build(task: str, setting: str, folder: str) -> dict:
    """Build `task` into `folder` in a process of its own; its wall and CPU seconds, the load average before it."""
    module, make = TASKS[task]
    threads, environment = SETTINGS[setting]
    code = (f"from toy.builder import build_in_this_process; from {module} import {make}; "
            f"build_in_this_process({folder!r}, {make}, 0, {task!r}, threads={threads})")
    before, start, load = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter(), os.getloadavg()[0]
    subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": ROOT} | environment, check=True,
                   stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    with open(os.path.join(folder, "sft_policy", "model.safetensors"), "rb") as f:
        weights = f.read()
    return {"wall": wall, "cpu": cpu, "load_before": load, "weights": weights}


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes spinning on a core each while the block runs; stopped and reaped after it."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    time.sleep(count and 1)  # running before the build starts
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


def main(args: Args):
    if args.task == "large":
        from toy import tldr

        tldr.build()
    runs = {setting: {"alone": [], "beside": []} for setting in args.settings}
    first_weights = None
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for setting in args.settings:
                for where in ("alone", "beside"):
                    folder = os.path.join(scratch, f"{setting}-{where}-{repeat}")
                    with busy_processes(args.busy if where == "beside" else 0):
                        run = timed_build(args.task, setting, folder)
                    shutil.rmtree(folder)
                    first_weights = first_weights or run["weights"]
                    run["same_weights"] = run.pop("weights") == first_weights
                    runs[setting][where].append(run)
                    print(f"{args.task} {setting:>9} {where:>6}: {run['wall']:6.1f} s wall, {run['cpu']:6.1f} s CPU "
                          f"(load average before: {run['load_before']:.1f})", flush=True)
    print(f"\n{args.task}, beside {args.busy} busy process(es); medians over {args.repeats} repeat(s); the kit's "
          f"setting: {builder.BUILD_THREADS} thread(s), OpenMP's default wait policy")
    print(f"{'setting':>10} {'alone wall':>11} {'alone CPU':>10} {'beside wall':>12} {'beside CPU':>11} "
          f"{'wall ratio':>11} {'CPU ratio':>10} {'same weights':>13}")
    table = {}
    for setting, cell in runs.items():
        medians = {f"{where}_{clock}": statistics.median(r[clock] for r in cell[where])
                   for where in ("alone", "beside") for clock in ("wall", "cpu")}
        row = table[setting] = {**medians, "wall_ratio": medians["beside_wall"] / medians["alone_wall"],
                                "cpu_ratio": medians["beside_cpu"] / medians["alone_cpu"],
                                "same_weights": all(r["same_weights"] for w in cell.values() for r in w)}
        print(f"{setting:>10} {row['alone_wall']:10.1f}s {row['alone_cpu']:9.1f}s {row['beside_wall']:11.1f}s "
              f"{row['beside_cpu']:10.1f}s {row['wall_ratio']:10.2f}x {row['cpu_ratio']:9.2f}x "
              f"{str(row['same_weights']):>13}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"task": args.task, "busy": args.busy, "repeats": args.repeats, "cores": os.cpu_count(),
                   "runs": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main(tyro.cli(Args))
