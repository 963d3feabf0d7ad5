"""The presets, configs/<script>/<name>.yaml: each parses through its script's flags, its batch arithmetic
divides, it names the paper's artefacts, and the README lists exactly the files with their launch commands."""

import json
import os
import re
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from scripts import ROOT

import bok
import cli
import common
import eval_checkpoints
import grpo
import grpo_multiturn
import grpo_vllm
import online_dpo
import online_dpo_vllm
import outputs
import ppo
import ppo_vllm
import reward_model
import rloo
import rloo_vllm
import sft
import vllm_placement

SCRIPTS = {"online_dpo.py": online_dpo, "online_dpo_vllm.py": online_dpo_vllm, "ppo.py": ppo, "rloo.py": rloo,
           "rloo_vllm.py": rloo_vllm, "ppo_vllm.py": ppo_vllm,
           "bok.py": bok, "grpo.py": grpo, "grpo_vllm.py": grpo_vllm}
ALL_PRESETS = [(script, name) for script, module in SCRIPTS.items() for name in cli.presets(module.Args)]
TLDR_PRESETS = [(script, name) for script, name in ALL_PRESETS if name.startswith("tldr-")]
GSM8K_PRESETS = [(script, name) for script, name in ALL_PRESETS
                 if name.startswith("gsm8k-") and script != "grpo.py"]  # the reference's math runs
PIPELINE_SCRIPTS = {"sft.py": sft, "reward_model.py": reward_model}
PIPELINE_PRESETS = [(script, name) for script, module in PIPELINE_SCRIPTS.items()
                    for name in cli.presets(module.Args)]
EVERY_SCRIPT = {**SCRIPTS, **PIPELINE_SCRIPTS}


def parse(module, *argv):
    """The command line as the script's `__main__` parses it (eval_checkpoints.py: the run's fields)."""
    with mock.patch.object(sys, "argv", ["script.py", *argv]):
        return cli.parse(module.Args, getattr(module, "RUN_FIELDS", ()))


def parsed_and_flags(module, *argv) -> tuple:
    """parse's Args, and every flag by its command-line name (its groups' too) as attributes."""
    args = parse(module, *argv)
    return args, SimpleNamespace(**cli.flag_values(args))


def launch_of(script: str, name: str) -> str:
    """The preset file's launch command: its comment line `# launch: ...`."""
    with open(cli.presets(EVERY_SCRIPT[script].Args)[name]) as f:
        return next(line.removeprefix("# launch: ").strip() for line in f if line.startswith("# launch: "))


def test_the_paper_runs_are_all_there():
    def names(module):
        return sorted(cli.presets(module.Args))

    assert names(online_dpo) == sorted([*(f"tldr-{size}-{gpus}gpu" for size in ("410m", "1b", "2.8b")
                                          for gpus in (1, 4)), "gsm8k-rho1b-4gpu", "toy-math"])
    assert names(online_dpo_vllm) == sorted([*(f"tldr-{size}-async-4gpu" for size in ("410m", "1b", "2.8b")),
                                             "gsm8k-rho1b-async-4gpu", "toy-math", "chatbot-llama3.1-8b-async-8gpu",
                                             "chatbot-llama3.1-8b-sync-8gpu"])
    assert names(ppo) == names(rloo) == ["gsm8k-rho1b-1gpu", "tldr-410m-1gpu", "toy-math"]
    assert names(bok) == ["tldr-410m-1gpu", "toy-math"]
    assert names(grpo) == ["gsm8k-qwen2.5-0.5b-1gpu", "gsm8k-rho1b-1gpu", "toy-math"]
    assert names(grpo_vllm) == ["toy-math"]
    assert names(ppo_vllm) == names(rloo_vllm) == ["gsm8k-rho1b-1gpu", "tldr-410m-1gpu", "tldr-410m-async-4gpu",
                                                   "toy-math"]


def world_size_of(script: str, name: str) -> int:
    """The launch line's training ranks: deepspeed --num_gpus N, or one process."""
    match = re.search(r"--num_gpus (\d+)", launch_of(script, name))
    return int(match.group(1)) if match else 1


