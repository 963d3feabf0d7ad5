"""Old tree against new on the same commands: a refactor that must not change behaviour is checked by running each
asynchronous mode in both trees and comparing every logged value but the clock's (time/*, and what is computed from
it) and the final weights, bit for bit.

    python bench/same_behaviour.py --base e55e8e8            # every run below, the base commit checked out beside
    python bench/same_behaviour.py --base e55e8e8 --only grpo_inflight multiturn_continuous

The base tree is a git worktree of `--base` (made under --work_dir, kept for later calls); both trees build their
embedded tasks as a user's run does. Prints one line per run (same, or what differs) and exits non-zero when a run
differs or fails.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--eval_num_prompts", "32",
         "--local_rollout_forward_batch_size", "32", "--total_episodes", "64", "--logprob_check_every", "2"]
MULTITURN_SYNC = ["--gradient_accumulation_steps", "1", "--total_episodes", "128", "--eval_num_prompts", "16",
                  "--eval_every", "2"]
MULTITURN = [*MULTITURN_SYNC, "--logprob_check_every", "2"]
DETERMINISTIC_INFLIGHT = ["--inflight_updates", "--inflight_deterministic"]
# each mode of the engine (K ahead with the engine evaluating, dynamic sampling, in flight) and of the episode loop
# (turn by turn, each episode at its own pace, in flight, with tools, and the synchronous script), a few updates each
RUNS = {
    "online_dpo_k1": ("online_dpo_vllm.py", [*QUICK, "--eval_every", "2"]),
    "rloo_k2": ("rloo_vllm.py", [*QUICK, "--async_steps", "2", "--eval_every", "2"]),
    "ppo_k1": ("ppo_vllm.py", [*QUICK, "--eval_every", "2"]),
    "grpo_dynamic_sampling": ("grpo_vllm.py", [*QUICK, "--dynamic_sampling", "--eval_every", "2"]),
    "grpo_inflight": ("grpo_vllm.py", [*QUICK, *DETERMINISTIC_INFLIGHT, "--eval_every", "2"]),
    "online_dpo_inflight_max_lag": ("online_dpo_vllm.py", [*QUICK, *DETERMINISTIC_INFLIGHT, "--max_lag", "1",
                                                           "--eval_every", "0"]),
    "multiturn_k1": ("grpo_multiturn_vllm.py", MULTITURN),
    "multiturn_continuous": ("grpo_multiturn_vllm.py", [*MULTITURN, "--continuous_episodes"]),
    "multiturn_inflight": ("grpo_multiturn_vllm.py", [*MULTITURN, *DETERMINISTIC_INFLIGHT, "--env",
                                                      "toy:guess_number_slow"]),
    "multiturn_tools_timeouts": ("grpo_multiturn_vllm.py", [
        *MULTITURN, "--env", "toy:add_with_tool", "--model_name_or_path", "toy:tools_policy", "--dataset_name",
        "toy:tools_dataset", "--chat_template", "--response_length", "16", "--env_latency", "0.01",
        "--env_latency_timeouts", "0.1", "--env_timeout", "0.5", "--env_failure", "error_message"]),
    "multiturn_sync": ("grpo_multiturn.py", MULTITURN_SYNC),
}
CLOCK = ("time", "eps", "env/step_time")  # what the clock decides (the prefixes of its metrics)


@dataclass
class Args:
    base: str
    """the commit (or branch) of the old tree"""
    only: list[str] = field(default_factory=list)
    """the runs to make (default: every one): names of RUNS"""
    new: str = ROOT
    """the new tree (default: this one)"""
    work_dir: str = "/tmp/same_behaviour"
    """where the base tree's worktree and both trees' runs go"""


def clock_free(record: dict) -> dict:
    """A metrics line without what the clock decides."""
    return {name: value for name, value in record.items() if not name.startswith(CLOCK)}


def differences(base_dir: str, new_dir: str) -> list[str]:
    """What differs between two runs' logs (every line, clock_free) and final policies (every tensor, bitwise). The
    lines are compared in the order of their updates (an evaluation the engine makes is logged when it arrives)."""
    def lines(folder):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            records = [clock_free(json.loads(line)) for line in f]
        return sorted(records, key=lambda record: (record.get("update", -1), sorted(record)))

    found = []
    base_lines, new_lines = lines(base_dir), lines(new_dir)
    if len(base_lines) != len(new_lines):
        found.append(f"{len(base_lines)} metrics lines in the base run, {len(new_lines)} in the new")
    for number, (old, new) in enumerate(zip(base_lines, new_lines)):
        for name in sorted(old.keys() | new.keys()):
            a, b = old.get(name), new.get(name)
            if a != b and not (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
                found.append(f"line {number} {name}: {a} (base) != {b} (new)")
    weights = [policy_weights(folder) for folder in (base_dir, new_dir)]
    if weights[0].keys() != weights[1].keys():
        found.append("the final policies hold different tensors")
    found += [f"final weights differ: {name}" for name in weights[0]
              if name in weights[1] and not torch.equal(weights[0][name], weights[1][name])]
    return found


def policy_weights(folder: str) -> dict:
    from safetensors.torch import load_file

    policy = os.path.join(folder, "policy")
    return {name: tensor for file in sorted(os.listdir(policy)) if file.endswith(".safetensors")
            for name, tensor in load_file(os.path.join(policy, file)).items()}


def base_tree(base: str, work_dir: str) -> str:
    """A worktree of `base` under `work_dir` (made once)."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", base], capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = os.path.join(work_dir, f"tree-{sha[:10]}")
    if not os.path.exists(tree):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, sha], check=True)
    return tree


def run(tree: str, script: str, args: list[str], output_dir: str) -> subprocess.CompletedProcess:
    """`script` of `tree` with `args`, from `tree` (tests/ paths in args are that tree's)."""
    command = [sys.executable, os.path.join(tree, script), *args, "--output_dir", output_dir]
    return subprocess.run(command, cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": tree, "WANDB_MODE": "offline"})


def main(args: Args):
    unknown = [name for name in args.only if name not in RUNS]
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: no such run; there are {', '.join(RUNS)}")
    trees = {"base": base_tree(args.base, args.work_dir), "new": args.new}
    failed = False
    for name in args.only or RUNS:
        script, run_args = RUNS[name]
        outputs = {}
        for side, tree in trees.items():
            outputs[side] = os.path.join(args.work_dir, name, side)
            subprocess.run(["rm", "-rf", outputs[side]], check=True)
            result = run(tree, script, run_args, outputs[side])
            if result.returncode != 0:
                print(f"{name}: the {side} run failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
                failed = True
                break
        else:
            found = differences(outputs["base"], outputs["new"])
            failed |= bool(found)
            print(f"{name}: " + ("same (every logged value but the clock's, and the final weights)" if not found
                                 else "DIFFERS\n  " + "\n  ".join(found[:20])), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(tyro.cli(Args))
