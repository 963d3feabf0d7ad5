"""The README's whole pipeline ("The whole pipeline: SFT, reward model, RL, evaluation"): its commands exactly as the
README writes them, one after another in a scratch folder, each timed from launch to exit; then what each step
reports: sft.py's evaluation loss and perplexity at its first and last evaluation, reward_model.py's pairs swapped by
the gold judge and its validation accuracy at its first and last evaluation, and eval_checkpoints.py's table (a row
per saved policy of the RL run).

    python bench/pipeline.py                                              # about 2 minutes on 2 CPU cores
    python bench/pipeline.py --results_file bench/results/pipeline.json   # kept for bench/findings.py
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import off_policy_corrections  # noqa: E402  (bench/, this script's folder, is on the path: the CPU's model)

import toy  # noqa: E402  (the kit's root on the path first)


@dataclass
class Args:
    results_file: str | None = None
    """also write each step's numbers here as JSON, with the date and the CPU"""


def readme_commands() -> list[str]:
    """The commands of the README's pipeline section: its first bash block."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## The whole pipeline"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def evaluations(run_dir: str, name: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m[name] for m in map(json.loads, f) if name in m]


def main(args: Args):
    toy.build_pipeline()  # the steps' starting points, built before the clock starts (as for a user: once)
    steps = []
    with tempfile.TemporaryDirectory() as folder:
        for command in readme_commands():
            words = shlex.split(command)
            assert words[0] == "python", command
            print("$", command, flush=True)
            start = time.time()
            result = subprocess.run([sys.executable, os.path.join(ROOT, words[1]), *words[2:]], cwd=folder,
                                    text=True, capture_output=True)
            if result.returncode:
                sys.exit(f"{command} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
            steps.append({"command": command, "seconds": time.time() - start, "stdout": result.stdout})
        runs = os.path.join(folder, "runs")
        sft_loss = evaluations(os.path.join(runs, "sft"), "eval/loss")
        swapped = [{"split": split, "swapped": int(swapped), "pairs": int(pairs)} for split, swapped, pairs in
                   re.findall(r"relabelled (\w+): (\d+) of (\d+) pairs", steps[1]["stdout"])]
        accuracy = evaluations(os.path.join(runs, "rm"), "eval/accuracy")
        with open(os.path.join(runs, "dpo", "eval", "eval.jsonl")) as f:
            table = [json.loads(line) for line in f]
    kept = {"date": time.strftime("%Y-%m-%d"), "cpu": off_policy_corrections.cpu()[0],
            "steps": [{"command": step["command"], "seconds": step["seconds"]} for step in steps],
            "sft_eval_loss": sft_loss, "relabelled": swapped, "reward_model_accuracy": accuracy, "eval_table": table}
    for step in kept["steps"]:
        print(f"{step['seconds']:6.0f} s  {step['command']}")
    print(f"sft.py: evaluation loss {sft_loss[0]:.2f} -> {sft_loss[-1]:.2f}; reward_model.py: "
          + ", ".join(f"{s['split']} {s['swapped']} of {s['pairs']} pairs swapped" for s in swapped)
          + f", validation accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}; eval_checkpoints.py: {len(table)} rows")
    if args.results_file:
        off_policy_corrections.write_whole(args.results_file, kept)


if __name__ == "__main__":
    main(tyro.cli(Args))
