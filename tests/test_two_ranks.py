"""Multi-rank correctness under the deepspeed launcher: every synchronous script's two ranks train as one at
ZeRO-2 (the vLLM scripts' in vllm_script_tests.py), ZeRO-3 and resume on two ranks for a synchronous and an
asynchronous script of each kind, and the distributed helpers on two real ranks."""

import shutil

import pytest
from scripts import (
    GRPO_ACROSS_RANKS,
    PREEMPTIONS,
    QUICK,
    SCRIPTS,
    assert_same_weights_and_metrics,
    assert_trained_policy_saved,
    assert_two_ranks_train_as_one,
    free_port,
    preempt,
    read_metrics,
    run_script,
)

TWO_RANKS = ("deepspeed", "--num_gpus", "2", "--master_port")
SYNC_SCRIPTS = tuple(script for script in SCRIPTS if not script.endswith("_vllm.py"))
# heavy (not in CI): online DPO's and GRPO's losses over two ranks are checked in CI through their vLLM twins'
# K=2 two-rank runs; best-of-k's batches, sampler and metrics over ranks are RLOO's (common.py), its NLL's
# normalisation over ranks is checked only here
SECOND_WITNESSES = ("online_dpo.py", "grpo.py", "bok.py")
# ZeRO-3 with a resume on two ranks: online DPO's twins, each resumed after a preemption in its first update of
# its own (one of the two ways: the preemption is common code), and asynchronous PPO (a value model too) with a
# LoRA adapter (ZeRO-3 gathers the adapted layers to generate its evaluations, to merge them for the engine and
# to save; the value model has an adapter too), resumed from a copy of the first run at its checkpoint 2. What
# ZeRO-3 changes (gathering, saving, resuming) is common code, the same for ppo.py.
PREEMPTION_ON_TWO_RANKS = {"online_dpo.py": list(PREEMPTIONS)[0], "online_dpo_vllm.py": list(PREEMPTIONS)[1]}
LORA_ON_TWO_RANKS = ("ppo_vllm.py",)
ZERO_3 = (*PREEMPTION_ON_TWO_RANKS, *LORA_ON_TWO_RANKS)
# ZeRO-3's two ranks against one rank (DeepSpeed averages the adapter's gradients as the full weights')
ZERO_3_AGAINST_ONE_RANK = ("online_dpo.py",)
# not --dynamic_sampling: grpo.py's ranks each fill their own share of the batch from their own rounds (ALGORITHMS.md),
# so from an update that takes a second round on, two ranks keep other groups than one rank would
GRPO_SYNC_ACROSS_RANKS = [flag for flag in GRPO_ACROSS_RANKS if flag != "--dynamic_sampling"]


def two_rank_args(script: str, zero_stage: int, updates: int) -> list:
    # sampling chunks of 16 rows: each rank's rows, whatever k, are whole chunks (seeded by their place)
    return [*QUICK, "--local_rollout_forward_batch_size", "16", "--total_episodes", 32 * updates, "--eval_every",
            "1", "--save_every", "2", "--zero_stage", zero_stage,
            *(["--use_peft"] if script in LORA_ON_TWO_RANKS else []),
            *(GRPO_SYNC_ACROSS_RANKS if script == "grpo.py" else [])]


def run_on_two_ranks(script, args, out, updates: int, one_rank_dir=None):
    """Two ranks of 16 prompts each, under the deepspeed launcher: both evaluate and save. With `one_rank_dir`,
    they train as one rank taking the same 32 prompts per update in 4 micro-batches: samples, losses and
    weights (HF generate's rows are seeded by their place in the global batch, the vLLM engine's by row)."""
    launcher, env = (*TWO_RANKS, str(free_port())), {"OMP_NUM_THREADS": "1"}
    run_script(*args, "--output_dir", out, script=script, launcher=launcher, env=env)
    if one_rank_dir:
        run_script(*args, "--gradient_accumulation_steps", "4", "--output_dir", one_rank_dir, script=script, env=env)
        assert_two_ranks_train_as_one(out, one_rank_dir)
    metrics = read_metrics(out)
    # 16 prompts per rank per update, counted over both ranks
    assert [m["episode"] for m in metrics if "loss/policy_avg" in m] == [32 * (u + 1) for u in range(updates)]
    assert [m["update"] for m in metrics if "eval/gold_win_rate" in m] == list(range(updates + 1))
    assert_trained_policy_saved(out)  # gathered from both ranks
    assert (out / "policy" / "adapter_config.json").exists() == (script in LORA_ON_TWO_RANKS)


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param(script, marks=pytest.mark.heavy) if script in SECOND_WITNESSES
                                    else script for script in SYNC_SCRIPTS])
