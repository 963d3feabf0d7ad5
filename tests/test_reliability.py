"""Reliability across the scripts: bad input, and a non-finite reward mid-run (the faults of the
vLLM side are in test_online_dpo_vllm.py, two ranks in test_two_ranks.py)."""

import json
import shutil

import pytest
from scripts import QUICK, SCRIPTS, assert_trained_policy_saved, free_port, read_metrics, run_script

import toy

# k >= 2 per prompt
NEEDS_PAIRS = {"online_dpo.py", "online_dpo_vllm.py", "rloo.py", "bok.py", "rloo_vllm.py", "grpo.py", "grpo_vllm.py"}
# a fault mid-run goes through the same common code in every loop (common.check_rewards, the reward's call): one
# script of each kind, synchronous (k completions a prompt, and PPO's one) and vLLM (each run starts an engine)
MID_RUN = ("online_dpo.py", "online_dpo_vllm.py", "ppo.py")
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
    (folder / "prompts.jsonl").write_text('{"query": "a prompt of the user"}\n')
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
        (["--eval_every", "-1"], "--eval_every must be 0 (no evaluation) or positive, got -1"),
        (["--reward_fn", "tests/missing.py:score"], "--reward_fn 'tests/missing.py:score': no file 'tests/missing.py'"),
        (["--reward_fn", "no_such_module:score"], "cannot import module 'no_such_module'"),
        (["--reward_fn", "tests/reward_fns.py:nothing"], "'tests/reward_fns.py' has no function 'nothing'"),
        (["--dataset_name", folder / "prompts.jsonl", "--gold_model_path", "toy"],
         "--gold_model_path toy scores the embedded toy task only"),
        (["--use_peft", "--lora_target_modules", "q_proj", "qkv"], "--lora_target_modules 'qkv' names no layer of"),
        (["--use_peft", "--lora_r", "0"], "--lora_r must be positive, got 0"),
        (["--use_peft", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1), got 1.0"),
        (["--save_merged"], "--save_merged merges a LoRA adapter into the saved policy: it needs --use_peft"),
    ]
    if script in NEEDS_PAIRS:
        cases.append((["--num_samples", "1"], "--num_samples must be at least 2"))
    if script in HAS_LOSS_TYPE:
        cases.append((["--loss_type", "hinge"], "invalid choice 'hinge' for argument '--loss_type'"))
    if script.startswith("grpo"):
        cases += [
            (["--loss_type", "cispo"],
             "--loss_type cispo caps the ratio itself at --epsilon_high, which must be above 1"),
            (["--loss_type", "ppo"], "invalid choice 'ppo' for argument '--loss_type'"),
            (["--epsilon", "1.5"], "--epsilon must be in (0, 1)"),
            (["--epsilon_high", "0"], "--epsilon_high must be positive"),
            (["--delta", "1.1"],
             "--delta caps the unclipped ratio above its clip, so it must exceed 1 + epsilon_high = 1.2"),
            (["--beta", "-0.1"], "--beta must be 0 or positive, got -0.1"),
            (["--soft_punish_cache", "12"], "--soft_punish_cache 12 must be below --response_length 12"),
        ]
    if script.startswith(("rloo", "ppo", "grpo")):
        cases.append((["--is_cap", "0"], "--is_cap must be positive (an importance weight's upper bound), got 0.0"))
        cases.append((["--off_policy_correction", "mask", "--is_mask_low", "5"],
                      "--is_mask_low 5.0 must be at least 0 and below --is_cap 5"))
        cases.append((["--off_policy_correction", "m2po", "--m2_threshold", "0"],
                      "--m2_threshold must be positive (a mean squared log-ratio), got 0.0"))
        cases.append((["--decoupled_weight_cap", "5"],
                      "--decoupled_weight_cap is now --off_policy_correction pure_is --is_cap 5"))
    if script.startswith(("online_dpo", "bok")):  # no policy ratio, no correction
        cases.append((["--off_policy_correction", "tis"], "Unrecognized options: --off_policy_correction"))
    if script.endswith("_vllm.py"):
        cases.append((["--logprob_check_rows", "0"], "--logprob_check_rows must be at least 1"))
        cases.append((["--logprob_check_every", "0"], "--logprob_check_every must be at least 1 (1: every batch)"))
        cases.append((["--max_logprob_diff", "-1"], "--max_logprob_diff must be positive, got -1.0"))
        cases.append((["--generator_timeout", "0"], "--generator_timeout must be positive (seconds), got 0.0"))
        cases.append((["--vllm_engines_per_node", "2"],
                      "--vllm_engines_per_node 2 does not divide the 1 training ranks of a node into equal shares"))
        cases.append((["--vllm_gpu_memory_utilization", "80"],
                      "--vllm_gpu_memory_utilization is a share of the GPU's memory, in (0, 1], got 80.0"))
        cases.append((["--inflight_updates", "--max_lag", "0"],
                      "--max_lag must be at least --async_steps 1 (the newest groups of a batch are that many versions "
                      "behind), got 0"))
        cases.append((["--max_lag", "3"], "--max_lag applies to --inflight_updates, which is off"))
        cases.append((["--inflight_deterministic"],
                      "--inflight_deterministic applies to --inflight_updates, which is off"))
        cases.append((["--inflight_batches", "2"], "--inflight_batches applies to --inflight_updates, which is off"))
        cases.append((["--inflight_updates", "--inflight_batches", "0"],
                      "--inflight_batches must be at least 1 (a batch's worth of groups), got 0"))
        cases.append((["--inflight_updates", "--vllm_device", "shared"],
                      "--inflight_updates needs an engine that samples while the trainer trains: not --vllm_device"))
    if script == "grpo_vllm.py":
        cases.append((["--inflight_updates", "--dynamic_sampling"],
                      "--inflight_updates does not combine with --dynamic_sampling: turn one off"))
    return cases


