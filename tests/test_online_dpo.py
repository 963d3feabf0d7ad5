"""online_dpo.py: the loss on hand-computed numbers, and the script end to end on the toy task."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a short run: 16 prompts x 2 samples per update, a small evaluation
QUICK = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--eval_num_prompts", "32",
         "--local_rollout_forward_batch_size", "32"]


def run_script(*args, script="online_dpo.py", check=True, launcher=(sys.executable,), env=None, timeout=900):
    script = [os.path.join(ROOT, script)] if script else []  # no script: python -c CODE
    result = subprocess.run([*launcher, *script, *map(str, args)], cwd=ROOT, text=True,
                            capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def load_policy_weights(output_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(output_dir, "policy")).state_dict()


def test_dpo_losses_on_hand_computed_numbers():
    chosen, rejected = torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -1.0])
    ref_chosen, ref_rejected = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    # logits = (pi_c - pi_r) - (ref_c - ref_r) = [2, -3]
    sigmoid = common.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid")
    assert sigmoid.tolist() == pytest.approx([math.log(1 + math.exp(-0.2)), math.log(1 + math.exp(0.3))])
    ipo = common.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="ipo")
    assert ipo.tolist() == pytest.approx([(2 - 5) ** 2, (-3 - 5) ** 2])


def test_end_to_end_with_wandb_offline(tmp_path):
    out = tmp_path / "run"
    result = run_script(*QUICK, "--total_episodes", "32", "--eval_every", "1", "--output_dir", out, "--track",
                        env={"WANDB_MODE": "offline"})
    metrics = read_metrics(out)
    train = [m for m in metrics if "loss/policy_avg" in m]
    evals = [m for m in metrics if "eval/gold_win_rate" in m]
    assert [m["update"] for m in train] == [1, 2] and [m["update"] for m in evals] == [0, 1, 2]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "objective/scores", "objective/scores_margin", "objective/kl",
                 "objective/entropy", "objective/rlhf_reward", "loss/policy_avg", "val/num_eos_tokens", "lr",
                 "episode", "eps"):
        assert all(math.isfinite(m[name]) for m in train), name
    assert train[0]["episode"] == 16 and train[1]["episode"] == 32
    assert 0 <= train[0]["val/num_eos_tokens"] <= 32
    assert train[0]["objective/scores_margin"] >= 0  # chosen is the best sample
    assert train[1]["lr"] < train[0]["lr"]  # linear decay
    assert evals[0]["eval/kl"] == pytest.approx(0, abs=1e-4)  # before any update the policy is the reference
    assert list((out / "wandb").glob("offline-run-*")), "wandb offline run missing"
    assert "gold win-rate" in result.stdout
    assert load_policy_weights(out)  # the saved policy loads with from_pretrained


def test_resume_after_kill_gives_the_same_weights(tmp_path):
    args = [*QUICK, "--total_episodes", "64", "--eval_every", "100", "--save_every", "2"]
    run_script(*args, "--output_dir", tmp_path / "whole")

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen([sys.executable, "online_dpo.py", *args, "--output_dir", str(interrupted)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (interrupted / "checkpoints" / "update-2").exists() and process.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (interrupted / "policy").exists(), "the run finished before it could be interrupted"
    run_script(*args, "--output_dir", interrupted, "--resume")

    whole, resumed = load_policy_weights(tmp_path / "whole"), load_policy_weights(interrupted)
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    losses = [[m["loss/policy_avg"] for m in read_metrics(d) if "loss/policy_avg" in m]
              for d in (tmp_path / "whole", interrupted)]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_short_run_beats_the_sft_policy(tmp_path):
    out = tmp_path / "run"
    run_script("--total_episodes", "640", "--eval_every", "1000", "--eval_num_prompts", "256",
               "--output_dir", out)
    evals = [m["eval/gold_win_rate"] for m in read_metrics(out) if "eval/gold_win_rate" in m]
    assert evals[-1] >= evals[0] + 0.10, evals


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_under_the_deepspeed_launcher(tmp_path, zero_stage):
    out = tmp_path / "run"
    run_script(*QUICK, "--total_episodes", "64", "--eval_every", "1", "--zero_stage", zero_stage,
               "--output_dir", out, launcher=("deepspeed", "--num_gpus", "2", "--master_port", str(29600 + zero_stage)),
               env={"OMP_NUM_THREADS": "1"})
    train = [m for m in read_metrics(out) if "loss/policy_avg" in m]
    assert [m["episode"] for m in train] == [32, 64]  # 16 prompts per rank per update
    assert load_policy_weights(out)


@pytest.mark.parametrize(("args", "message"), [
    (["--total_episodes", "100"], "--total_episodes 100 is not a multiple of the batch size 16"),
    (["--num_samples", "1"], "--num_samples must be at least 2"),
    (["--response_length", "0"], "--response_length must be positive"),
    (["--model_name_or_path", "/nonexistent/model"], "'/nonexistent/model' does not exist"),
])
def test_bad_arguments_fail_fast_and_leave_nothing(tmp_path, args, message):
    out = tmp_path / "run"
    result = run_script(*QUICK, *args, "--output_dir", out, check=False)
    assert result.returncode != 0
    assert message in result.stderr.strip().splitlines()[-1]
    assert not out.exists() or not any(out.iterdir())


def test_refuses_to_overwrite_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    result = run_script(*QUICK, "--output_dir", tmp_path, check=False)
    assert result.returncode != 0 and "is not empty; pass --resume" in result.stderr