def test_two_ranks_train_as_one_at_zero_2(tmp_path, script):
    """ZeRO-2 (the default) for every synchronous script; the vLLM scripts' own K=2 two-rank runs do the same
    (vllm_script_tests.py). In CI, RLOO's and PPO's (SECOND_WITNESSES: heavy)."""
    args = two_rank_args(script, 2, updates=2)
    run_on_two_ranks(script, args, tmp_path / "run", updates=2, one_rank_dir=tmp_path / "one")


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("script", ZERO_3)
def test_two_ranks_resume_at_zero_3(tmp_path, script):
    """With ZeRO-3, three updates on two ranks (ZERO_3_AGAINST_ONE_RANK: trained as on one rank), and a second
    run resumes on two ranks and ends with the same weights and metrics as the first, bit for bit: after a
    preemption in its first update of its own (a SIGTERM to the whole job, launcher, ranks and engine, as the
    first batch is sampled; or SIGUSR1 to the ranks while the first update trains, then SIGTERM again while its
    checkpoint is written), or from a copy of the first run at its checkpoint 2; the last resume with every flag a
    resume may change changed (changed_on_resume)."""
    out, args = tmp_path / "run", two_rank_args(script, 3, updates=3)
    run_on_two_ranks(script, args, out, updates=3,
                     one_rank_dir=tmp_path / "one" if script in ZERO_3_AGAINST_ONE_RANK else None)
    launcher, env = (*TWO_RANKS, str(free_port())), {"OMP_NUM_THREADS": "1"}
    resumed = tmp_path / "resumed"
    after_update = -1  # every update and evaluation is the resumed run's own
    if script in PREEMPTION_ON_TWO_RANKS:
        preempt(script, args, resumed, PREEMPTION_ON_TWO_RANKS[script], launcher=launcher, env=env)
    else:
        shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("policy", "wandb"))
        assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["update-2"]
        after_update = 2  # what the copy holds is the first run's
    run_script(*args, *changed_on_resume(script, tmp_path), "--output_dir", resumed, "--resume", script=script,
               launcher=launcher, env=env)
    assert_same_weights_and_metrics(out, resumed, ["loss/policy_avg", "objective/scores"], after_update)
    # what was changed took effect
    assert [p.name for p in (resumed / "policies").iterdir()] == ["update-3"]  # one kept, of every update's
    assert list((resumed / "wandb").glob("offline-run-*"))
    assert (resumed / "policy_merged").is_dir() == (script in LORA_ON_TWO_RANKS)


def changed_on_resume(script: str, folder) -> list:
    """Every flag a resume may change (outputs.RESUME_MAY_CHANGE, and vllm_generator.RESUME_MAY_CHANGE for a
    vLLM script) set otherwise, a config file among them: the resumed run must still train as the first.
    Not --vllm_device, --vllm_engines_per_node and --vllm_cpu_threads, which two ranks on two cores cannot
    change (test_online_dpo_vllm.py runs two engines as one)."""
    config = folder / "resume.yaml"
    config.write_text("eval_temperature: 0.5\n")
    changes = ["--config", config, "--exp_name", "renamed", "--track", "--wandb_project_name", "other",
               "--wandb_entity", "someone", "--save_every", "1", "--keep_snapshots", "1"]
    if script in LORA_ON_TWO_RANKS:
        changes.append("--save_merged")
    if script.endswith("_vllm.py"):
        changes += ["--engine_start_timeout", "900", "--generator_timeout", "900", "--logprob_check_every", "1",
                    "--logprob_check_rows", "4", "--vllm_cpu_kv_cache_gib", "2", "--vllm_gpu_memory_utilization",
                    "0.5", "--vllm_enforce_eager"]
    return changes


@pytest.mark.slow
def test_metrics_and_data_across_two_real_ranks():
    result = run_script(script="tests/two_rank_helpers.py",
                        launcher=("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())),
                        env={"OMP_NUM_THREADS": "1"})
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout


@pytest.mark.slow
def test_sft_on_two_ranks_takes_the_one_rank_step(tmp_path):
    """The same 32 examples a step on one rank (4 micro-batches of 8) or split over two (2 each, ZeRO-2):
    the same losses and weights, up to the order of float sums. The step's loss is the mean over every
    completion token of the step, so each micro-batch's share must be scaled by the whole step's token
    count on both ranks, and by what DeepSpeed divides by (accumulation, ranks)."""
    from datasets import load_from_disk
    from own_inputs import write_jsonl
    from transformers import AutoModelForCausalLM

    import toy

    toy.build_pipeline()
    rows = load_from_disk(toy.SFT_DATASET)["train"].select(range(80)).to_list()  # 64 to train, 16 held out
    for row in rows[::3]:  # completions of 1 to 16 tokens: micro-batches with unequal token counts
        row["completion"] = " <eos>"
    args = ["--dataset_name", write_jsonl(tmp_path / "sft.jsonl", rows), "--num_epochs", "3", "--eval_every", "3",
            "--per_device_train_batch_size", "8"]
    run_script(*args, "--gradient_accumulation_steps", "4", "--output_dir", tmp_path / "one", script="sft.py")
    run_script(*args, "--gradient_accumulation_steps", "2", "--output_dir", tmp_path / "two", script="sft.py",
               launcher=(*TWO_RANKS, str(free_port())), env={"OMP_NUM_THREADS": "1"})
    for name in ("train/loss", "tokens", "eval/loss"):
        one, two = ([m[name] for m in read_metrics(tmp_path / run) if name in m] for run in ("one", "two"))
        assert len(one) >= 3 and one == pytest.approx(two, rel=1e-5), name
    # 6 Adam steps of 3e-3 move the weights by about 1e-2; the two runs differ by float noise (2e-5 measured)
    one, two, base = (AutoModelForCausalLM.from_pretrained(path).state_dict()
                      for path in (tmp_path / "one" / "policy", tmp_path / "two" / "policy", toy.BASE_POLICY))
    assert max((one[name] - two[name]).abs().max().item() for name in one) < 1e-4
    assert max((one[name] - base[name]).abs().max().item() for name in one) > 5e-3
