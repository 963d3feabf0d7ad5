"""The GPU paths, on a GPU node: `python -m pytest -m gpu` (CLUSTERS.md, "Checking a GPU node"). Skipped, each with
its reason, where there is no CUDA GPU, no GPU build of vLLM, or fewer GPUs than a test needs; the CPU suite
lists them as skipped.

- one GPU, no vLLM: a weight channel to a generator that died fails on one line within its timeout; the
  trainer's shared weight buffer is pinned; online_dpo.py learns in bf16 (DeepSpeed on NCCL), and so do the
  other synchronous scripts, LoRA, ZeRO-3 under the deepspeed launcher and the multi-turn GRPO; the README's
  pipeline (SFT, reward model, RL, evaluation) runs in bf16;
- one GPU with vLLM: no stale KV after a weight load; the engine on the trainer's GPU with sleep mode
  (memory returned between turns) learns; eval_checkpoints.py --vllm scores as HF generate does;
- two GPUs: the engine on a GPU of its own, weights over NCCL at K=1 (every load checked exactly, async/
  logprob_diff within the bf16 bound at every batch), learning, in full and with LoRA; a generator that dies
  before the first send stops the run on one line;
- four GPUs: two engines on one node.
"""

import importlib.util
import json
import multiprocessing
import os
import re
import time

import pytest
import torch
from scripts import assert_learns, read_metrics, run_script, toy_run
from test_pipeline import SHORTER, readme_pipeline
from test_vllm_generator import logprob_gaps_around_loads

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpus = [pytest.mark.skipif(GPUS < n, reason=f"needs {n} CUDA GPU{'s' * (n > 1)}, this machine has {GPUS}")
        for n in (1, 2, 4)]
one_gpu, two_gpus, four_gpus = gpus
vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None or GPUS == 0,
                          reason="needs vLLM's GPU build (pip install -r requirements.txt) and a GPU")
# a short toy run that learns: 20 updates of 64 prompts, evaluated at the start, after 10 and at the end
LEARNING_RUN = ["--total_episodes", "1280", "--eval_every", "10", "--eval_num_prompts", "256", "--bf16"]


@one_gpu
def test_a_weight_channel_to_a_dead_generator_fails_on_one_line_within_the_timeout():
    import weight_transport

    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    process = multiprocessing.get_context("spawn").Process(target=os.getpid)  # ends at once, never connects
    process.start()
    started = time.time()
    with pytest.raises(SystemExit, match=re.escape("connecting the weight channel to the vLLM engine process failed: "
                                                   "the vLLM engine process died")):
        weight_transport.connect_weight_channel(store, process, timeout_seconds=60)
    assert time.time() - started < 60


@one_gpu
def test_the_trainers_weight_buffer_is_pinned_and_takes_the_gpus_weights():
    import weight_transport

    shared = weight_transport.SharedWeights(2**20, torch.bfloat16)
    weights = torch.randn(2**20, device="cuda", dtype=torch.bfloat16)
    shared.flat.copy_(weights)
    assert shared.flat.is_pinned() and torch.equal(shared.flat.cuda(), weights)


@one_gpu
def test_online_dpo_learns_in_bf16_on_a_gpu(tmp_path):
    run_script(*LEARNING_RUN, "--output_dir", tmp_path / "run", script="online_dpo.py")
    assert_learns(tmp_path / "run", min_gain=0.2)


@one_gpu
@pytest.mark.parametrize(("script", "flags", "launcher"), [
    ("ppo.py", [], None), ("rloo.py", [], None), ("bok.py", [], None), ("grpo.py", [], None),
    ("online_dpo.py", ["--use_peft", "--learning_rate", "2e-3"], None),  # test_lora.py's learning rates
    ("ppo.py", ["--use_peft", "--learning_rate", "1e-3"], None),
    ("ppo.py", ["--zero_stage", "3"], ("deepspeed", "--num_gpus", "1"))],
    ids=["ppo", "rloo", "bok", "grpo", "online_dpo-lora", "ppo-lora", "ppo-zero3"])
def test_the_synchronous_scripts_learn_in_bf16_on_a_gpu(tmp_path, script, flags, launcher):
    """TOY_RUN (5 updates of 64 prompts; GRPO's 10 of 32) in bf16 beats the SFT policy by 0.2 gold win-rate."""
    run_script(*toy_run(script), *flags, "--bf16", "--output_dir", tmp_path / "run", script=script,
               **({"launcher": launcher} if launcher else {}))
    assert_learns(tmp_path / "run", min_gain=0.2)


@one_gpu
def test_multiturn_grpo_learns_guess_the_number_in_bf16_on_a_gpu(tmp_path):
    run_script("--bf16", "--eval_every", "20", "--eval_num_prompts", "64", "--output_dir", tmp_path / "run",
               script="grpo_multiturn.py")
    evals = [m["eval/return_mean"] for m in read_metrics(tmp_path / "run") if "eval/return_mean" in m]
    assert len(evals) == 3 and evals[-1] >= evals[0] + 0.3, evals


