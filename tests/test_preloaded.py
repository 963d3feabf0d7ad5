"""tests/preloaded.py, through which the tests run most `python script` commands: a run forked by it is the
run a fresh interpreter makes (argv, folder, sys.path, __main__, a session of its own, exit code, output, an
uncaught exception, death by a signal, no kit module imported before the script's own imports), and so are
the processes it starts (multiprocessing's spawned processes, `python -c` and `python -m` commands); a run the
test gives up on is killed, and what it started goes with it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import scripts
from scripts import ROOT, run_script, start_script

PROGRAM = """
import json, os, signal, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path": sys.path[0], "name": __name__,
                  "own_session": os.getsid(0) == os.getpid(), "kit_imported": "common" in sys.modules,
                  "torch_imported": "torch" in sys.modules}))
print("on stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("uncaught")
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "sleep":
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    signal.pause()
sys.exit(int(sys.argv[1]))
"""

# what a run starts: multiprocessing's spawned processes, which see what their parent set before the spawn
# (environment, cores, ignored and blocked signals), report to it, end as they end, get what it sends them
# and notice when it ends; and `python -c`/`python -m` commands
STARTING = """
import json, multiprocessing, os, signal, subprocess, sys, time


def report(queue):
    queue.put({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "variable": os.environ.get("A_VARIABLE"),
               "cores": sorted(os.sched_getaffinity(0)),
               "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
               "blocked": sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))),
               "parent_alive": multiprocessing.parent_process().is_alive()})
    sys.exit(7)


def until_sigterm(ready):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
    ready.set()
    signal.pause()


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def report_imports(queue):
    queue.put({"threads": os.environ["OMP_NUM_THREADS"], "torch_imported": "torch" in sys.modules})


def sleep(pid_file):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def spawned(target, *args):
    process = multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    return process


if __name__ == "__main__":
    if sys.argv[1] == "module":
        print(json.dumps({"argv": sys.argv, "name": __name__, "path": sys.path[0]}))
        sys.exit(4)
    if sys.argv[1] == "orphan":  # its own process group SIGKILLed, as kill_at ends a run
        process = spawned(sleep, sys.argv[2])
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.environ["A_VARIABLE"] = "set before the spawn"
    os.sched_setaffinity(0, {0})
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    context = multiprocessing.get_context("spawn")
    queue, ready = context.Queue(), context.Event()
    process = spawned(report, queue)
    result = {"spawned": queue.get()}
    process.join()
    exitcodes = [process.exitcode]
    process = spawned(until_sigterm, ready)
    ready.wait()
    process.terminate()
    for process in (process, spawned(die)):
        process.join()
        exitcodes.append(process.exitcode)
    result["exitcodes"] = exitcodes
    command = subprocess.run([sys.executable, "-u", "-c", "import sys; print(sys.argv, sys.path[0]); sys.exit(3)",
                              "an argument"], capture_output=True, text=True)
    module = subprocess.run([sys.executable, "-m", "program", "module"], capture_output=True, text=True)
    result["commands"] = [command.returncode, command.stdout, module.returncode, json.loads(module.stdout)]
    os.environ["OMP_NUM_THREADS"] = "2"  # read as OpenMP loads: a process started now starts fresh
    process = spawned(report_imports, queue)
    result["other_threads"] = queue.get()
    process.join()
    print(json.dumps(result))
"""


@pytest.fixture(autouse=True)
def server_on(monkeypatch):
    """The fork server's own tests run it whatever ASYNC_RLHF_TESTS_FRESH says (which turns it off for the rest)."""
    monkeypatch.setattr(scripts, "FRESH", False)


def test_a_preloaded_run_is_what_a_fresh_interpreter_runs(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    runs = {name: run_script("3", script=str(program), check=False, cwd=tmp_path, preloaded=preloaded)
            for name, preloaded in (("preloaded", True), ("fresh", False))}
    for run in runs.values():
        assert run.returncode == 3 and run.stderr == "on stderr\n"
    seen = {name: json.loads(run.stdout) for name, run in runs.items()}
    assert [seen[name].pop("torch_imported") for name in runs] == [True, False]  # preloaded, and not
    assert seen["preloaded"] == seen["fresh"] == {
        "argv": ["3"], "cwd": str(tmp_path), "path": str(tmp_path), "name": "__main__", "own_session": True,
        "kit_imported": False}
    raised = run_script("raise", script=str(program), check=False)
    assert raised.returncode == 1 and raised.stderr.strip().endswith("ValueError: uncaught")
    assert run_script("die", script=str(program), check=False).returncode == -9


def test_what_a_preloaded_run_starts_is_what_a_fresh_interpreter_would_start(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(STARTING)
    runs = {name: json.loads(run_script("start", script=str(program), cwd=tmp_path, preloaded=preloaded).stdout)
            for name, preloaded in (("preloaded", True), ("fresh", False))}
    assert runs["preloaded"] == runs["fresh"] == {
        "spawned": {"name": "__mp_main__", "argv": [str(program), "start"], "cwd": str(tmp_path),  # the parent's argv
                    "variable": "set before the spawn", "cores": [0], "usr1_ignored": True,
                    "blocked": [signal.SIGUSR2], "parent_alive": True},
        "exitcodes": [7, 5, -signal.SIGKILL],
        "commands": [3, "['-c', 'an argument'] \n", 4,
                     {"argv": [str(program), "module"], "name": "__main__", "path": str(tmp_path)}],
        "other_threads": {"threads": "2", "torch_imported": False}}


def test_a_preloaded_run_the_test_gives_up_on_is_killed(tmp_path):
    program, started = tmp_path / "program.py", tmp_path / "started"
    program.write_text(PROGRAM)
    with pytest.raises(subprocess.TimeoutExpired):
        run_script("sleep", started, script=str(program), timeout=10)
    with pytest.raises(ProcessLookupError):  # killed (and reaped) when the timeout expired
        os.kill(int(started.read_text()), 0)
    started.unlink()
    process = start_script("sleep", started, script=str(program))
    deadline = time.time() + 60
    while not started.exists():
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.01)
    assert process.pid == int(started.read_text())
    os.killpg(process.pid, signal.SIGKILL)  # as kill_at ends a run
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert run_script("0", script=str(program)).returncode == 0  # the server carries on


@pytest.mark.parametrize("preloaded", [True, False], ids=["preloaded", "fresh"])
def test_a_spawned_process_ends_with_its_parents_process_group(tmp_path, preloaded):
    program, started = tmp_path / "program.py", tmp_path / "started"
    program.write_text(STARTING)
    run = run_script("orphan", started, script=str(program), check=False, preloaded=preloaded)
    assert run.returncode == -signal.SIGKILL
    deadline = time.time() + 30
    with pytest.raises(ProcessLookupError):
        while time.time() < deadline:
            os.kill(int(started.read_text()), 0)
            time.sleep(0.01)


def preloaded_run(program, tmp_path) -> bool:
    """Whether tests/scripts.py ran `program` in the fork server (torch imported before the program's start)."""
    return json.loads(run_script("0", script=str(program), cwd=tmp_path).stdout)["torch_imported"]


def test_fresh_mode_and_a_changed_import_time_environment_run_fresh(tmp_path, monkeypatch):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    assert preloaded_run(program, tmp_path)
    with monkeypatch.context() as changed:  # read as OpenMP loads: the server's was loaded without it
        changed.setenv("OMP_NUM_THREADS", "3")
        assert not preloaded_run(program, tmp_path)
    with monkeypatch.context() as changed:  # read later (by the run, or by vLLM as it uses it): preloaded
        changed.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
        assert preloaded_run(program, tmp_path)
    with monkeypatch.context() as fresh:  # ASYNC_RLHF_TESTS_FRESH=1
        fresh.setattr(scripts, "FRESH", True)
        assert not preloaded_run(program, tmp_path)
    assert preloaded_run(program, tmp_path)


def test_a_server_that_cannot_start_warns_once_and_every_command_runs_fresh(tmp_path, monkeypatch):
    program, broken = tmp_path / "program.py", tmp_path / "server.py"
    program.write_text(PROGRAM)
    broken.write_text("raise SystemExit('cannot preload: vllm is broken')\n")
    for name, value in (("PRELOADED_SERVER", str(broken)), ("preloaded_server", None),
                        ("preloaded_server_failed", False), ("running_preloaded", None)):
        monkeypatch.setattr(scripts, name, value)  # this worker's own server is back after the test
    with pytest.warns(UserWarning) as warned:
        assert [preloaded_run(program, tmp_path) for _ in range(2)] == [False, False]
    assert [str(w.message) for w in warned] == [
        "tests/preloaded.py ended (exit 1: cannot preload: vllm is broken): this worker runs every command in a "
        "fresh interpreter from now on"]


def test_one_command_at_a_time(tmp_path):
    program, started = tmp_path / "program.py", tmp_path / "started"
    program.write_text(PROGRAM)
    process = start_script("sleep", started, script=str(program))
    with pytest.raises(RuntimeError, match=f"runs one command at a time and pid {process.pid} still runs"):
        run_script("0", script=str(program))
    process.kill()
    assert process.wait() == -signal.SIGKILL and run_script("0", script=str(program)).returncode == 0


def test_the_server_does_not_fork_while_another_thread_runs():
    code = ("import threading, time, preloaded; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); "
            "preloaded.fork_with_fds([], [], [])")
    result = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "tests"), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "tests/preloaded.py: will not fork with other threads running: ['python']"), result.stderr[-2000:]
