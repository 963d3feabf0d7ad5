"""LoRA against full fine-tuning, measured in one run: seconds per update and peak memory of a script on
bench/real_size.py's setup (a SmolLM2-135M-shaped policy with its 49k vocabulary, a chat template, an
encoder reward model, prompt-only data; no evaluation).

    python bench/lora.py                                   # online_dpo.py, 4 updates, 2 repeats: ~10 minutes
    python bench/lora.py --script ppo.py --repeats 1

The runs alternate (full, LoRA, full, LoRA, ...) so that the machine's drift spreads over both; the table
shows medians. Peak memory is the largest resident set of the run's whole process tree (trainer and, for the
vLLM scripts, the generator process), sampled every 0.1 s.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import psutil
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import off_policy_corrections  # noqa: E402  (bench/, this script's folder, is on the path: the CPU's model)
import real_size  # noqa: E402


@dataclass
class Args:
    script: str = "online_dpo.py"
    """the kit script to measure"""
    updates: int = 4
    """training updates per run (the first is excluded from the timings as warm-up)"""
    prompts_per_update: int = 8
    """prompts per update"""
    repeats: int = 2
    """runs of each setting, interleaved; the table shows medians over them"""
    extra: str = "--response_length 32"
    """extra flags passed to every run, in one argument: --extra='--response_length 128'"""
    results_file: str | None = None
    """also write every run's numbers and the medians here as JSON, with the date and the CPU (bench/findings.py
    renders RESULTS.md's table and ratios from it)"""


def tree_rss(process: psutil.Process) -> int:
    """Bytes resident in `process` and its descendants."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run(args: Args, folder: str, flags: list[str]) -> dict:
    """One run's seconds per update (median after the first), peak memory and trainable share."""
    output_dir = tempfile.mkdtemp(dir=folder)
    command = [sys.executable, os.path.join(ROOT, args.script), *real_size.script_flags(),
               "--total_episodes", str(args.updates * args.prompts_per_update),
               "--per_device_train_batch_size", str(args.prompts_per_update // 4), "--gradient_accumulation_steps", "4",
               "--output_dir", output_dir, *flags, *shlex.split(args.extra)]
    print("$", " ".join(command[1:]), flush=True)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    watched, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        peak = max(peak, tree_rss(watched))
        time.sleep(0.1)
    if process.returncode:
        sys.exit(f"this run failed (exit {process.returncode}):\n{process.stderr.read()[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    train = [m for m in metrics if "loss/policy_avg" in m]
    seconds = [b["time"] - a["time"] for a, b in zip(train, train[1:])]
    return {"seconds_per_update": statistics.median(seconds), "peak_gib": peak / 2**30,
            "train": statistics.median(m["time/train"] for m in train[1:]),
            "trainable_share": next(m["model/trainable_share"] for m in metrics if "model/trainable_share" in m)}


def main(args: Args):
    settings = {"full fine-tuning": [], "LoRA (--use_peft, r 16, all-linear)": ["--use_peft"]}
    runs = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for name, flags in settings.items():
                runs[name].append(run(args, folder, flags))
    print(f"\n{args.script}, {args.prompts_per_update} prompts per update, {args.extra}, medians of {args.repeats}")
    print(f"{'setting':38} {'s/update':>9} {'train s':>8} {'peak GiB':>9} {'trainable':>10}")
    medians = {}
    for name, rows in runs.items():
        medians[name] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        m = medians[name]
        print(f"{name:38} {m['seconds_per_update']:9.2f} {m['train']:8.2f} {m['peak_gib']:9.2f} "
              f"{m['trainable_share']:10.2%}")
    full, lora = medians.values()
    print(f"LoRA over full: {full['seconds_per_update'] / lora['seconds_per_update']:.2f}x per update, "
          f"{lora['peak_gib'] / full['peak_gib']:.2f}x the peak memory")
    if args.results_file:
        kept = {"date": time.strftime("%Y-%m-%d"), "cpu": off_policy_corrections.cpu()[0], "args": asdict(args),
                "settings": {name: {**medians[name], "runs": runs[name]} for name in settings}}
        off_policy_corrections.write_whole(args.results_file, kept)


if __name__ == "__main__":
    main(tyro.cli(Args))