@pytest.mark.parametrize(("script", "name"), ALL_PRESETS + PIPELINE_PRESETS)
def test_a_preset_is_its_file_given_to_config(script, name):
    """Every key of the file is a flag of its script (config_flags refuses any other), and --preset NAME is
    --config configs/<script>/NAME.yaml."""
    module, path = EVERY_SCRIPT[script], cli.presets(EVERY_SCRIPT[script].Args)[name]
    assert {**cli.flag_values(parse(module, "--preset", name)), "preset": None} == {
        **cli.flag_values(parse(module, "--config", path)), "config": None}
    assert launch_of(script, name).split()[-3:] == [script, "--preset", name]


@pytest.mark.parametrize(("script", "name"), TLDR_PRESETS)
def test_preset_parses_divides_and_names_the_artefacts(script, name):
    parsed, args = parsed_and_flags(SCRIPTS[script], "--preset", name)
    assert args.preset == name
    size = re.match(r"tldr-(410m|1b|2\.8b)-", name).group(1)
    assert args.model_name_or_path == f"mnoukhov/pythia{size}-sft-tldr"
    assert args.reward_model_path == f"mnoukhov/pythia{size}-rm-tldr6.9b"
    assert args.gold_model_path == "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"
    assert args.dataset_name == "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
    assert (args.response_length, args.temperature, args.penalty_reward_value, args.learning_rate, args.bf16) == (
        53, 0.7, -1.0, 3e-6, True)
    world_size = world_size_of(script, name)
    local_batch_size, num_updates = common.batch_sizes(parsed.optimizer, world_size)
    assert num_updates == 256
    assert local_batch_size * world_size == (504 if "async-4gpu" in name else 512)
    if "async-4gpu" in name:
        assert world_size == 3 and args.async_steps == 1 and args.vllm_device is None  # the 4th GPU generates
    elif script.endswith("_vllm.py"):  # the reference's single-vLLM runs: the engine on the training GPU
        assert (world_size, args.vllm_device, args.vllm_gpu_memory_utilization) == (1, "shared", 0.3)


# The reference's math runs: (samples, temperature, top_p, KL or beta, learning rate, new tokens, epochs,
# missing-EOS penalty, prompts per update, updates)
GSM8K = {"online_dpo": (8, 0.7, 1.0, 0.1, 5e-6, 512, 1, False),
         "rloo": (8, 0.6, 0.9, 1e-4, 1e-6, 400, 2, True, 64, 256),
         "ppo": (1, 0.7, 1.0, 0.05, 3e-6, 512, 2, False, 256, 512)}


@pytest.mark.parametrize(("script", "name"), GSM8K_PRESETS)
def test_gsm8k_presets_carry_the_reference_settings(script, name):
    parsed, args = parsed_and_flags(SCRIPTS[script], "--preset", name)
    assert (args.model_name_or_path, args.dataset_name, args.eval_split) == (
        "realtreetune/rho-1b-sft-GSM8K", "openai/gsm8k:main", "test")
    assert args.prompt_template.format(question="Q?") == "[MATH_TASK] Problem:\nQ?\n\nSolution:"
    assert (args.reward_fn, args.answer_column, args.bf16) == ("math_reward:gsm8k_reward", "answer", True)
    algorithm = script.removesuffix(".py").removesuffix("_vllm")
    expected = GSM8K[algorithm]
    samples = 1 if algorithm == "ppo" else args.num_samples
    coefficient = args.beta if algorithm == "online_dpo" else args.kl_coef
    assert (samples, args.temperature, args.top_p, coefficient, args.learning_rate, args.response_length,
            args.num_epochs, args.missing_eos_penalty) == expected[:8]
    local_batch_size, num_updates = common.batch_sizes(parsed.optimizer, world_size_of(script, name))
    batch_size = local_batch_size * world_size_of(script, name)
    if algorithm == "online_dpo":  # 8 x 6 prompts per device and 73,728 episodes, on 4 or 3 training GPUs
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 6)
        assert batch_size * num_updates == 73728
    else:
        assert (batch_size, num_updates) == expected[8:]
    if script.endswith("_vllm.py") and algorithm != "online_dpo":  # vLLM on the training GPU
        assert (args.vllm_device, args.async_steps) == ("shared", 0)


