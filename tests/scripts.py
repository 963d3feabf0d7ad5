"""Helpers for tests that run the algorithm scripts as subprocesses on the toy task."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("online_dpo.py", "online_dpo_vllm.py", "ppo.py", "rloo.py", "bok.py", "rloo_vllm.py", "ppo_vllm.py",
           "grpo.py", "grpo_vllm.py")
# a short run: 16 prompts per update, a small evaluation
QUICK = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--eval_num_prompts", "32",
         "--local_rollout_forward_batch_size", "32"]


def free_port() -> int:
    """A free port for a launcher's --master_port, from below the range the system hands out to sockets bound
    to port 0 and to outgoing connections (an engine's, a parallel test's): none of those can take it between
    this check and the launcher's rank 0 binding it; a parallel test could only by drawing the same port."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    while True:
        port = random.randrange(10000, first_ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def run_script(*args, script="online_dpo.py", check=True, launcher=(sys.executable,), env=None, timeout=900,
               cwd=ROOT):
    """Run `script` (a path from the repository root: a kit script, or a program under tests/) in `cwd`, in a
    session of its own (as a scheduler's job: a test signals its whole process group), with this process's
    environment and `env`."""
    command = [*launcher, os.path.join(ROOT, script), *map(str, args)]
    result = subprocess.run(command, cwd=cwd, text=True, capture_output=True, timeout=timeout,
                            start_new_session=True, env=environment(env))
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def start_script(*args, script="online_dpo.py", launcher=(sys.executable,), env=None, cwd=ROOT, stderr=None):
    """Start `script` as run_script runs it, in a session of its own (SIGKILL its process group to end the run
    and every process it started), its output discarded but for its standard error into the file `stderr`, if
    given."""
    command = [*launcher, os.path.join(ROOT, script), *map(str, args)]
    with open(os.devnull, "w") as null, open(stderr or os.devnull, "w") as errors:
        return subprocess.Popen(command, cwd=cwd, stdout=null, stderr=errors, start_new_session=True,
                                env=environment(env))


def environment(extra=None) -> dict:
    """This process's environment, with the kit importable by the programs under tests/."""
    return {**os.environ, "PYTHONPATH": ROOT, **(extra or {})}


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def saved_policy(output_dir, info: bool = False):
    """The run's saved policy/ as a plain model; a LoRA run's adapter merged into its base by peft itself. With
    `info`, also from_pretrained's loading info (nothing missing or unexpected: empty for an adapter, which
    peft checks)."""
    from transformers import AutoModelForCausalLM

    folder = os.path.join(output_dir, "policy")
    if os.path.exists(os.path.join(folder, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        policy = AutoPeftModelForCausalLM.from_pretrained(folder).merge_and_unload()
        return (policy, {}) if info else policy
    return AutoModelForCausalLM.from_pretrained(folder, output_loading_info=info)


def load_policy_weights(output_dir):
    return saved_policy(output_dir).state_dict()


def assert_trained_policy_saved(output_dir, sft_path=None):
    """The saved policy loads with from_pretrained (a LoRA adapter with peft) with every weight in place
    (nothing missing, nothing extra such as a value head), and training changed it."""
    from transformers import AutoModelForCausalLM

    import toy

    policy, info = saved_policy(output_dir, info=True)
    assert not any(info.get(kind) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    sft = AutoModelForCausalLM.from_pretrained(sft_path or toy.SFT_POLICY).state_dict()
    trained = policy.state_dict()
    assert trained.keys() == sft.keys()
    assert any(not torch.equal(trained[name], sft[name]) for name in sft), "the saved policy is the SFT policy"


def logged_update(output_dir, update: int) -> bool:
    """Whether the run has logged the training metrics of `update`."""
    path = output_dir / "metrics.jsonl"
    return path.exists() and any(f'"update": {update},' in line and "loss/policy_avg" in line
                                 for line in path.read_text().splitlines())


# Where a run gets killed (SIGKILL: the out-of-memory killer, or a scheduler at the end of its grace
# period): each a (description, condition on the output directory) pair.
KILL_POINTS = {
    "SIGKILL during update 1, before any checkpoint": lambda out: logged_update(out, 1),
    "SIGKILL while checkpoint 4 is being written": lambda out: (out / "checkpoints" / ".partial-update-4").exists(),
}
# Where a run is preempted: the signals tests/run_with_signals.py sends the run's process group, at points
# of its updates (counted from 1 in each launch)
PREEMPTIONS = {
    "SIGTERM while the first update's batch is sampled": [[1, "generation", "SIGTERM"]],
    "SIGUSR1 while the first update trains, SIGTERM again while its checkpoint is written":
        [[1, "training", "SIGUSR1"], [1, "saving", "SIGTERM"]],
}
PREEMPTED_EXIT_CODE = 75


def kill_at(script, args, output_dir, kill_point: str, launcher=(sys.executable,), env=None):
    """Start (or resume) a run and SIGKILL it, with every process it started, at `kill_point`: as soon as it has
    logged update 1; or from inside, as checkpoint 4 is being written (tests/run_killed_while_checkpointing.py:
    a watcher could miss that moment)."""
    mid_checkpoint = "while checkpoint" in kill_point
    program = ["tests/run_killed_while_checkpointing.py", script.removesuffix(".py")] if mid_checkpoint else [script]
    process = start_script(*program[1:], *args, "--output_dir", output_dir, script=program[0], launcher=launcher,
                           env=env)
    if mid_checkpoint:
        process.wait(timeout=600)
    else:
        deadline = time.time() + 600
        while not KILL_POINTS[kill_point](output_dir) and process.poll() is None:
            assert time.time() < deadline
            time.sleep(0.002)
        os.killpg(process.pid, signal.SIGKILL)  # the whole session: ranks under a launcher, the vLLM engine
        process.wait()
    assert KILL_POINTS[kill_point](output_dir), f"the run exited ({process.returncode}) before {kill_point}"
    assert not (output_dir / "policy").exists(), f"the run finished before it could be killed {kill_point}"
    if mid_checkpoint:  # killed mid-save: the half-written checkpoint is not used
        assert not (output_dir / "checkpoints" / "update-4").exists(), "the save completed before the kill"
        assert (output_dir / "checkpoints" / "update-2").exists()


def checkpointed_update(output_dir) -> int:
    folder = output_dir / "checkpoints"
    updates = [int(p.name.split("-")[1]) for p in folder.glob("update-*")] if folder.is_dir() else []
    return max(updates, default=0)


def preempt(script, args, output_dir, preemption: str, launcher=(sys.executable,), env=None):
    """Start (or resume) a run that gets the signals of `preemption` in its first update: it must
    checkpoint that update and exit with PREEMPTED_EXIT_CODE (every rank; the deepspeed runner itself
    dies of the SIGTERM). Returns the run's output."""
    update = checkpointed_update(output_dir) + 1
    # in its own session, as a scheduler's job
    result = run_script(script.removesuffix(".py"), json.dumps(PREEMPTIONS[preemption]), *args, "--output_dir",
                        output_dir, script="tests/run_with_signals.py", check=False, launcher=launcher, env=env,
                        timeout=600)
    output = result.stdout + result.stderr
    if launcher == (sys.executable,):
        assert result.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert f"preempted: update {update} finished and checkpointed" in output, output[-3000:]
    assert checkpointed_update(output_dir) == update and not (output_dir / "policy").exists()
    return output


# A short toy run: 320 prompts (5 updates of 64, GRPO's 10 of 32), evaluated after every update on 128
# prompts, checkpointed every 2 updates. Enough for every script to beat the SFT policy by far more than 10
# points.
TOY_RUN = ["--total_episodes", "320", "--eval_every", "1", "--eval_num_prompts", "128", "--save_every", "2"]
# RLOO and PPO take TOY_RUN at twice their default learning rate (3e-5): toy builds differ with the CPU, and
# on some the 5 updates at 3e-5 gain less than 0.10 win-rate (ppo.py 0.086 and rloo.py 0.086 on one, where
# at 6e-5 they gain 0.52; ppo_vllm.py 0.094 on another)
TOY_RUN_LEARNING_RATE = {"rloo.py": "6e-5", "rloo_vllm.py": "6e-5", "ppo.py": "6e-5", "ppo_vllm.py": "6e-5",
                         # GRPO's one epoch per batch: 10 updates of 32 prompts gain 0.41 at 1e-4, 0.10 at 6e-5
                         "grpo.py": "1e-4", "grpo_vllm.py": "1e-4"}


def toy_run(script: str) -> list[str]:
    """TOY_RUN's arguments for `script`."""
    learning_rate = ["--learning_rate", TOY_RUN_LEARNING_RATE[script]] if script in TOY_RUN_LEARNING_RATE else []
    return [*TOY_RUN, *learning_rate]


def uninterrupted_and_resumed_runs(folder, script, args, interruptions, launcher=(sys.executable,), env=None,
                                   keep_weights=False):
    """Run `script` once without interruption (`keep_weights`: through tests/run_with_kept_weights.py), and
    once interrupted by each of `interruptions` (KILL_POINTS and PREEMPTIONS) in turn, resuming with --resume
    after each; returns both run directories."""
    whole = [script.removesuffix(".py"), *args] if keep_weights else args
    run_script(*whole, "--output_dir", folder / "whole", launcher=launcher, env=env,
               script="tests/run_with_kept_weights.py" if keep_weights else script)
    return folder / "whole", interrupted_and_resumed(folder, script, args, interruptions, launcher, env)


def interrupted_and_resumed(folder, script, args, interruptions, launcher=(sys.executable,), env=None):
    """`script` interrupted by each of `interruptions` in turn, resumed with --resume after each, then to its
    end: returns the run directory, folder / "interrupted"."""
    for interruption in interruptions:
        interrupt = kill_at if interruption in KILL_POINTS else preempt
        interrupt(script, [*args, "--resume"], folder / "interrupted", interruption, launcher=launcher, env=env)
    run_script(*args, "--output_dir", folder / "interrupted", "--resume", script=script, launcher=launcher, env=env)
    return folder / "interrupted"


# What a run of 4 or more updates checkpointed every 2 goes through: both preemptions (checkpoints 1 and
# 2), then a kill in the middle of writing checkpoint 4; the synchronous scripts are first killed
# before any checkpoint, too (the vLLM scripts go through the same code there).
INTERRUPTIONS = (*PREEMPTIONS, "SIGKILL while checkpoint 4 is being written")
SYNC_INTERRUPTIONS = ("SIGKILL during update 1, before any checkpoint", *INTERRUPTIONS)
# what the scripts whose loops save and restore the same state through the same code as online DPO's go
# through: the kill while checkpoint 4 is written (they resume from checkpoint 2)
SHORT_INTERRUPTIONS = ("SIGKILL while checkpoint 4 is being written",)


def assert_same_weights_and_metrics(whole, resumed, names, after_update=-1):
    """Bit for bit: the final weights, and the logged `names` at every update after `after_update`."""
    whole_weights, resumed_weights = load_policy_weights(whole), load_policy_weights(resumed)
    assert all(torch.equal(whole_weights[name], resumed_weights[name]) for name in whole_weights)
    for name in names:
        logged = [[m[name] for m in read_metrics(d) if name in m and m["update"] > after_update]
                  for d in (whole, resumed)]
        assert logged[0] == logged[1] and logged[0], name


# GRPO's flags that gather over ranks (the batch's reward statistics, dynamic sampling's rounds): what its
# two-rank runs add, so that a rank trained on its own share of them would show
GRPO_ACROSS_RANKS = ["--dynamic_sampling", "--scale_rewards", "batch"]


def assert_two_ranks_train_as_one(two, one):
    """A two-rank run and a one-rank run of the same global batches: the same samples (scores within 1e-6),
    each update's loss within 1e-5, and final weights that differ by under 0.1% of how far training moved them
    (L2 over every weight: the order of float sums makes 0.7e-5 to 7e-5 of it; one rank's rows weighted twice in
    the gradient made 0.37)."""
    import pytest
    from transformers import AutoModelForCausalLM

    two_metrics, one_metrics = ([m for m in read_metrics(run) if "loss/policy_avg" in m] for run in (two, one))
    assert len(two_metrics) == len(one_metrics) > 0
    for name, tolerance in (("objective/scores", 1e-6), ("loss/policy_avg", 1e-5)):
        assert [m[name] for m in two_metrics] == pytest.approx([m[name] for m in one_metrics], abs=tolerance), name
    with open(os.path.join(one, "args.json")) as f:
        start = AutoModelForCausalLM.from_pretrained(json.load(f)["args"]["model_name_or_path"]).state_dict()
    two_weights, one_weights = load_policy_weights(two), load_policy_weights(one)
    difference = torch.cat([(two_weights[name] - one_weights[name]).flatten() for name in one_weights]).norm()
    moved = torch.cat([(one_weights[name] - start[name]).flatten() for name in one_weights]).norm()
    assert difference < 1e-3 * moved, (difference.item(), moved.item())


# What a correct run of the tests' learning configurations gains in gold win-rate on the toy task, measured
# over seeds 1-3: ppo/rloo/bok.py 0.50-0.55, their vLLM twins at K=1 0.42-0.52 (GRPO's), online DPO 0.34-0.44
# (sync and vLLM, 10 updates), with LoRA 0.52-0.59; a half-broken loss, or one that only learns to stop, gains
# less.
def assert_learns(run_dir, min_gain=0.3):
    evals = [m["eval/gold_win_rate"] for m in read_metrics(run_dir) if "eval/gold_win_rate" in m]
    assert evals[-1] >= evals[0] + min_gain, evals