# the fast tier checks the errors of the script with the most kinds of flag (the data, the model, the reward, LoRA,
# GRPO's, the corrections' and the engine's); the whole suite every script's
FAST_BAD_INPUT = ("grpo_vllm.py",)


@pytest.mark.parametrize("script", [script if script in FAST_BAD_INPUT else pytest.param(script, marks=pytest.mark.slow)
                                    for script in SCRIPTS])
def test_bad_input_gives_a_one_line_error_and_leaves_nothing(tmp_path, bad_artefacts, script):
    cases = bad_input_cases(script, bad_artefacts)
    argvs = [[*QUICK, *map(str, flags), "--output_dir", str(tmp_path / f"case{i}")]
             for i, (flags, _) in enumerate(cases)]
    result = run_script(script.removesuffix(".py"), json.dumps(argvs), script="tests/run_in_one_process.py",
                        timeout=600)
    messages = json.loads(result.stdout.split("RESULTS ")[-1])
    assert len(messages) == len(cases)
    for i, ((flags, expected), message) in enumerate(zip(cases, messages)):
        assert message.startswith("error: ") and "\n" not in message, (flags, message)
        assert expected in message, (flags, message)
        assert not (tmp_path / f"case{i}").exists(), f"{flags} left output behind"


@pytest.mark.slow
@pytest.mark.parametrize("script", MID_RUN)
def test_non_finite_reward_stops_with_the_update_and_keeps_the_last_checkpoint(tmp_path, script):
    out = tmp_path / "run"
    # no missing-EOS penalty: it would replace the NaN of a completion that did not stop
    result = run_script(script, *QUICK, "--total_episodes", "64", "--eval_every", "100", "--save_every", "2",
                        "--no_missing_eos_penalty", "--output_dir", out, script="tests/run_with_nan_reward.py",
                        check=False, timeout=600)
    assert result.returncode != 0
    completions = 16 if script.startswith("ppo") else 32  # 16 prompts, 1 or 2 completions each
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: update 3: the reward was NaN or infinite for 1 of {completions} completions; "
        "stopped, the last complete checkpoint is kept")
    assert (out / "checkpoints" / "update-2").is_dir() and not (out / "policy").exists()
    assert [m["update"] for m in read_metrics(out) if "loss/policy_avg" in m] == [1, 2]


# A reward function that fails mid-run: the run stops at the update, with the function's error on one line.
FAILING_REWARD_FUNCTIONS = {
    "raises": "update 1: --reward_fn tests/reward_fns.py:raises raised ValueError: a bug in the reward function",
    "one_score_short": "update 1: --reward_fn tests/reward_fns.py:one_score_short returned {short} scores for "
                       "{completions} completions",
    # (completions with no stop token get the finite missing-EOS penalty instead)
    "nan_scores": "update 1: the reward was NaN or infinite for ",
}