def test_grpo_gsm8k_presets_are_the_papers_math_setting_and_verls_qwen_baseline():
    rho_args, rho = parsed_and_flags(grpo, "--preset", "gsm8k-rho1b-1gpu")
    assert (rho.model_name_or_path, rho.dataset_name, rho.reward_fn, rho.num_samples, rho.loss_type) == (
        "realtreetune/rho-1b-sft-GSM8K", "openai/gsm8k:main", "math_reward:gsm8k_reward", 8, "dapo")
    assert rho.prompt_template.format(question="Q?") == "[MATH_TASK] Problem:\nQ?\n\nSolution:"
    # RLOO's math run: 64 prompts x 8 samples, 256 updates
    assert common.batch_sizes(rho_args.optimizer, 1) == (64, 256)
    qwen_args, qwen = parsed_and_flags(grpo, "--preset", "gsm8k-qwen2.5-0.5b-1gpu")
    assert (qwen.model_name_or_path, qwen.chat_template, qwen.eval_split, qwen.answer_column) == (
        "Qwen/Qwen2.5-0.5B-Instruct", True, "test", "answer")
    assert qwen.prompt_template.format(question="Q?") == (
        'Q? Let\'s think step by step and output the final answer after "####".')
    assert common.batch_sizes(qwen_args.optimizer, 1) == (64, 116)


def test_toy_math_presets_run_the_arithmetic_task():
    import toy

    for module in SCRIPTS.values():
        parsed, args = parsed_and_flags(module, "--preset", "toy-math")
        assert (args.model_name_or_path, args.dataset_name, args.reward_fn) == (
            toy.MATH_POLICY, toy.MATH_DATASET, "math_reward:gsm8k_reward")
        assert not args.missing_eos_penalty and args.answer_column == "answer"
        common.batch_sizes(parsed.optimizer, 1)


@pytest.mark.parametrize("name", ["chatbot-llama3.1-8b-async-8gpu", "chatbot-llama3.1-8b-sync-8gpu"])
def test_the_chatbot_presets_are_the_papers_run_at_k1_and_k0(name):
    """The paper's third experiment: Llama 3.1 8B SFT on No Robots, online DPO, 7 training GPUs + the engine."""
    parsed, args = parsed_and_flags(online_dpo_vllm, "--preset", name)
    assert (args.model_name_or_path, args.dataset_name, args.prompt_column, args.chat_template) == (
        "allenai/open_instruct_dev", "HuggingFaceH4/no_robots", "prompt", True)
    assert (args.beta, args.learning_rate, args.temperature, args.response_length, args.penalty_reward_value) == (
        0.03, 8e-7, 0.7, 1024, -10.0)
    assert (args.zero_stage, args.bf16, args.async_steps) == (3, True, 1 if "async" in name else 0)
    local_batch_size, num_updates = common.batch_sizes(parsed.optimizer, world_size_of("online_dpo_vllm.py", name))
    assert (local_batch_size * 7, num_updates) == (224, 446)


def test_flags_override_a_preset():
    _, args = parsed_and_flags(online_dpo, "--preset", "tldr-1b-4gpu", "--learning_rate", "1e-5", "--seed", "7")
    assert (args.learning_rate, args.seed, args.model_name_or_path) == (1e-5, 7, "mnoukhov/pythia1b-sft-tldr")
    # no preset: the toy task
    assert parse(online_dpo).data.model_name_or_path == online_dpo.Args().data.model_name_or_path


@pytest.mark.parametrize("module", [online_dpo, grpo_vllm], ids=lambda module: module.__name__)
def test_a_misspelt_flag_is_a_one_line_error_naming_the_nearest(module):
    """A group's flag (--learning_rate is the optimizer group's) as the algorithm's own (--beta)."""
    for misspelt, meant in (("--learnin_rate", "--learning_rate"), ("--bta", "--beta")):
        with pytest.raises(SystemExit) as stop:
            parse(module, misspelt, "1e-5")
        assert f"Perhaps you meant: {meant} FLOAT" in str(stop.value.code) and "\n" not in str(stop.value.code)


def test_unknown_preset_is_a_one_line_error():
    with pytest.raises(SystemExit, match="--preset 'tldr-7b' is not one of this script's presets: gsm8k-rho1b-4gpu, "
                                         "tldr-1b-1gpu"):
        parse(online_dpo, "--preset", "tldr-7b")


def test_the_readme_lists_exactly_the_preset_files_with_their_launch_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for script, name in ALL_PRESETS + PIPELINE_PRESETS:
        assert f"`{launch_of(script, name)}`" in readme, (script, name)
    listed = set(re.findall(r"^\| `(?:python|deepspeed --num_gpus \d+) (\w+\.py) --preset ([\w.-]+)`", readme, re.M))
    assert listed == set(ALL_PRESETS + PIPELINE_PRESETS)


def test_toy_names_are_the_embedded_tasks_artefacts():
    import toy

    _, args = parsed_and_flags(rloo, "--model_name_or_path", "toy:math_policy", "--dataset_name",
                               "toy:math_dataset")
    assert (args.model_name_or_path, args.dataset_name) == (toy.MATH_POLICY, toy.MATH_DATASET)
    with pytest.raises(SystemExit, match=re.escape("--reward_model_path 'toy:gold' names no toy artefact; they are "
                                                   "toy:sft_policy, toy:reward_model")):
        parse(rloo, "--reward_model_path", "toy:gold")


@pytest.mark.parametrize(("script", "name"), PIPELINE_PRESETS)
def test_pipeline_presets_divide_and_name_the_artefacts(script, name):
    _, args = parsed_and_flags(PIPELINE_SCRIPTS[script], "--preset", name)
    size = re.match(r"tldr-(410m|1b|2\.8b)-", name).group(1)
    world_size = world_size_of(script, name)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    if script == "sft.py":  # the pretrained model, the TL;DR references, 128 examples a step
        assert (args.model_name_or_path, args.completion_column, per_step) == (
            f"EleutherAI/pythia-{size}-deduped", "reference_response", 128)
    else:  # the SFT policy, the preference pairs relabelled by the gold model, 64 pairs a step
        assert (args.model_name_or_path, args.relabel_with, per_step) == (
            f"mnoukhov/pythia{size}-sft-tldr", "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr", 64)
    assert args.prompt_column == "query" and args.learning_rate == 3e-6 and args.num_epochs == 1


@pytest.mark.parametrize("module", [*SCRIPTS.values(), grpo_multiturn, *PIPELINE_SCRIPTS.values(), eval_checkpoints],
                         ids=lambda module: module.__name__)
def test_every_script_takes_a_config_file(tmp_path, module):
    config = tmp_path / "run.yaml"
    config.write_text("seed: 7\ndataset_name: my/prompts\n")
    _, args = parsed_and_flags(module, "--config", str(config), "--seed", "9")
    assert (args.seed, args.dataset_name, args.config) == (9, "my/prompts", str(config))


def test_eval_checkpoints_takes_the_runs_evaluation_settings(tmp_path):
    recorded = cli.flag_values(parse(online_dpo, "--preset", "toy-math", "--response_length", "20",
                                     "--learning_rate", "1e-5"))
    (tmp_path / "args.json").write_text(json.dumps({"args": recorded, "ranks": 1, "versions": {}, "argv": []}))
    config = tmp_path / "eval.yaml"
    config.write_text("eval_num_prompts: 64\n")
    _, args = parsed_and_flags(eval_checkpoints, "--run_dir", str(tmp_path), "--config", str(config), "--seed",
                               "3")
    # the run's evaluation fields (not its training ones), then the file, then the flags
    assert (args.dataset_name, args.answer_column, args.reward_fn, args.response_length) == (
        recorded["dataset_name"], "answer", "math_reward:gsm8k_reward", 20)
    assert (args.eval_num_prompts, args.seed, args.run_dir) == (64, 3, str(tmp_path))