@one_gpu
def test_the_readmes_pipeline_runs_in_bf16_on_a_gpu(tmp_path):
    """test_pipeline.py's shortened pipeline, each step with --bf16: the SFT loss falls, the reward model
    agrees with the gold judge, and the RL step raises the gold score."""
    for _, script, *args in readme_pipeline():
        run_script(*args, *SHORTER[script], "--bf16", script=script, cwd=tmp_path, timeout=600)
    losses = [m["eval/loss"] for m in read_metrics(tmp_path / "runs" / "sft") if "eval/loss" in m]
    assert losses[-1] < 0.3 * losses[0], losses
    assert [m["eval/accuracy"] for m in read_metrics(tmp_path / "runs" / "rm") if "eval/accuracy" in m][-1] > 0.85
    table = [json.loads(line) for line in (tmp_path / "runs" / "dpo" / "eval" / "eval.jsonl").read_text().splitlines()]
    assert table[-1]["eval/gold_score"] > table[0]["eval/gold_score"] + 0.5, table


@vllm
def test_no_stale_kv_after_a_weight_load_on_a_gpu(tmp_path):
    gaps = logprob_gaps_around_loads(tmp_path, {}, "cuda")
    assert max(gaps) < 1e-4, f"engine log-probs off by {gaps} per token before, after the first and second load"


@vllm
def test_an_engine_sharing_the_trainers_gpu_sleeps_between_turns_and_learns(tmp_path):
    result = run_script(*LEARNING_RUN, "--vllm_device", "shared", "--async_steps", "0", "--output_dir",
                        tmp_path / "run", script="rloo_vllm.py")
    assert "Sleep mode freed" in result.stdout + result.stderr  # vLLM's own report of the memory it returned
    assert_learns(tmp_path / "run", min_gain=0.2)


@vllm
def test_eval_checkpoints_with_the_engine_scores_as_hf_generate_on_a_gpu(tmp_path):
    run_script("--total_episodes", "256", "--save_every", "2", "--eval_every", "0", "--output_dir", tmp_path / "run",
               script="online_dpo.py")
    tables = {}
    for name, engine in (("hf", []), ("vllm", ["--vllm"])):
        run_script("--run_dir", tmp_path / "run", "--eval_temperature", "0", *engine, "--output_dir", tmp_path / name,
                   script="eval_checkpoints.py")
        tables[name] = [json.loads(line) for line in (tmp_path / name / "eval.jsonl").read_text().splitlines()]
    # fp32 greedy: the same completions but where two tokens' logits are within the kernels' rounding
    for hf, engine in zip(tables["hf"], tables["vllm"]):
        assert engine["eval/gold_win_rate"] == pytest.approx(hf["eval/gold_win_rate"], abs=0.02), (hf, engine)


def logprob_diffs(run_dir) -> list[float]:
    return [m["async/logprob_diff"] for m in read_metrics(run_dir) if "async/logprob_diff" in m]


@vllm
@two_gpus
@pytest.mark.parametrize("lora", [[], ["--use_peft", "--learning_rate", "1e-3"]], ids=["full", "lora"])
def test_an_engine_on_its_own_gpu_takes_every_version_over_nccl_and_learns(tmp_path, lora):
    run_script(*LEARNING_RUN, *lora, "--vllm_device", "cuda:1", "--async_steps", "1", "--logprob_check_every", "1",
               "--output_dir", tmp_path / "run", script="online_dpo_vllm.py")
    metrics = [m for m in read_metrics(tmp_path / "run") if "async/staleness" in m]
    assert [m["async/staleness"] for m in metrics] == [0] + [1] * 19
    assert len(logprob_diffs(tmp_path / "run")) == 20 and max(logprob_diffs(tmp_path / "run")) < 0.1  # bf16's bound
    assert_learns(tmp_path / "run", min_gain=0.2)


@vllm
@two_gpus
def test_a_generator_that_dies_before_the_first_send_stops_the_run_on_one_line(tmp_path):
    result = run_script("online_dpo_vllm", "dying_before_connecting_generate_ahead", "--total_episodes", "128",
                        "--vllm_device", "cuda:1", "--generator_timeout", "120", "--output_dir", tmp_path / "run",
                        check=False, script="tests/run_with_faulty_generator.py", timeout=600)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == ("error: connecting the weight channel to the vLLM engine "
                                                      "process failed: the vLLM engine process died")


@vllm
@four_gpus
def test_two_engines_on_one_node_sample_for_two_ranks_each(tmp_path):
    run_script(*LEARNING_RUN, "--vllm_engines_per_node", "2", "--output_dir", tmp_path / "run",
               launcher=("deepspeed", "--num_gpus", "2"), script="online_dpo_vllm.py")
    assert_learns(tmp_path / "run", min_gain=0.2)