@pytest.mark.slow
@pytest.mark.parametrize("script", MID_RUN)
def test_a_failing_reward_function_stops_the_run_at_its_update(tmp_path, script):
    # the vLLM script: one case (its engine would start once per case); the failure is the same common code
    names = ["raises"] if script == "online_dpo_vllm.py" else list(FAILING_REWARD_FUNCTIONS)
    argvs = [[*QUICK, "--total_episodes", "32", "--eval_every", "0", "--reward_fn", f"tests/reward_fns.py:{name}",
              "--output_dir", str(tmp_path / name)] for name in names]
    result = run_script(script.removesuffix(".py"), json.dumps(argvs), script="tests/run_in_one_process.py")
    completions = 16 if script == "ppo.py" else 32
    expected = [FAILING_REWARD_FUNCTIONS[name].format(short=completions - 1, completions=completions)
                for name in names]
    messages = json.loads(result.stdout.split("RESULTS ")[-1])
    assert len(messages) == len(names)
    assert all(message.startswith(f"error: {start}") and "\n" not in message
               for message, start in zip(messages, expected)), messages
    assert not any((tmp_path / name / "policy").exists() for name in names)


@pytest.mark.slow
def test_a_resume_that_would_change_the_training_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    run_args = [*QUICK, "--total_episodes", "32", "--eval_every", "100", "--save_every", "1", "--output_dir", out]
    run_script(*run_args)  # 2 updates, checkpointed after each

    def files():
        return {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}

    before = files()
    # the chunks HF generate seeds its samples by are --local_rollout_forward_batch_size's
    changed = run_script(*run_args, "--resume", "--learning_rate", "0.001", "--total_episodes", "64",
                         "--local_rollout_forward_batch_size", "16", check=False)
    assert changed.returncode != 0 and changed.stderr.strip().splitlines()[-1] == (
        f"error: --resume: the run in {str(out)!r} was trained with other settings: --local_rollout_forward_batch_size "
        "32 -> 16; --learning_rate 0.0001 -> 0.001; --total_episodes 32 -> 64; resume with its own (its args.json) "
        "or start a new run")
    two_ranks = run_script(*run_args, "--resume", check=False, env={"OMP_NUM_THREADS": "1"},
                           launcher=("deepspeed", "--num_gpus", "2", "--master_port", str(free_port())))
    assert two_ranks.returncode != 0 and "was trained with other settings: ranks 1 -> 2;" in two_ranks.stderr
    assert files() == before
    # evaluation, checkpoint frequency, snapshots kept and logging may change; a bad --keep_snapshots stops first
    bad = run_script(*run_args, "--resume", "--keep_snapshots", "0", check=False)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == (
        "error: --keep_snapshots must be at least 1 (or left out to keep every snapshot), got 0")
    assert files() == before
    assert sorted(p.name for p in (out / "policies").iterdir()) == ["update-1", "update-2"]  # every one by default
    # accepted (each flag a resume may change, changed, trains the same: test_two_ranks.py), and a finished run
    # has nothing left to train: its policy stays as it was
    trained = (out / "policy" / "model.safetensors").read_bytes()
    run_script(*run_args, "--resume", "--eval_every", "1", "--save_every", "2", "--track", "--keep_snapshots", "1")
    assert (out / "policy" / "model.safetensors").read_bytes() == trained


@pytest.mark.slow
def test_a_checkpoint_or_policy_that_cannot_be_written_stops_the_run_and_the_last_checkpoint_stays_usable(tmp_path):
    out = tmp_path / "run"
    blocked = out / "checkpoints" / ".partial-update-2"  # where checkpoint 2 is written: a file, not a folder
    blocked.parent.mkdir(parents=True)
    blocked.write_text("in the way")
    run_args = [*QUICK, "--total_episodes", "48", "--eval_every", "100", "--save_every", "1", "--output_dir", out]
    result = run_script(*run_args, "--resume", check=False)  # no complete checkpoint yet: starts from update 0
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and error.startswith(
        f"error: writing {str(out / 'checkpoints' / 'update-2')!r} failed (FileExistsError: "), error
    assert error.endswith("the last complete checkpoint is kept, --resume continues from it")
    assert (out / "checkpoints" / "update-1").is_dir() and not (out / "policy").exists()
    blocked.unlink()
    blocked = out / ".partial-policy"  # where the policy is written
    blocked.write_text("in the way")
    result = run_script(*run_args, "--resume", check=False)  # carries on from checkpoint 1
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and error.startswith(f"error: writing {str(out / 'policy')!r} failed "), error
    assert (out / "checkpoints" / "update-3").is_dir() and not (out / "policy").exists()
    blocked.unlink()
    run_script(*run_args, "--resume")  # nothing left to train: writes the policy
    assert [m["update"] for m in read_metrics(out) if "loss/policy_avg" in m] == [1, 2, 3]
    assert_trained_policy_saved(out)
