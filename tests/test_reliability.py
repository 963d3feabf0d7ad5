"""Reliability across the scripts: bad input, a non-finite reward mid-run, faults of the vLLM side,
and the distributed helpers on two real ranks."""

import json
import shutil
import subprocess
import sys

import pytest
from scripts import (
    QUICK,
    ROOT,
    assert_same_weights_and_metrics,
    load_policy_weights,
    read_metrics,
    run_script,
)

import toy

SCRIPTS = ("online_dpo.py", "online_dpo_vllm.py", "ppo.py", "rloo.py", "bok.py")
NEEDS_PAIRS = {"online_dpo.py", "online_dpo_vllm.py", "rloo.py", "bok.py"}  # k >= 2 completions per prompt
HAS_LOSS_TYPE = {"online_dpo.py", "online_dpo_vllm.py"}


@pytest.fixture(scope="module")
def bad_artefacts(tmp_path_factory):
    """A dataset with an empty train split, a policy whose tokenizer has no pad token, and a
    reward model with a two-label head, all saved the way a user's would be."""
    import datasets
    from transformers import AutoConfig, AutoTokenizer

    toy.build()
    folder = tmp_path_factory.mktemp("bad")
    validation = datasets.load_from_disk(toy.DATASET)["validation"]
    empty_train = validation.select([])
    datasets.DatasetDict({"train": empty_train, "validation": validation}).save_to_disk(folder / "empty_dataset")
    shutil.copytree(toy.SFT_POLICY, folder / "no_pad_policy")
    tokenizer = AutoTokenizer.from_pretrained(toy.SFT_POLICY)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder / "no_pad_policy")
    shutil.copytree(toy.REWARD_MODEL, folder / "two_label_rm")
    config = AutoConfig.from_pretrained(toy.REWARD_MODEL)
    config.num_labels = 2
    config.save_pretrained(folder / "two_label_rm")
    return folder


def bad_input_cases(script, folder):
    """(flags, what the one-line error must say) for every bad input that applies to `script`."""
    cases = [
        (["--prompt_column", "nope"], "has no column 'nope'"),
        (["--dataset_name", folder / "empty_dataset"], "split 'train' is empty"),
        (["--max_prompt_length", "1"], "longer than max_prompt_length=1"),
        (["--model_name_or_path", "/nonexistent/model"], "'/nonexistent/model' does not exist"),
        (["--model_name_or_path", folder / "no_pad_policy"], "has no pad token"),
        (["--reward_model_path", folder / "two_label_rm"], "has 2 labels; a reward model has exactly 1"),
        (["--total_episodes", "100"], "--total_episodes 100 is not a multiple of the batch size 16"),
        (["--response_length", "0"], "--response_length must be positive, got 0"),
        (["--response_length", "-3"], "--response_length must be positive, got -3"),
        (["--preset", "tldr-7b"], "--preset 'tldr-7b' is not one of this script's presets"),
        (["--learning_rate", "fast"], "Error parsing --learning_rate"),
    ]
    if script in NEEDS_PAIRS:
        cases.append((["--num_samples", "1"], "--num_samples must be at least 2"))
    if script in HAS_LOSS_TYPE:
        cases.append((["--loss_type", "hinge"], "invalid choice 'hinge' for argument '--loss_type'"))
    if script == "online_dpo_vllm.py":
        cases.append((["--logprob_check_rows", "0"], "--logprob_check_rows must be at least 1"))
        cases.append((["--generator_timeout", "0"], "--generator_timeout must be positive (seconds), got 0.0"))
    return cases


# Runs every case of one script in one process (the imports are the slow part): main() raises
# SystemExit with the message exactly as it would on the command line.
RUN_CASES = """
import json, sys
sys.path.insert(0, ".")
import common, importlib
module = importlib.import_module(sys.argv[1])
results = []
for argv in json.loads(sys.argv[2]):
    sys.argv = [module.__file__, *argv]
    try:
        module.main(common.cli(module.Args, module.PRESETS))
        results.append("finished without an error")
    except SystemExit as stop:
        results.append(str(stop.code))
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_gives_a_one_line_error_and_leaves_nothing(tmp_path, bad_artefacts, script):
    cases = bad_input_cases(script, bad_artefacts)
    argvs = [[*QUICK, *map(str, flags), "--output_dir", str(tmp_path / f"case{i}")]
             for i, (flags, _) in enumerate(cases)]
    result = subprocess.run([sys.executable, "-c", RUN_CASES, script.removesuffix(".py"), json.dumps(argvs)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    messages = json.loads(result.stdout.split("RESULTS ")[-1])
    for i, ((flags, expected), message) in enumerate(zip(cases, messages)):
        assert message.startswith("error: ") and "\n" not in message, (flags, message)
        assert expected in message, (flags, message)
        assert not (tmp_path / f"case{i}").exists(), f"{flags} left output behind"


# Runs a script with the reward model's scores made NaN at the third rollout.
NAN_AT_UPDATE_3 = """
import runpy, sys
sys.path.insert(0, ".")
import common
score_rollout, calls = common.score_rollout, []
def nan_at_third_rollout(*args, **kwargs):
    rollout = score_rollout(*args, **kwargs)
    calls.append(1)
    if len(calls) == 3:
        rollout.scores[1] = float("nan")
    return rollout
