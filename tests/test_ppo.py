"""ppo.py: GAE, whitening and the clipped losses on hand-made numbers, and the script end to end."""

import math

import pytest
import torch
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

import common
import ppo


def reference_gae(rewards, values, lengths, gamma, lam):
    """A plain loop over each response's real tokens: the episode ends at its last real token."""
    advantages = torch.zeros_like(rewards)
    for row, length in enumerate(lengths):
        running = 0.0
        for t in reversed(range(length)):
            next_value = values[row, t + 1].item() if t + 1 < length else 0.0
            delta = rewards[row, t].item() + gamma * next_value - values[row, t].item()
            running = delta + gamma * lam * running
            advantages[row, t] = running
    return advantages


def test_gae_on_hand_computed_numbers_ignores_padding():
    rewards = torch.tensor([[0.0, 1.0, 7.0], [2.0, 5.0, 5.0]])  # the 7 and the 5s sit on pads
    values = torch.tensor([[0.5, 0.2, 9.0], [1.0, 9.0, 9.0]])
    mask = common.response_mask(torch.tensor([2, 1]), 3)
    advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 0: A1 = 1 - 0.2 = 0.8; A0 = (0 + 0.2 - 0.5) + 0.95 * 0.8 = 0.46.  row 1: A0 = 2 - 1 = 1
    torch.testing.assert_close(advantages, torch.tensor([[0.46, 0.8, 0.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.96, 1.0, 0.0], [2.0, 0.0, 0.0]]))


def test_gae_matches_a_plain_loop_with_padding():
    torch.manual_seed(0)
    lengths = torch.tensor([6, 3, 1, 5])
    rewards, values = torch.randn(4, 6), torch.randn(4, 6)
    mask = common.response_mask(lengths, 6)
    for gamma, lam in [(1.0, 0.95), (0.9, 0.5)]:
        advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma, lam)
        expected = reference_gae(rewards, values, lengths.tolist(), gamma, lam)
        assert torch.allclose(advantages, expected, atol=1e-6)
        assert torch.allclose(returns, (expected + values) * mask, atol=1e-6)


def test_masked_whitening(one_rank_group):
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, unbiased variance 1 over the three real entries; the pad is ignored and zeroed
    torch.testing.assert_close(ppo.masked_whiten(values, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(ppo.masked_whiten(values, mask, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


def test_clipped_policy_loss_on_hand_computed_numbers():
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5), 3.0]])  # the last is a pad
    advantages = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # this micro-batch's share of the step's tokens: 4 (its 3 and another micro-batch's 5, over 2)
    loss, clipfrac, ratio = ppo.policy_loss(new, old, advantages, mask, cliprange=0.2, step_tokens=4.0)
    # per token max(-A r, -A clip(r)): max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; max(0.5, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 4)
    assert clipfrac.item() == pytest.approx(2 / 3)
    assert ratio[0, :3].tolist() == pytest.approx([1.5, 0.5, 0.5])


def test_clipped_value_loss_on_hand_computed_numbers():
    old, new = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.5, 1.1, 4.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipfrac = ppo.value_loss(new, old, returns, mask, cliprange_value=0.2, step_tokens=3.0)
    # token 0: max((1.5-2)^2, (1.2-2)^2) = 0.64 (clipped); token 1: max(1.21, 1.21) = 1.21
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21) / 3)
    assert clipfrac.item() == pytest.approx(0.5)


def test_explained_variance_on_hand_computed_numbers():
    """Over the real tokens only (the pad holds a value far off): returns 2, 0, 4 (variance 4), residuals 1, 0, 1
    (variance 1/3): 1 - 1/12; predictions equal to the returns explain all; returns that do not vary, NaN."""
    import ppo_vllm

    returns, values = torch.tensor([[2.0, 0.0], [4.0, 50.0]]), torch.tensor([[1.0, 0.0], [3.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for script in (ppo, ppo_vllm):  # the twins' copies
        assert script.explained_variance(values, returns, mask) == pytest.approx(11 / 12)
        assert script.explained_variance(returns, returns, mask) == 1
        assert math.isnan(script.explained_variance(values, torch.ones_like(returns), mask))


def test_score_lands_on_the_last_real_token_with_and_without_eos():
    eos, pad = 1, 0
    responses, lengths, _ = common.truncate_after_eos(torch.tensor([[5, 1, 6, 7], [5, 6, 7, 8]]), [eos], pad)
    mask = common.response_mask(lengths, 4).float()
    logprobs = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]]).masked_fill(~mask.bool(), 1.0)
    ref_logprobs = torch.tensor([[-2.0, -2.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -3.0]]).masked_fill(~mask.bool(), 1.0)
    rewards = ppo.token_rewards(logprobs, ref_logprobs, torch.tensor([10.0, -1.0]), lengths, mask, kl_coef=0.5)
    # row 0 stops at its EOS (index 1): score there, nothing on the pads; row 1 never stops: score at the end
    torch.testing.assert_close(rewards, torch.tensor([[-0.5, 10.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0 - 1.0]]))


def test_logs_every_metric_and_saves_the_policy_alone(tmp_path):
    """3 updates of 16 prompts, evaluated at the start and the end (the learning run is the whole suite's)."""
    run = tmp_path / "run"
    run_script(*QUICK, "--total_episodes", "48", "--eval_every", "3", "--lr_scheduler_type", "constant",
               "--output_dir", run, script="ppo.py")
    metrics = read_metrics(run)
    train = [m for m in metrics if "loss/policy_avg" in m]
    assert [m["update"] for m in train] == [1, 2, 3]
    assert [m["update"] for m in metrics if "eval/gold_win_rate" in m] == [0, 3]
    for name in ("policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
                 "loss/value_avg", "val/clipfrac_avg", "val/explained_variance", "val/ratio", "val/ratio_var",
                 "objective/scores", "objective/kl", "objective/entropy", "objective/non_score_reward",
                 "objective/rlhf_reward", "val/num_eos_tokens", "lr", "episode", "eps"):
        assert all(math.isfinite(m[name]) for m in train), name
    # the first of 4 epochs is on-policy, so ratios start at 1 and move only a little
    assert 0.8 < train[0]["val/ratio"] < 1.2 and train[0]["val/ratio_var"] > 0
    assert train[0]["objective/kl"] == pytest.approx(0, abs=1e-4)
    assert all(m["val/explained_variance"] <= 1 for m in train)
    assert [m["lr"] for m in train] == [3e-5] * 3  # --lr_scheduler_type constant (online_dpo's test: linear decay)
    assert_trained_policy_saved(run)  # the policy alone: a value head would be an unexpected key


@pytest.mark.slow
def test_the_short_toy_run_learns_and_resumes_after_a_kill_while_checkpointing_exactly(tmp_path):
    whole, resumed = uninterrupted_and_resumed_runs(tmp_path, "ppo.py", toy_run("ppo.py"), SHORT_INTERRUPTIONS)
    assert_learns(whole)
    assert_same_weights_and_metrics(whole, resumed, ["loss/policy_avg", "loss/value_avg", "objective/scores",
                                                     "eval/gold_win_rate"])


@pytest.mark.slow
def test_value_model_needs_the_policy_vocabulary(tmp_path, tiny_dir):
    out = tmp_path / "run"
    result = run_script(*QUICK, "--reward_model_path", tiny_dir / "reward", "--output_dir", out, script="ppo.py",
                        check=False)
    assert result.returncode != 0 and "must share the policy's vocabulary" in result.stderr.strip().splitlines()[-1]
    assert not out.exists()
