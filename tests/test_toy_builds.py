"""Building the embedded tasks: one build at a time on a machine (the build lock), each in a process of its own,
which clears what a killed build left."""

import fcntl
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


@pytest.mark.slow
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