common.score_rollout = nan_at_third_rollout
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_non_finite_reward_stops_with_the_update_and_keeps_the_last_checkpoint(tmp_path, script):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", NAN_AT_UPDATE_3, script, *QUICK, "--total_episodes", "64",
                             "--eval_every", "100", "--save_every", "2", "--output_dir", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    completions = 16 if script == "ppo.py" else 32  # 16 prompts, 1 or 2 completions each
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: update 3: the reward model returned NaN or infinite scores for 1 of {completions} completions; "
        "stopped, the last complete checkpoint is kept")
    assert (out / "checkpoints" / "update-2").is_dir() and not (out / "policy").exists()
    assert [m["update"] for m in read_metrics(out) if "loss/policy_avg" in m] == [1, 2]


TWO_RANKS = ("deepspeed", "--num_gpus", "2", "--master_port")


@pytest.mark.parametrize(("script", "zero_stage"), [
    (script, stage) for script in SCRIPTS for stage in (2, 3)
    if (script, stage) != ("online_dpo_vllm.py", 2)])  # that one is test_online_dpo_vllm's two-rank run
def test_two_ranks_under_the_deepspeed_launcher(tmp_path, script, zero_stage):
    """Two ranks of 16 prompts each. With ZeRO-3 the run also checkpoints at update 2 and a copy of it
    resumes from that checkpoint on two ranks (the state of a run killed right after the checkpoint:
    only the latest checkpoint is kept), ending with the same weights and metrics, bit for bit."""
    out = tmp_path / "run"
    port = 29600 + 10 * SCRIPTS.index(script) + zero_stage
    updates = 3 if zero_stage == 3 else 2
    args = [*QUICK, "--total_episodes", 32 * updates, "--eval_every", "1", "--save_every", "2",
            "--zero_stage", zero_stage]
    launcher, env = (*TWO_RANKS, str(port)), {"OMP_NUM_THREADS": "1"}
    run_script(*args, "--output_dir", out, script=script, launcher=launcher, env=env)
    metrics = read_metrics(out)
    # 16 prompts per rank per update, counted over both ranks
    assert [m["episode"] for m in metrics if "loss/policy_avg" in m] == [32 * (u + 1) for u in range(updates)]
    assert [m["update"] for m in metrics if "eval/gold_win_rate" in m] == list(range(updates + 1))
    assert load_policy_weights(out)  # gathered from both ranks, loads with from_pretrained
    if zero_stage == 3:
        resumed = tmp_path / "resumed"
        shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("policy", "wandb"))
        assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["update-2"]
        run_script(*args, "--output_dir", resumed, "--resume", script=script, launcher=launcher, env=env)
        assert_same_weights_and_metrics(out, resumed, ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"])


# The distributed helpers on two real ranks (gloo): what every script relies on for its metrics and data.
TWO_RANK_HELPERS = """
import sys
sys.path.insert(0, ".")
import torch, common
rank, world_size = common.init_distributed()
assert world_size == 2
assert common.all_reduce_mean({"a": float(rank), "b": 10.0 * rank}) == {"a": 0.5, "b": 5.0}
indices = [common.PromptSampler(100, 8, rank, world_size, seed=1).next_indices() for _ in range(1)][0]
everyone = [None, None]
torch.distributed.all_gather_object(everyone, indices)
assert len(set(everyone[0]) | set(everyone[1])) == 16, everyone  # disjoint shares of one global batch
scores = torch.tensor([1.0, float("nan") if rank == 1 else 2.0])
try:
    common.check_rewards(scores, update=7)
    raise AssertionError("a NaN on rank 1 did not stop rank 0")
except SystemExit as stop:  # every rank stops, not only the one that saw the NaN
    assert "update 7" in str(stop.code) and "for 1 of 4 completions" in str(stop.code)
print(f"rank {rank} ok")
"""


def test_metrics_and_data_across_two_real_ranks(tmp_path):
    check = tmp_path / "two_rank_check.py"
    check.write_text(TWO_RANK_HELPERS)
    result = run_script(check, script="", launcher=("torchrun", "--nproc_per_node", "2", "--master_port", "29699"),
                        env={"OMP_NUM_THREADS": "1"})
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout
