"""Every synchronous script on a researcher's own inputs (tests/own_inputs.py): policies of four
architectures, encoder and decoder reward models, a reward function, prompt-only chat data. Each
case trains 2 updates, evaluates, and saves a policy that loads; the vLLM script's runs are in
test_own_inputs_vllm.py (its own file, so that the two run on different workers)."""

import json

import pytest
from own_inputs import build, case_argv, cases
from scripts import assert_trained_policy_saved, read_metrics, run_script

SYNC_SCRIPTS = ["online_dpo.py", "ppo.py", "rloo.py", "bok.py"]


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    return build(tmp_path_factory.mktemp("own_inputs"))


def check_case(case: dict, out):
    metrics = read_metrics(out)
    train = [m for m in metrics if "loss/policy_avg" in m]
    evals = [m for m in metrics if "eval/kl" in m]
    assert [m["update"] for m in train] == [1, 2] and [m["update"] for m in evals] == [0, 1, 2]
    gold = {"eval/gold_win_rate", "eval/gold_score"}
    for m in evals:
        assert {"eval/proxy_score", "eval/kl", *case["eval"]} <= m.keys() and not (gold - set(case["eval"])) & m.keys()
    assert_trained_policy_saved(out, case["policy"])
    recorded = json.loads((out / "args.json").read_text())
    assert recorded["args"]["model_name_or_path"] == case["policy"] and recorded["versions"]["torch"]
    return train, evals


@pytest.mark.parametrize("script", SYNC_SCRIPTS)
def test_every_case_trains_evaluates_and_saves(tmp_path, artefacts, script):
    own = cases(artefacts)
    argvs = [case_argv(script, case, tmp_path / f"case{i}") for i, case in enumerate(own.values())]
    result = run_script(script.removesuffix(".py"), json.dumps(argvs), script="tests/run_in_one_process.py")
    outcomes = json.loads(result.stdout.split("RESULTS ")[-1])
    assert outcomes == ["finished without an error"] * len(own), dict(zip(own, outcomes))
    for i, (name, case) in enumerate(own.items()):
        train, evals = check_case(case, tmp_path / f"case{i}")
        if "reward function" in name:  # the function's 0/1, or the -1 penalty: a mean over 8 prompts
            assert all(round(8 * m["eval/proxy_score"], 6).is_integer() for m in evals), evals
