"""rloo.py and bok.py: advantages, loss and selection on hand-made numbers, and both scripts end to end."""

import math

import pytest
import torch
import torch.nn.functional as F
from scripts import (
    QUICK,
    SHORT_INTERRUPTIONS,
    assert_learns,
    assert_same_weights_and_metrics,
    assert_trained_policy_saved,
    read_metrics,
    run_script,
    toy_run,
    uninterrupted_and_resumed_runs,
)

import bok
import common
import rloo


def test_leave_one_out_advantages_k2():
    # each sample's baseline is the other one's reward
    advantages = rloo.leave_one_out_advantages(torch.tensor([1.0, 3.0, -2.0, -2.0]), k=2)
    assert advantages.tolist() == pytest.approx([-2.0, 2.0, 0.0, 0.0])


def test_leave_one_out_advantages_k4():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 4.0])
    # prompt 0: baselines (11/3, 10/3, 9/3, 6/3); prompt 1: (4/3, 4/3, 4/3, 0)
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2, -4 / 3, -4 / 3, -4 / 3, 4.0]
    assert rloo.leave_one_out_advantages(rewards, k=4).tolist() == pytest.approx(expected)


def test_sequence_level_clipped_loss():
    old = torch.tensor([-3.0, -3.0, -3.0])
    new = old + torch.log(torch.tensor([1.5, 0.5, 0.5]))  # ratios of the summed sequence log-probs
    advantages = torch.tensor([2.0, 1.0, -1.0])
    loss, clipfrac, ratio = rloo.sequence_policy_loss(new, old, advantages, cliprange=0.2)
    # max(-A r, -A clip(r)): max(-3, -2.4) = -2.4; max(-0.5, -0.8) = -0.5; max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx((-2.4 - 0.5 + 0.8) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3) and ratio.tolist() == pytest.approx([1.5, 0.5, 0.5])


def test_best_of_k_selection_with_ties():
    scores = torch.tensor([0.1, 0.9, 0.5,   # a clear best: row 1
                           0.7, 0.2, 0.7,   # a tie for best: the first of them, row 3
                           -1.0, -1.0, -1.0])  # all tied (none stopped): row 6
    assert bok.best_of_k(scores, k=3).tolist() == [1, 3, 6]
    assert bok.best_of_k(torch.tensor([2.0, 1.0, 1.0, 2.0]), k=2).tolist() == [0, 3]


def test_nll_sums_real_tokens_over_the_steps_share(one_rank_group):
    logprobs = torch.tensor([[-1.0, -2.0, 1.0], [-3.0, 1.0, 1.0]])  # 1.0 is the pad sentinel
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert bok.nll_loss(logprobs, mask, step_tokens=3.0).item() == pytest.approx(2.0)
    # a step of this micro-batch and another with 5 tokens, accumulated over 2: each divides by (3 + 5) / 2
    other_mask = torch.ones(1, 5)
    assert common.loss_denominator(torch.cat([F.pad(mask, (0, 2)), other_mask]), accumulation_steps=2) == 4.0


@pytest.mark.parametrize("script", ["rloo.py", "bok.py"])
def test_logs_every_metric_and_saves_the_policy(tmp_path, script):
    """3 updates of 16 prompts, evaluated at the start and the end (the learning runs are the whole suite's)."""
    whole = tmp_path / "run"
    run_script(*QUICK, "--total_episodes", "48", "--eval_every", "3", "--output_dir", whole, script=script)
    metrics = read_metrics(whole)
    train = [m for m in metrics if "loss/policy_avg" in m]
    assert [m["update"] for m in train] == [1, 2, 3]
    assert [m["update"] for m in metrics if "eval/gold_win_rate" in m] == [0, 3]
    names = ["objective/scores", "objective/kl", "objective/entropy", "objective/rlhf_reward", "val/num_eos_tokens",
             "loss/policy_avg", "lr", "episode", "eps"]
    names += (["policy/clipfrac_avg", "policy/approxkl_avg", "val/ratio", "val/ratio_var"] if script == "rloo.py"
              else ["objective/best_scores", "objective/tie_fraction"])
    for name in names:
        assert all(math.isfinite(m[name]) for m in train), name
    assert train[0]["episode"] == 16 and train[0]["objective/kl"] == pytest.approx(0, abs=1e-4)
    if script == "bok.py":  # the best of 2 beats the mean of both wherever some pair is not a tie
        assert all(m["objective/best_scores"] > m["objective/scores"] for m in train
                   if m["objective/tie_fraction"] < 1)
    else:  # the first of 4 epochs is on-policy: ratios start at 1, and the later epochs move them
        assert 0.5 < train[0]["val/ratio"] < 2 and train[0]["val/ratio_var"] > 0
    assert_trained_policy_saved(whole)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["rloo.py", "bok.py"])
def test_the_short_toy_run_learns_and_resumes_after_a_kill_while_checkpointing_exactly(tmp_path, script):
    whole, resumed = uninterrupted_and_resumed_runs(tmp_path, script, toy_run(script), SHORT_INTERRUPTIONS)
    assert_learns(whole)
    assert_same_weights_and_metrics(whole, resumed, ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"])


@pytest.mark.slow
@pytest.mark.parametrize(("script", "correction"), [("rloo.py", "pure_is"), ("ppo.py", "pure_is"),
                                                     ("ppo.py", "decoupled")])
def test_pure_is_takes_its_ratio_against_each_steps_weights_and_decoupled_against_the_updates_start(
        tmp_path, script, correction):
    # 2 mini-batches x 4 epochs: 7 of the 8 optimizer steps train on samples from earlier weights; against the
    # weights of their own step (pure_is) the ratio is 1 and never clipped; against the weights at the start of
    # the update (decoupled, AReaL's proximal policy) it moves, and the clip binds
    run_script(*QUICK, "--total_episodes", "16", "--num_mini_batches", "2", "--gradient_accumulation_steps", "1",
               "--off_policy_correction", correction, "--is_cap", "2", "--eval_every", "0",
               "--output_dir", tmp_path / "run", script=script)
    [update] = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    # the steps after the first see weights that moved since sampling: the diagnostics say by how much
    assert update["async/mismatch_kl"] > 0
    if correction == "pure_is":
        assert update["val/ratio"] == pytest.approx(1.0) and update["val/ratio_var"] == pytest.approx(0, abs=1e-10)
        assert update["policy/clipfrac_avg"] == 0
        assert update["async/is_ratio_max"] > 1 and update["async/ess"] < 1  # of pi_step / pi_sampling
    else:
        assert update["val/ratio_var"] > 1e-4 and update["policy/clipfrac_avg"] > 0
        # its weight is pi_start / pi_sampling: 1 where the trainer sampled the batch
        assert update["async/is_ratio_max"] == 1 and update["async/ess"] == 1
