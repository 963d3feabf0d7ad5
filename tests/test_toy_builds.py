"""Building the embedded tasks: one holder of the build lock at a time on a machine, each build in a process of
its own, which clears what a killed build left; several side by side with a thread each."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from scripts import ROOT

import toy

# a caller of a build: its torch thread count and random state before and after, on one line
BUILD_CALLER = """import sys, torch, toy
state, threads = torch.get_rng_state(), torch.get_num_threads()
getattr(toy, sys.argv[1])()
print("caller", threads, torch.get_num_threads(), torch.equal(state, torch.get_rng_state()))"""


def start_build(toy_dir, build: str) -> subprocess.Popen:
    environment = os.environ | {"ASYNC_RLHF_TOY_DIR": str(toy_dir), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", BUILD_CALLER, build], env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def waiting_for_a_lock(pids: list[int]) -> bool:
    """Whether each of `pids` waits for a file lock (/proc/locks lists a waiter after "->")."""
    with open("/proc/locks") as f:
        waiters = {int(line.split("->")[1].split()[3]) for line in f if "->" in line}
    return set(pids) <= waiters


def test_a_build_waits_for_any_other_and_leaves_its_caller_as_it_was(tmp_path):
    toy.build()
    shutil.copytree(toy.TOY_DIR, tmp_path / "toy")  # built: what the pipeline's data and the arithmetic task need
    with open(tmp_path / "builds.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build, in progress
        math, pipeline = start_build(tmp_path / "toy", "build_math"), start_build(tmp_path / "toy", "build_pipeline")
        deadline = time.time() + 120
        while not waiting_for_a_lock([math.pid, pipeline.pid]):
            assert math.poll() is None and pipeline.poll() is None and time.time() < deadline
            time.sleep(0.1)
        assert sorted(os.listdir(tmp_path)) == ["builds.lock", "toy"]  # neither has started building
        math.kill()
        math.wait()
        (tmp_path / "toy-pipeline.building-killed").mkdir()  # what a build killed mid-way leaves behind
    output = pipeline.communicate(timeout=120)[0]
    assert pipeline.returncode == 0, output
    assert output.splitlines()[-1] == "caller 1 1 True", output  # the build's 2 threads and its seed were its own
    assert "toy: building the pipeline's data" in output
    assert sorted(os.listdir(tmp_path)) == ["builds.lock", "toy", "toy-pipeline"]  # the leftover removed
    built = toy.PIPELINE_DIR  # the same build as the one the suite uses, bit for bit
    toy.build_pipeline()
    for name in ("base_policy/model.safetensors", "sft_dataset/train/data-00000-of-00001.arrow"):
        assert (tmp_path / "toy-pipeline" / name).read_bytes() == open(os.path.join(built, name), "rb").read(), name


# two builds side by side: the pipeline's data twice, into folders of the test's own
SIDE_BY_SIDE = """import sys, toy
toy.built_side_by_side([(sys.argv[1], toy.make_pipeline, "copy a"), (sys.argv[2], toy.make_pipeline, "copy b")], 0)"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="builds run side by side only with a core each")
def test_builds_side_by_side_run_at_once_with_a_thread_each_and_build_what_one_alone_builds(tmp_path):
    toy.build_pipeline()  # alone: BUILD_THREADS threads
    shutil.copytree(toy.TOY_DIR, tmp_path / "toy")  # the world the pipeline's data is made from
    environment = os.environ | {"ASYNC_RLHF_TOY_DIR": str(tmp_path / "toy"), "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", SIDE_BY_SIDE, tmp_path / "a", tmp_path / "b"], env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line for line in result.stdout.splitlines() if line.startswith("toy: ")]
    started = sorted(line.split(" (seed")[0] for line in said[:2])  # both started before either ended
    assert started == [f"toy: building copy {copy} into {tmp_path / copy}" for copy in ("a", "b")], said
    assert all(" built in " in line for line in said[2:]) and len(said) == 4, said
    for copy in ("a", "b"):
        assert json.loads((tmp_path / copy / "summary.json").read_text())["build_threads"] == 1
        for name in ("base_policy/model.safetensors", "sft_dataset/train/data-00000-of-00001.arrow"):
            assert (tmp_path / copy / name).read_bytes() == open(os.path.join(toy.PIPELINE_DIR, name), "rb").read()