def test_eval_checkpoints_takes_the_engines_settings_not_where_it_runs(monkeypatch):
    """Its engine runs in its own process, on its own device: the vLLM scripts' engine settings under their
    names, none of their placement flags; by default the engine leaves the HF models 0.7 of a GPU."""
    kv_caches, started = [], []
    monkeypatch.setattr(vllm_placement, "shared_device_environment",
                        lambda kv_cache_gib: kv_caches.append(kv_cache_gib) or {})
    monkeypatch.setattr(vllm_placement, "start_vllm", lambda *args: started.append(args[-2:]))  # eager, GPU share
    eval_checkpoints.start_engine(parse(eval_checkpoints, "--vllm"))
    eval_checkpoints.start_engine(parse(eval_checkpoints, "--vllm", "--vllm_cpu_kv_cache_gib", "2",
                                        "--vllm_enforce_eager", "--vllm_gpu_memory_utilization", "0.5"))
    assert (kv_caches, started) == ([1, 2], [(False, 0.3), (True, 0.5)])
    for placement in ("--vllm_device", "--vllm_engines_per_node", "--vllm_cpu_threads"):
        with pytest.raises(SystemExit, match=f"Unrecognized options: {placement}"):
            parse(eval_checkpoints, placement, "1")


def test_a_config_file_sits_between_the_preset_and_the_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 3e-5  # YAML reads this as text: the flag's own parser makes it a float\n"
                      "seed: 7\nbf16: false\ntrack: true\ngold_model_path: null\nresponse_length: 20\n")
    _, args = parsed_and_flags(online_dpo, "--preset", "tldr-1b-4gpu", "--config", str(config), "--seed", "9")
    assert (args.model_name_or_path, args.learning_rate, args.bf16, args.track) == (
        "mnoukhov/pythia1b-sft-tldr", 3e-5, False, True)  # the preset's, then the file's
    assert (args.seed, args.response_length, args.gold_model_path, args.config) == (9, 20, None, str(config))
    # a file may name the preset itself; a --preset flag overrides it
    config.write_text("preset: tldr-410m-1gpu\nseed: 7\n")
    assert parse(online_dpo, "--config", str(config)).data.model_name_or_path == "mnoukhov/pythia410m-sft-tldr"
    assert parse(online_dpo, "--config", str(config), "--preset", "tldr-1b-1gpu").data.model_name_or_path == (
        "mnoukhov/pythia1b-sft-tldr")


def test_a_runs_args_json_is_a_config(tmp_path):
    recorded = cli.flag_values(parse(rloo_vllm, "--preset", "toy-math", "--learning_rate", "1e-5",
                                     "--vllm_device", "shared"))
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"args": recorded, "ranks": 1, "versions": {}, "argv": []}))
    again = cli.flag_values(parse(rloo_vllm, "--config", str(path)))
    assert again == {**recorded, "config": str(path)}


def test_decoupled_in_a_file_written_before_it_became_areals_keeps_its_meaning(tmp_path, capsys, monkeypatch):
    """--off_policy_correction decoupled named what is now pure_is before flags_format 2: a run's args.json from
    then replays as pure_is, and resuming that run as decoupled is refused; a YAML file saying decoupled must
    say which it means."""
    recorded = cli.flag_values(parse(grpo_vllm, "--off_policy_correction", "tis"))
    recorded["off_policy_correction"] = "decoupled"
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"args": recorded, "ranks": 1, "versions": {}, "argv": []}))
    assert parse(grpo_vllm, "--config", str(path)).corrections.off_policy_correction == "pure_is"
    assert "replayed as pure_is" in capsys.readouterr().out
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    (tmp_path / "checkpoints" / "update-2").mkdir(parents=True)
    now = parse(grpo_vllm, "--off_policy_correction", "decoupled", "--output_dir", str(tmp_path), "--resume")
    with pytest.raises(SystemExit, match="--off_policy_correction 'pure_is' -> 'decoupled'"):
        outputs.prepare_output_dir(now.run, cli.flag_values(now))
    path.write_text(json.dumps({"args": recorded, "ranks": 1, "flags_format": 2, "versions": {}, "argv": []}))
    assert parse(grpo_vllm, "--config", str(path)).corrections.off_policy_correction == "decoupled"
    config = tmp_path / "run.yaml"
    config.write_text("off_policy_correction: decoupled\n")
    with pytest.raises(SystemExit, match="write pure_is for the earlier objective, or add `flags_format: 2`"):
        parse(grpo_vllm, "--config", str(config))
    config.write_text("flags_format: 2\noff_policy_correction: decoupled\n")
    assert parse(grpo_vllm, "--config", str(config)).corrections.off_policy_correction == "decoupled"


