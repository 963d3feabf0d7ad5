"""The off-policy corrections (--off_policy_correction none, decoupled, tis, mask) on hand-computed numbers:
the ratio's denominator, each term's weight and the diagnostics (corrections.off_policy_terms), through PPO's,
RLOO's and GRPO's losses; every correction equals none when nothing is stale, and on fresh samples every ratio
is 1."""

import math

import pytest
import torch
from scripts import QUICK, read_metrics, run_script

import common
import corrections
import grpo
import ppo
import rloo

PAD = common.INVALID_LOGPROB
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
SAMPLING = torch.tensor([[0.0, 0.0, 0.0, PAD]])  # log-probs that sampled the tokens
STEP = torch.log(torch.tensor([[1.5, 0.5, 3.0, 1.0]]))  # the training forward's: pi_step / pi_sampling 1.5, 0.5, 3
START = torch.log(torch.tensor([[1.2, 0.8, 2.5, 1.0]]))  # at the start of the update: pi_start / pi_sampling
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, 5.0]])


def terms(correction, level="token", cap=None, new=STEP):
    flags = corrections.CorrectionArgs(off_policy_correction=correction, is_cap=cap)
    return corrections.off_policy_terms(new, SAMPLING, START, MASK, flags, sequence_level=level == "sequence")


def ppo_loss(correction, level="token", cap=None):
    anchor, weights, _ = terms(correction, level, cap)
    return ppo.policy_loss(STEP, anchor, ADVANTAGES, MASK, 0.2, MASK.sum().item(), weights)[0].item()


def test_none_takes_the_ratio_against_the_sampling_weights_unweighted():
    # ratios 1.5, 0.5, 3: max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; A = -1: max(3, 1.2) = 3
    assert ppo_loss("none") == pytest.approx((-1.2 - 0.5 + 3.0) / 3)


def test_decoupled_weights_each_term_by_the_capped_step_to_sampling_ratio_and_never_clips():
    anchor, weights, _ = terms("decoupled", cap=1.2)
    assert torch.equal(anchor, STEP) and weights[0, :3].tolist() == pytest.approx([1.2, 0.5, 1.2])
    assert ppo_loss("decoupled", cap=1.2) == pytest.approx((-1.2 - 0.5 + 1.2) / 3)  # -w A, the ratio being 1


def test_tis_takes_the_ratio_against_the_start_of_the_update_and_truncates_the_weight():
    # ratio to the start 1.25, 0.625, 1.2: -1.2 (clipped), -0.625, 1.2; weights min(1.2, 0.8, 2.5; 2)
    assert ppo_loss("tis") == pytest.approx((1.2 * -1.2 + 0.8 * -0.625 + 2.0 * 1.2) / 3)
    # one weight per completion: 1.2 x 0.8 x 2.5 = 2.4, capped at 2, on every token
    assert ppo_loss("tis", level="sequence") == pytest.approx(2.0 * (-1.2 - 0.625 + 1.2) / 3)


def test_mask_drops_the_terms_whose_weight_leaves_its_bounds():
    # weights 1.2 and 0.8 kept, 2.5 outside [0.5, 2]: its term drops out (the denominator keeps its token)
    assert ppo_loss("mask", cap=2.0) == pytest.approx((1.2 * -1.2 + 0.8 * -0.625) / 3)
    _, weights, diagnostics = terms("mask", cap=2.0)
    assert weights[0, :3].tolist() == pytest.approx([1.2, 0.8, 0.0])
    assert diagnostics["async/is_masked_frac"] == pytest.approx(1 / 3)


def test_the_diagnostics():
    _, _, none = terms("none")
    # k3 of pi_step / pi_sampling = r: r - 1 - log r, averaged over the 3 real tokens
    assert none["async/mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 0.5, 3.0)) / 3)
    assert none["async/is_ratio_mean"] == pytest.approx(5 / 3) and none["async/is_ratio_max"] == pytest.approx(3)
    assert none["async/is_truncated_frac"] == pytest.approx(1 / 3)  # 3 > 2, the cap none counts against
    _, _, tis = terms("tis")
    assert tis["async/is_ratio_mean"] == pytest.approx(1.5) and tis["async/is_ratio_max"] == pytest.approx(2.5)
    assert "async/is_masked_frac" not in tis
    merged = corrections.merge_diagnostics([none, tis])
    assert merged["async/is_ratio_max"] == pytest.approx(3) and merged["async/is_ratio_mean"] == pytest.approx(19 / 12)


@pytest.mark.parametrize("correction", ["none", "decoupled", "tis", "mask"])
def test_nothing_stale_every_correction_is_none(correction):
    """K = 0, one mini-batch: the sampling, start-of-update and step log-probs are the same."""
    fresh = SAMPLING.clone().requires_grad_()
    anchor, weights, diagnostics = corrections.off_policy_terms(
        fresh, SAMPLING, SAMPLING, MASK, corrections.CorrectionArgs(off_policy_correction=correction), False)
    assert torch.equal(weights, torch.ones_like(weights)) and torch.equal(anchor, SAMPLING)
    assert diagnostics["async/mismatch_kl"] == 0 and diagnostics["async/is_ratio_mean"] == 1
    assert diagnostics["async/is_ratio_max"] == 1 and diagnostics["async/is_truncated_frac"] == 0
    loss = ppo.policy_loss(fresh, anchor, ADVANTAGES, MASK, 0.2, MASK.sum().item(), weights)[0]
    loss.backward()
    assert loss.item() == pytest.approx(-1 / 3) and fresh.grad[0].tolist() == pytest.approx([-1 / 3, -1 / 3, 1 / 3, 0])


def test_rloo_and_grpo_weight_their_terms_the_same_way():
    anchor, weights, _ = terms("tis", level="sequence")
    new_seq, old_seq = common.masked_sum(STEP, MASK), common.masked_sum(anchor, MASK)
    advantage = torch.tensor([1.0])
    # ratio exp(sum log 1.5 0.5 3 - sum log 1.2 0.8 2.5) = 2.25 / 2.4 = 0.9375: inside the clip; weight 2
    loss = rloo.sequence_policy_loss(new_seq, old_seq, advantage, 0.2, weights.flatten())[0]
    assert loss.item() == pytest.approx(-2.0 * 0.9375)
    args = grpo.Args(loss_type="bnpo")
    args.generation.response_length = 4
    anchor, weights, _ = terms("tis")
    loss = grpo.policy_loss(STEP, anchor, ADVANTAGES[0, :1].repeat(1), MASK, args, 3.0, weights=weights)[0]
    # A = 1 on every token: -1.2 (clipped), -0.625, -1.2 (clipped at 1.2), weighted 1.2, 0.8, 2
    assert loss.item() == pytest.approx((1.2 * -1.2 + 0.8 * -0.625 + 2.0 * -1.2) / 3)


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_on_fresh_samples_every_ratio_is_1_and_nothing_is_clipped(tmp_path, script):
    """Synchronous, one epoch of one mini-batch: every optimizer step starts from the weights that sampled its
    batch, so the ratios are 1 (to the float rounding of two forwards of different batch shapes)."""
    run_script(*QUICK, "--num_epochs", "1", "--total_episodes", "32", "--eval_every", "0",
               "--output_dir", tmp_path / "run", script=script)
    train = [m for m in read_metrics(tmp_path / "run") if "val/ratio" in m]
    assert len(train) == 2 and all(abs(m["val/ratio"] - 1) < 1e-5 and m["policy/clipfrac_avg"] == 0 for m in train)
