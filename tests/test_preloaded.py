"""tests/preloaded.py, through which the tests run most `python script` commands: a run forked by it is the
run a fresh interpreter makes (argv, folder, sys.path, __main__, a session of its own, exit code, output, an
uncaught exception, death by a signal, no kit module imported before the script's own imports), and a run the
test gives up on is killed."""

import json
import os
import signal
import subprocess
import time

import pytest
from scripts import run_script, start_script

PROGRAM = """
import json, os, signal, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path": sys.path[0], "name": __name__,
                  "own_session": os.getsid(0) == os.getpid(), "kit_imported": "common" in sys.modules}))
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


def test_a_preloaded_run_is_what_a_fresh_interpreter_runs(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    runs = {name: run_script("3", script=str(program), check=False, cwd=tmp_path, env=env)
            for name, env in (("preloaded", None), ("fresh", {"A_VARIABLE_THE_SERVER_LACKS": "1"}))}
    for run in runs.values():
        assert run.returncode == 3 and run.stderr == "on stderr\n"
    assert json.loads(runs["preloaded"].stdout) == json.loads(runs["fresh"].stdout) == {
        "argv": ["3"], "cwd": str(tmp_path), "path": str(tmp_path), "name": "__main__", "own_session": True,
        "kit_imported": False}
    raised = run_script("raise", script=str(program), check=False)
    assert raised.returncode == 1 and raised.stderr.strip().endswith("ValueError: uncaught")
    assert run_script("die", script=str(program), check=False).returncode == -9


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