def test_a_renamed_flag_in_an_older_file_reads_as_its_new_name(tmp_path, monkeypatch):
    """--is_level is --correction_level now (flag_history.RENAMED): a run's args.json or a YAML file that says is_level
    replays as --correction_level, and resuming that run under the new name changes nothing; typed, the old
    name points to the new."""
    recorded = cli.flag_values(parse(ppo, "--off_policy_correction", "tis"))
    recorded["is_level"] = "sequence"
    del recorded["correction_level"]
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"args": recorded, "ranks": 1, "flags_format": 2, "versions": {}, "argv": []}))
    assert parse(ppo, "--config", str(path)).corrections.correction_level == "sequence"
    config = tmp_path / "run.yaml"
    config.write_text("is_level: sequence\n")
    assert parse(ppo, "--config", str(config)).corrections.correction_level == "sequence"
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    (tmp_path / "checkpoints" / "update-2").mkdir(parents=True)
    resumed = parse(ppo, "--config", str(path), "--output_dir", str(tmp_path), "--resume")
    outputs.prepare_output_dir(resumed.run, cli.flag_values(resumed))
    changed = parse(ppo, "--config", str(path), "--correction_level", "token", "--output_dir", str(tmp_path),
                    "--resume")
    with pytest.raises(SystemExit, match="--correction_level 'sequence' -> 'token'"):
        outputs.prepare_output_dir(changed.run, cli.flag_values(changed))
    with pytest.raises(SystemExit, match="--is_level is now --correction_level"):
        parse(ppo, "--is_level", "sequence")


@pytest.mark.parametrize(("text", "message"), [
    ("learnin_rate: 1e-4\n", "'learnin_rate' is not a flag of online_dpo.py; did you mean 'learning_rate'?"),
    ("- 1\n- 2\n", "must map Args fields to values"),
    ("seed: [1\n", "is neither YAML nor JSON"),
    ("learning_rate: fast\n", "Error parsing --learning_rate: could not convert string to float: 'fast'"),
    ("preset: tldr-7b\n", "--preset 'tldr-7b' is not one of this script's presets"),
])
def test_a_bad_config_file_is_a_one_line_error(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit, match=re.escape(message)) as stop:
        parse(online_dpo, "--config", str(config))
    assert "\n" not in str(stop.value.code)
    with pytest.raises(SystemExit, match="--config '.*missing.yaml' does not exist"):
        parse(online_dpo, "--config", str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("name", ["gsm8k-rho1b-1gpu", "gsm8k-qwen2.5-0.5b-1gpu"])
def test_gsm8k_prompts_are_the_template_as_the_scripts_apply_it(tmp_path, name):
    """What the policy is given for a GSM8k row: the preset's --prompt_template filled with the row's question,
    tokenized as it stands (rho-1b) or inside the tokenizer's chat template (Qwen2.5-Instruct)."""
    from own_inputs import CHAT_TEMPLATE, byte_level_bpe_tokenizer, write_jsonl

    import data

    parsed, args = parsed_and_flags(grpo, "--preset", name)
    tokenizer = byte_level_bpe_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    question = "what is two plus three ?"
    parsed.data.dataset_name = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": question, "answer": "#### 5"}])
    [prompt] = data.load_prompts(parsed.data, tokenizer, "train")["input_ids"]
    filled = {"gsm8k-rho1b-1gpu": f"[MATH_TASK] Problem:\n{question}\n\nSolution:",
              "gsm8k-qwen2.5-0.5b-1gpu":
                  f'{question} Let\'s think step by step and output the final answer after "####".'}
    if args.chat_template:  # one user turn, then the assistant's cue
        assert tokenizer.decode(prompt) == f"user : {filled[name]} assistant : "
    else:
        assert prompt == tokenizer(filled[name], add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(prompt) == filled[name]
