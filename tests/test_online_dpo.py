"""online_dpo.py: the loss on hand-computed numbers, and the script end to end on the toy task."""

import math

import pytest
import torch
from scripts import (
    QUICK,
    TOY_RUN,
    assert_learns,
    assert_same_weights_and_metrics,
    load_policy_weights,
    read_metrics,
    run_script,
    uninterrupted_and_resumed_runs,
)

import common


def test_dpo_losses_on_hand_computed_numbers():
    chosen, rejected = torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -1.0])
    ref_chosen, ref_rejected = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    # logits = (pi_c - pi_r) - (ref_c - ref_r) = [2, -3]
    sigmoid = common.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid")
    assert sigmoid.tolist() == pytest.approx([math.log(1 + math.exp(-0.2)), math.log(1 + math.exp(0.3))])
    ipo = common.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="ipo")
    assert ipo.tolist() == pytest.approx([(2 - 5) ** 2, (-3 - 5) ** 2])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return uninterrupted_and_resumed_runs(tmp_path_factory.mktemp("online_dpo"), "online_dpo.py",
                                          [*TOY_RUN, "--track"])


def test_logs_every_metric_to_jsonl_and_wandb_offline(runs):
    metrics = read_metrics(runs[0])
    train = [m for m in metrics if "loss/policy_avg" in m]
    evals = [m for m in metrics if "eval/gold_win_rate" in m]
    assert [m["update"] for m in train] == [1, 2, 3, 4, 5] and [m["update"] for m in evals] == [0, 1, 2, 3, 4, 5]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "objective/scores", "objective/scores_margin", "objective/kl",
                 "objective/entropy", "objective/rlhf_reward", "loss/policy_avg", "val/num_eos_tokens", "lr",
                 "episode", "eps"):
        assert all(math.isfinite(m[name]) for m in train), name
    assert [m["episode"] for m in train] == [64, 128, 192, 256, 320]
    assert 0 <= train[0]["val/num_eos_tokens"] <= 128
    assert train[0]["objective/scores_margin"] >= 0  # chosen is the best sample
    assert train[1]["lr"] < train[0]["lr"]  # linear decay
    assert evals[0]["eval/kl"] == pytest.approx(0, abs=1e-4)  # before any update the policy is the reference
    assert list((runs[0] / "wandb").glob("offline-run-*")), "wandb offline run missing"
    assert (runs[0] / "curves.png").stat().st_size > 10_000  # redrawn at every evaluation
    assert load_policy_weights(runs[0])  # the saved policy loads with from_pretrained


def test_short_run_beats_the_sft_policy(tmp_path):
    # DPO at lr 1e-4 needs about 10 updates to learn to stop (the 5 of the shared run give +9 points)
    run_script("--total_episodes", "640", "--eval_every", "1000", "--output_dir", tmp_path / "run")
    assert_learns(tmp_path / "run")


def test_resume_after_kill_gives_the_same_weights(runs):
    assert_same_weights_and_metrics(*runs, ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"])


def test_refuses_to_overwrite_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    result = run_script(*QUICK, "--output_dir", tmp_path, check=False)
    assert result.returncode != 0 and "is not empty; pass --resume" in result.stderr
