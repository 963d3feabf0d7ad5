"""Building the embedded tasks (the toy package): one build of a task at a time on a machine (its lock; other tasks
build meanwhile), each in a process of its own, which clears what a killed build left; each task cached by the hash
of its own code."""

import fcntl
import hashlib
import importlib
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
    environment = os.environ | {"ASYNC_RLHF_TOY_DIR": str(toy_dir), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2"}
    return subprocess.Popen([sys.executable, "-c", BUILD_CALLER, build], env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def waiting_for_a_lock(pids: list[int]) -> bool:
    """Whether each of `pids` waits for a file lock (/proc/locks lists a waiter after "->")."""
    with open("/proc/locks") as f:
        waiters = {int(line.split("->")[1].split()[3]) for line in f if "->" in line}
    return set(pids) <= waiters


@pytest.mark.slow
def test_a_build_waits_for_one_of_its_own_task_not_another_and_leaves_its_caller_as_it_was(tmp_path):
    toy.build()
    shutil.copytree(toy.TOY_DIR, tmp_path / "toy")  # built: what the pipeline's data and the arithmetic task need
    (tmp_path / "toy-pipeline.building-killed").mkdir()  # what a build killed mid-way leaves behind
    with open(tmp_path / "toy-math.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build of the arithmetic task, in progress
        math, pipeline = start_build(tmp_path / "toy", "build_math"), start_build(tmp_path / "toy", "build_pipeline")
        output = pipeline.communicate(timeout=120)[0]  # another task's build goes on meanwhile
        assert pipeline.returncode == 0, output
        deadline = time.time() + 120
        while not waiting_for_a_lock([math.pid]):
            assert math.poll() is None and time.time() < deadline
            time.sleep(0.1)
        assert not (tmp_path / "toy-math").exists() and not list(tmp_path.glob("toy-math.building-*"))
        math.kill()
        math.wait()
    assert output.splitlines()[-1] == "caller 2 2 True", output  # the build's 1 thread and its seed were its own
    assert "toy: building the pipeline's data" in output
    # the leftover removed; each task's lock file stays
    assert sorted(os.listdir(tmp_path)) == ["toy", "toy-math.lock", "toy-pipeline", "toy-pipeline.lock"]
    built = toy.PIPELINE_DIR  # the same build as the one the suite uses, bit for bit
    toy.build_pipeline()
    for name in ("base_policy/model.safetensors", "sft_dataset/train/data-00000-of-00001.arrow"):
        assert (tmp_path / "toy-pipeline" / name).read_bytes() == open(os.path.join(built, name), "rb").read(), name


def test_the_larger_toy_policy_is_the_same_model_family_7_7_times_the_size():
    """`python -m toy large` trains LARGE_SHAPE (minutes, so not built here): its config and size."""
    from transformers import LlamaForCausalLM

    tokenizer = toy.make_tokenizer(toy.WORDS)
    sizes = {name: sum(p.numel() for p in LlamaForCausalLM(toy.model_config(shape, tokenizer)).parameters())
             for name, shape in (("small", toy.SMALL_SHAPE), ("large", toy.LARGE_SHAPE))}
    assert sizes == {"small": 448_128, "large": 3_453_184}  # the small one is the built toy's (summary.json)


FOLDERS = ("TOY_DIR", "LARGE_DIR", "PIPELINE_DIR", "MATH_DIR", "GUESS_DIR", "TOOLS_DIR", "PROBE_DIR", "LAKE_DIR",
           "HOPS_DIR")


def folders_of_a_fresh_import(monkeypatch, kit) -> dict[str, str]:
    """The tasks' folders as the toy package found first on the path (`kit`'s, if given) names them when imported
    anew in this environment (this process's toy modules are put back after the test)."""
    if kit:
        monkeypatch.syspath_prepend(str(kit))
    for name in [name for name in sys.modules if name.split(".")[0] == "toy"]:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("toy")
    return {name: getattr(fresh, name) for name in FOLDERS}


def test_each_task_is_cached_by_the_hash_of_its_own_code(tmp_path, monkeypatch):
    """In ~/.cache/async-rlhf-kit/ (without ASYNC_RLHF_TOY_DIR), each task in a folder named by the hash of the code
    that builds it: an edited task builds again and the others stay built; an edited builder builds them all."""
    package = tmp_path / "kit" / "toy"
    shutil.copytree(os.path.join(ROOT, "toy"), package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.delenv("ASYNC_RLHF_TOY_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    folders = [folders_of_a_fresh_import(monkeypatch, package.parent)]

    def moved_by_editing(module: str) -> set[str]:
        with open(package / f"{module}.py", "a") as f:
            f.write("# edited\n")
        folders.append(folders_of_a_fresh_import(monkeypatch, None))
        return {name for name, folder in folders[-1].items() if folder != folders[-2][name]}

    code = hashlib.sha256((package / "builder.py").read_bytes() + (package / "tldr.py").read_bytes()).hexdigest()
    cache = tmp_path / ".cache" / "async-rlhf-kit"
    assert folders[0]["TOY_DIR"] == str(cache / f"toy-{code[:10]}")
    assert {os.path.dirname(folder) for folder in folders[0].values()} == {str(cache)}
    assert moved_by_editing("arithmetic") == {"MATH_DIR"}
    assert moved_by_editing("guess") == {"GUESS_DIR"}
    assert moved_by_editing("tools") == {"TOOLS_DIR"}
    assert moved_by_editing("probe") == {"PROBE_DIR"}
    assert moved_by_editing("lake") == {"LAKE_DIR"}
    assert moved_by_editing("hops") == {"HOPS_DIR"}
    assert moved_by_editing("play") == {"PROBE_DIR", "LAKE_DIR", "HOPS_DIR"}  # what the three play their episodes with
    assert moved_by_editing("pipeline") == {"PIPELINE_DIR"}
    assert moved_by_editing("tldr") == {"TOY_DIR", "LARGE_DIR", "PIPELINE_DIR"}  # the two build on the world
    assert moved_by_editing("__init__") == set()
    assert moved_by_editing("builder") == set(FOLDERS)


def test_async_rlhf_toy_dir_moves_every_task(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RLHF_TOY_DIR", str(tmp_path / "here"))
    assert list(folders_of_a_fresh_import(monkeypatch, None).values()) == [
        str(tmp_path / name) for name in ("here", "here-large", "here-pipeline", "here-math", "here-guess",
                                          "here-tools", "here-probe", "here-lake", "here-hops")]
