"""The off-policy corrections (--off_policy_correction none, decoupled, pure_is, tis, mask, m2po) on
hand-computed numbers: the ratio's denominator, each term's weight, the tokens kept and the diagnostics
(corrections.off_policy_terms), through PPO's, RLOO's and GRPO's losses; decoupled against AReaL's formula;
every correction but pure_is and m2po equals none when the trainer sampled the batch, and on fresh samples
every ratio is 1."""

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
CORRECTIONS = ["none", "decoupled", "pure_is", "tis", "mask", "m2po"]


def terms(correction, level="token", cap=None, new=STEP, **flags):
    flags = corrections.CorrectionArgs(off_policy_correction=correction, is_cap=cap, **flags)
    return corrections.off_policy_terms(new, SAMPLING, START, MASK, flags, sequence_level=level == "sequence")


def ppo_loss(correction, level="token", cap=None, **flags):
    made = terms(correction, level, cap, **flags)
    return ppo.policy_loss(STEP, made.anchor, ADVANTAGES, MASK, 0.2, MASK.sum().item(), made.token_weights,
                           made.clip)[0].item()


def test_none_takes_the_ratio_against_the_sampling_weights_unweighted():
    # ratios 1.5, 0.5, 3: max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; A = -1: max(3, 1.2) = 3
    assert ppo_loss("none") == pytest.approx((-1.2 - 0.5 + 3.0) / 3)


def areal_decoupled_loss(logprobs, proximal, behaviour, advantages, mask, eps_clip, cap):
    """AReaL's ppo_actor_loss_fn with its behav_imp_weight_cap, transcribed term by term: the ratio against the
    proximal policy, clipped; each term times pi_prox / pi_behave, 0 where that exceeds the cap; summed over the
    real tokens and divided by their count (the dropped ones included)."""
    ratio = torch.exp(logprobs - proximal)
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip))
    behave_weight = torch.exp(proximal - behaviour)
    behave_weight = torch.where((behave_weight <= cap) & mask.bool(), behave_weight, 0.0)
    return (torch.where(mask.bool(), pg_loss * behave_weight, 0.0)).sum() / mask.count_nonzero()


@pytest.mark.parametrize("cap", [2.0, 5.0])
def test_decoupled_is_areals_decoupled_ppo(cap):
    """The ratio against the start of the update (AReaL's proximal policy): 1.25, 0.625, 1.2. cap 2: weights 1.2,
    0.8, and 2.5 is dropped: 1.2 x -1.2 (clipped) + 0.8 x -0.625 = -1.94; cap 5: + 2.5 x 1.2 (A = -1)."""
    expected = (-1.94 if cap == 2.0 else -1.94 + 3.0) / 3
    assert ppo_loss("decoupled", cap=cap) == pytest.approx(expected)
    assert areal_decoupled_loss(STEP, START, SAMPLING, ADVANTAGES, MASK, 0.2, cap).item() == pytest.approx(expected)
    made = terms("decoupled", cap=cap)
    assert torch.equal(made.anchor, START) and made.clip and not made.weights.requires_grad


def test_decoupleds_clip_binds_on_a_stale_batchs_later_steps_and_pure_is_never_clips():
    """A later optimizer step: the weights moved since the start of the update (1.25 > 1.2 with A > 0), so
    decoupled's clip binds; pure_is takes the ratio against this step's own weights: 1, never clipped."""
    for correction, clipfrac in (("decoupled", 1 / 3), ("pure_is", 0.0)):
        made = terms(correction)
        assert ppo.policy_loss(STEP, made.anchor, ADVANTAGES, MASK, 0.2, 3.0, made.token_weights,
                               made.clip)[1].item() == pytest.approx(clipfrac)


def test_pure_is_weights_each_term_by_the_capped_step_to_sampling_ratio_and_never_clips():
    made = terms("pure_is", cap=1.2)
    assert torch.equal(made.anchor, STEP) and made.weights[0, :3].tolist() == pytest.approx([1.2, 0.5, 1.2])
    assert ppo_loss("pure_is", cap=1.2) == pytest.approx((-1.2 - 0.5 + 1.2) / 3)  # -w A, the ratio being 1


def test_tis_takes_the_ratio_against_the_start_of_the_update_and_truncates_the_weight():
    # ratio to the start 1.25, 0.625, 1.2: -1.2 (clipped), -0.625, 1.2; weights min(1.2, 0.8, 2.5; 2)
    assert ppo_loss("tis") == pytest.approx((1.2 * -1.2 + 0.8 * -0.625 + 2.0 * 1.2) / 3)
    # one weight per completion: 1.2 x 0.8 x 2.5 = 2.4, capped at 2, on every token
    assert ppo_loss("tis", level="sequence") == pytest.approx(2.0 * (-1.2 - 0.625 + 1.2) / 3)


def test_mask_drops_the_terms_whose_weight_leaves_its_bounds():
    # weights 1.2 and 0.8 kept, 2.5 outside [0.5, 2]: its term drops out (the denominator keeps its token)
    assert ppo_loss("mask", cap=2.0) == pytest.approx((1.2 * -1.2 + 0.8 * -0.625) / 3)
    made = terms("mask", cap=2.0)
    assert made.weights[0, :3].tolist() == pytest.approx([1.2, 0.8, 0.0])
    assert made.diagnostics["async/is_masked_frac"] == pytest.approx(1 / 3)


def test_m2po_drops_the_largest_squared_log_ratios_until_their_mean_is_under_the_threshold():
    """m2 = log(pi_start / pi_sampling)^2: 0.0332, 0.0498, 0.8396. Dropping the largest leaves a mean of 0.0415:
    not under 0.04, so the next goes too; under 0.05 it stays. The kept tokens' terms are decoupled's, unclipped
    (1.2 x -1.25, 0.8 x -0.625); the dropped ones weigh 0 and still count in the denominator (3 tokens)."""
    m2 = [math.log(r) ** 2 for r in (1.2, 0.8, 2.5)]
    assert (m2[0] + m2[1]) / 2 == pytest.approx(0.0415, abs=1e-4)
    made = terms("m2po")
    assert made.kept[0].tolist() == [1.0, 0.0, 0.0, 0.0] and not made.clip and torch.equal(made.anchor, START)
    assert made.diagnostics["async/m2po_masked_frac"] == pytest.approx(2 / 3)
    assert ppo_loss("m2po") == pytest.approx(1.2 * -1.25 / 3)
    assert terms("m2po", m2_threshold=0.05).kept[0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert ppo_loss("m2po", m2_threshold=0.05) == pytest.approx((1.2 * -1.25 + 0.8 * -0.625) / 3)
    # every mean above the threshold: only the smallest stays (AReaL's rule); nothing above it: all stay
    assert terms("m2po", m2_threshold=1e-4).kept[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert terms("m2po", m2_threshold=1.0).kept[0].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_m2po_per_completion_sums_the_kept_tokens():
    """RLOO's loss is per completion: its log-probs and its weight are summed over the tokens m2po keeps."""
    made = terms("m2po", level="sequence", m2_threshold=0.05)
    assert made.weights.item() == pytest.approx(1.2 * 0.8)  # exp(log 1.2 + log 0.8), token 3 dropped
    new_seq, old_seq = common.masked_sum(STEP, made.kept), common.masked_sum(made.anchor, made.kept)
    ratio = math.exp(math.log(1.5 * 0.5) - math.log(1.2 * 0.8))
    loss = rloo.sequence_policy_loss(new_seq, old_seq, torch.tensor([-1.0]), 0.2, made.weights.flatten(), made.clip)[0]
    assert loss.item() == pytest.approx(0.96 * ratio)  # 0.78 unclipped: a clip would have made it 0.8


def test_the_diagnostics():
    none = terms("none").diagnostics
    # k3 of pi_step / pi_sampling = r: r - 1 - log r, averaged over the 3 real tokens
    assert none["async/mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 0.5, 3.0)) / 3)
    assert none["async/is_ratio_mean"] == pytest.approx(5 / 3) and none["async/is_ratio_max"] == pytest.approx(3)
    assert none["async/is_truncated_frac"] == pytest.approx(1 / 3)  # 3 > 2, the cap none counts against
    tis = terms("tis").diagnostics
    assert tis["async/is_ratio_mean"] == pytest.approx(1.5) and tis["async/is_ratio_max"] == pytest.approx(2.5)
    assert "async/is_masked_frac" not in tis
    merged = corrections.merge_diagnostics([none, tis])
    assert merged["async/is_ratio_max"] == pytest.approx(3) and merged["async/is_ratio_mean"] == pytest.approx(19 / 12)
    # the effective sample size's share, (sum w)^2 / (N sum w^2), of the weights before truncation
    assert corrections.merge_diagnostics([none])["async/ess"] == pytest.approx(5 ** 2 / (3 * (1.5 ** 2 + 0.5 ** 2 + 9)))
    assert merged["async/ess"] == pytest.approx((5 + 4.5) ** 2 / (6 * (11.5 + 1.2 ** 2 + 0.8 ** 2 + 2.5 ** 2)))


def test_the_drift_per_completion():
    """Each completion's mean log-ratio and largest |log-ratio| over its own real tokens, then over completions: two
    of 3 and 1 tokens (a per-token mean would weigh the long one 3x), and one row with no real token (left out)."""
    log_ratio = torch.tensor([[0.2, -1.0, 0.0, 9.0], [0.5, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    drift = corrections.sequence_log_ratios(log_ratio, mask)
    assert drift["async/seq_log_ratio_mean"] == pytest.approx((-0.8 / 3 + 0.5) / 2)
    assert drift["async/seq_log_ratio_peak"] == pytest.approx((1.0 + 0.5) / 2)
    assert drift["async/seq_log_ratio_peak_max"] == pytest.approx(1.0)
    # in off_policy_terms, of log pi_step / pi_sampling (1.5, 0.5, 3), every correction alike
    none = terms("none").diagnostics
    assert none["async/seq_log_ratio_mean"] == pytest.approx(math.log(1.5 * 0.5 * 3) / 3)
    assert none["async/seq_log_ratio_peak"] == none["async/seq_log_ratio_peak_max"] == pytest.approx(math.log(3))
    merged = corrections.merge_diagnostics([none, terms("tis", new=START).diagnostics])  # the largest of the peaks
    assert merged["async/seq_log_ratio_peak_max"] == pytest.approx(math.log(3))
    assert merged["async/seq_log_ratio_peak"] == pytest.approx((math.log(3) + math.log(2.5)) / 2)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_no_gradient_flows_through_the_weights_or_the_anchor(correction, level):
    """Each policy term's weight and the ratio's anchor are constants of the loss, even where every log-prob given
    carries a gradient: the policy's gradient is that of the same loss on detached copies of them (PPO's per-token
    loss, RLOO's per-completion one), and none reaches the sampling or start-of-update log-probs."""
    flags = corrections.CorrectionArgs(off_policy_correction=correction, is_cap=5.0)  # every weight non-zero

    def gradient(inputs_carry_gradient: bool):
        new = STEP.clone().requires_grad_()
        sampling, start = (x.clone().requires_grad_(inputs_carry_gradient) for x in (SAMPLING, START))
        made = corrections.off_policy_terms(new if inputs_carry_gradient else new.detach(), sampling, start, MASK,
                                            flags, sequence_level=level == "sequence")
        if level == "token":
            loss = ppo.policy_loss(new, made.anchor, ADVANTAGES, MASK, 0.2, 3.0, made.token_weights, made.clip)[0]
        else:
            new_seq, old_seq = common.masked_sum(new, made.kept), common.masked_sum(made.anchor, made.kept)
            loss = rloo.sequence_policy_loss(new_seq, old_seq, torch.tensor([-1.0]), 0.2, made.weights.flatten(),
                                             made.clip)[0]
        assert not made.weights.requires_grad and not made.anchor.requires_grad
        loss.backward()
        assert sampling.grad is None and start.grad is None
        return new.grad

    carried, constant = gradient(True), gradient(False)
    assert constant.abs().sum() > 0 and torch.allclose(carried, constant), (carried, constant)


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_a_micro_batch_with_no_real_token_counts_for_nothing(correction):
    """--mask_truncated_completions can leave a whole micro-batch out: its terms weigh nothing, and the update's
    diagnostics are those of the other micro-batches (all neutral when none has a token)."""
    flags = corrections.CorrectionArgs(off_policy_correction=correction)
    empty = corrections.off_policy_terms(STEP, SAMPLING, START, torch.zeros_like(MASK), flags, False)
    assert empty.token_weights.sum() == 0
    full = terms(correction).diagnostics
    assert corrections.merge_diagnostics([empty.diagnostics, full]) == corrections.merge_diagnostics([full])
    alone = corrections.merge_diagnostics([empty.diagnostics])
    assert alone["async/ess"] == 1 and alone["async/is_ratio_max"] == 1 and alone["async/mismatch_kl"] == 0
    assert alone["async/seq_log_ratio_peak_max"] == 0


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_nothing_stale_every_correction_is_none(correction):
    """K = 0, one mini-batch: the sampling, start-of-update and step log-probs are the same."""
    fresh = SAMPLING.clone().requires_grad_()
    made = corrections.off_policy_terms(
        fresh, SAMPLING, SAMPLING, MASK, corrections.CorrectionArgs(off_policy_correction=correction), False)
    assert torch.equal(made.token_weights, MASK) and torch.equal(made.anchor, SAMPLING)
    diagnostics = corrections.merge_diagnostics([made.diagnostics])
    assert diagnostics["async/mismatch_kl"] == 0 and diagnostics["async/is_ratio_mean"] == 1
    assert diagnostics["async/is_ratio_max"] == 1 and diagnostics["async/is_truncated_frac"] == 0
    assert diagnostics["async/ess"] == 1
    assert diagnostics["async/seq_log_ratio_mean"] == diagnostics["async/seq_log_ratio_peak_max"] == 0
    loss = ppo.policy_loss(fresh, made.anchor, ADVANTAGES, MASK, 0.2, MASK.sum().item(), made.token_weights,
                           made.clip)[0]
    loss.backward()
    assert loss.item() == pytest.approx(-1 / 3) and fresh.grad[0].tolist() == pytest.approx([-1 / 3, -1 / 3, 1 / 3, 0])


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_in_a_synchronous_update_every_step_but_pure_is_and_m2po_is_nones(correction):
    """A synchronous script's trainer sampled the batch (start = sampling): at every later step of the update
    (here STEP), decoupled, tis and mask take the same ratio, weights and clip as none; pure_is (ratio 1) and
    m2po (no clip) do not, when an update takes several optimizer steps."""
    made = corrections.off_policy_terms(STEP, SAMPLING, SAMPLING, MASK,
                                        corrections.CorrectionArgs(off_policy_correction=correction), False)
    loss = ppo.policy_loss(STEP, made.anchor, ADVANTAGES, MASK, 0.2, 3.0, made.token_weights, made.clip)[0]
    assert (loss.item() == pytest.approx((-1.2 - 0.5 + 3.0) / 3)) == (correction not in ("pure_is", "m2po"))


def test_rloo_and_grpo_weight_their_terms_the_same_way():
    made = terms("tis", level="sequence")
    new_seq, old_seq = common.masked_sum(STEP, made.kept), common.masked_sum(made.anchor, made.kept)
    advantage = torch.tensor([1.0])
    # ratio exp(sum log 1.5 0.5 3 - sum log 1.2 0.8 2.5) = 2.25 / 2.4 = 0.9375: inside the clip; weight 2
    loss = rloo.sequence_policy_loss(new_seq, old_seq, advantage, 0.2, made.weights.flatten())[0]
    assert loss.item() == pytest.approx(-2.0 * 0.9375)
    args = grpo.Args(loss_type="bnpo")
    made = terms("tis")
    loss = grpo.policy_loss(STEP, made.anchor, ADVANTAGES[0, :1].repeat(1), MASK, args, 3.0, 4,
                            weights=made.token_weights)[0]
    # A = 1 on every token: -1.2 (clipped), -0.625, -1.2 (clipped at 1.2), weighted 1.2, 0.8, 2
    assert loss.item() == pytest.approx((1.2 * -1.2 + 0.8 * -0.625 + 2.0 * -1.2) / 3)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_on_fresh_samples_every_ratio_is_1_and_nothing_is_clipped(tmp_path, script):
    """Synchronous, one epoch of one mini-batch: every optimizer step starts from the weights that sampled its
    batch, so the ratios are 1 (to the float rounding of two forwards of different batch shapes)."""
    run_script(*QUICK, "--num_epochs", "1", "--total_episodes", "32", "--eval_every", "0",
               "--output_dir", tmp_path / "run", script=script)
    train = [m for m in read_metrics(tmp_path / "run") if "val/ratio" in m]
    assert len(train) == 2 and all(abs(m["val/ratio"] - 1) < 1e-5 and m["policy/clipfrac_avg"] == 0 for m in train)


# the first-update check's runs: K = 2 over 3 updates of 16 prompts, two epochs of one optimizer step each
FIRST_UPDATE_RUN = [*QUICK, "--total_episodes", "48", "--eval_every", "0", "--async_steps", "2", "--num_epochs", "2",
                    "--logprob_check_every", "1"]
UPDATE_METRICS = ("loss/policy_avg", "policy/clipfrac_avg", "policy/entropy_avg", "val/ratio")


def first_step(call: dict) -> bool:
    """Whether a recorded off_policy_terms call trained the weights of the start of the update (its first step)."""
    mask = call["mask"].float()
    return torch.allclose(call["step"] * mask, call["start"] * mask, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo_vllm.py", *(pytest.param(script, marks=pytest.mark.heavy)
                                                      for script in ("rloo_vllm.py", "ppo_vllm.py"))])
def test_on_the_first_update_of_a_stale_run_every_correction_is_none(tmp_path, script):
    """The first update of a K-stale run trains the weights that sampled its batch, as a synchronous update
    does: there every correction takes none's ratio, weights and clip (pure_is and m2po at the first optimizer
    step: they part from none at later steps by design), on the script's own inputs, and a run with decoupled
    trains as one with none. Updates 2 and 3, sampled by the starting weights, are stale: there the corrections
    part. PPO's KL penalty reads the sampling log-probs by default, those of the reference in all three updates
    (penalty 0), or with --kl_penalty_logprobs start the weights being trained (0 only in update 1)."""
    decoupled, none = tmp_path / "decoupled", tmp_path / "none"
    penalty = ["--kl_penalty_logprobs", "start"] if script == "ppo_vllm.py" else []
    run_script(script.removesuffix(".py"), *FIRST_UPDATE_RUN, "--off_policy_correction", "decoupled", *penalty,
               "--output_dir", decoupled, script="tests/run_with_every_correction.py")
    run_script(*FIRST_UPDATE_RUN, "--output_dir", none, script=script)
    by_run = [{m["update"]: m for m in read_metrics(out) if "loss/policy_avg" in m} for out in (decoupled, none)]
    assert [by_run[0][u]["async/staleness"] for u in (1, 2, 3)] == [0, 1, 2]
    for name in UPDATE_METRICS:
        assert by_run[0][1][name] == pytest.approx(by_run[1][1][name], rel=1e-4, abs=1e-6), name
    if script == "ppo_vllm.py":
        assert all(abs(by_run[1][u]["objective/non_score_reward"]) < 1e-6 for u in (1, 2, 3))  # measured ~1e-8
        assert abs(by_run[0][1]["objective/non_score_reward"]) < 1e-6
        assert all(abs(by_run[0][u]["objective/non_score_reward"]) > 1e-5 for u in (2, 3))  # measured 7e-4, 8e-5

    calls = torch.load(decoupled / "every_correction.pt")
    first = [call for call in calls if call["update"] == 1]
    assert len(first) >= 2 and {call["update"] for call in calls} == {1, 2, 3}
    for call in first:
        mask, made = call["mask"].float(), call["corrections"]
        none_terms = made["none"]
        for correction in CORRECTIONS:
            if correction in ("pure_is", "m2po") and not first_step(call):
                continue
            terms_made = made[correction]
            assert torch.allclose(terms_made["anchor"] * mask, none_terms["anchor"] * mask, atol=1e-4), correction
            assert torch.allclose(terms_made["token_weights"] * mask, mask, atol=1e-4), correction
    assert any(map(first_step, first)) and not all(map(first_step, first))  # the second epoch: moved weights
    for update in (2, 3):  # stale: the start of the update is not the sampling weights
        stale = [call for call in calls if call["update"] == update]
        assert all((call["corrections"]["decoupled"]["anchor"] - call["sampling"]).mul(call["mask"]).abs().max() > 1e-3
                   for call in stale)
