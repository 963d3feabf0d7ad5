"""online_dpo_vllm.py on a researcher's own inputs (the cases of tests/own_inputs.py, as in
test_own_inputs.py): the engine samples from each policy architecture, and after every weight sync
its log-probs match the trainer's (async/logprob_diff)."""

import pytest
from own_inputs import build, case_argv, cases
from scripts import run_script
from test_own_inputs import check_case
from weight_sync_check import ENGINE_ENVIRONMENT


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    return build(tmp_path_factory.mktemp("own_inputs"))


@pytest.mark.parametrize("case", range(5))
def test_every_case_trains_evaluates_and_saves(tmp_path, artefacts, case):
    name, spec = list(cases(artefacts).items())[case]
    out = tmp_path / "run"
    run_script(*case_argv("online_dpo_vllm.py", spec, out), "--logprob_check_every", "1", script="online_dpo_vllm.py")
    train, _ = check_case(spec, out)
    assert [m["async/staleness"] for m in train] == [0, 1], name
    assert all(m["async/logprob_diff"] < 1e-3 for m in train), (name, [m["async/logprob_diff"] for m in train])


@pytest.mark.parametrize("policy", ["qwen2", "gpt_neox", "gpt2"])  # Llama: test_online_dpo_vllm.py, on the toy
def test_engine_greedy_equals_hf_greedy_after_weight_sync(artefacts, policy):
    result = run_script(artefacts[policy], artefacts["prompts_jsonl"], "prompt", "train",
                        script="tests/weight_sync_check.py", env=ENGINE_ENVIRONMENT, timeout=600)
    assert "greedy completions equal after weight sync" in result.stdout
