"""A fork server for the tests: a process that has imported the libraries every kit script imports (torch,
transformers, DeepSpeed, vLLM, datasets, peft, matplotlib: 6-8 s in a fresh interpreter, most of a short toy
run) and runs each `python [-u] script.py|-m module|-c code args` command as a forked child of itself: run
as __main__ with the same argv, working directory, environment and standard streams, in a session of its
own, exiting with the code (or dying of the signal) the command would; a command whose environment differs
from the server's in what is read as the interpreter starts or the libraries load (READ_AT_IMPORT) execs a
fresh interpreter instead. The kit's own modules are not preloaded: each child imports them as a fresh
interpreter would.

tests/scripts.py starts one per pytest worker and sends it one command at a time over a socket pair (the
file descriptor in argv[1]): a pickled request with the child's stdin, stdout and stderr as passed file
descriptors; the answers are the child's pid and, once it has ended, its wait status. "kill" kills the
child's session (the test gave up on it); an empty read (the test process ended) ends the server. It forks
only while it has no other thread (but jemalloc's, fork-safe), and ends otherwise: the tests then run every
command fresh, as they do with ASYNC_RLHF_TESTS_FRESH=1.

The Python processes a child starts (a vLLM script's generator process, spawned by multiprocessing; the
processes of the deepspeed launcher and of torchrun) are forked by the server too: in a child,
sys.executable (and multiprocessing's) is a script that runs tests/preloaded_python.py, a stand-in that
sends the server its command, file descriptors, working directory, environment, cores and signal
dispositions over an abstract Unix socket, passes the signals it gets on to the forked process and ends as
it ends. The forked process is killed, with its session, should the stand-in die first (as it does when
its process group is SIGKILLed). What the stand-in does not change: the forked process is in a session of
its own, not in the process group of the process that started it (a signal to that group reaches it
through its stand-in only), and a launcher's processes are not the parents of its ranks.
"""

import contextlib
import fcntl
import gc
import io
import multiprocessing
import os
import pickle
import runpy
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading

STAND_IN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preloaded_python.py")
PYTHON = sys.executable
# the options of `python` a forked child emulates; with any other, it runs the real interpreter
OPTIONS = {"-u", "-B", "-s", "-E"}


def preload():
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import peft  # noqa: F401
    import torch
    import transformers
    import tyro  # noqa: F401
    import vllm.engine.llm_engine  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    from vllm import LLM  # noqa: F401

    # transformers imports its model classes lazily, on first use
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer", "LlamaForCausalLM",
                 "LlamaForSequenceClassification", "GPT2LMHeadModel", "PreTrainedTokenizerFast", "get_scheduler"):
        getattr(transformers, name)
    # vLLM's sampler counts the ranks of the sampled tokens' log-probs with a torch.compile'd function, compiled
    # in each process at its first batch with log-probs (2 s of every generator process's start): compiled here
    # once, for any batch and vocabulary size (shapes that vary make it dynamic), without compile workers
    import torch._inductor.config
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    torch._inductor.config.compile_threads = 1
    for rows, vocabulary in ((3, 70), (5, 90), (7, 130)):
        batched_count_greater_than(torch.randn(rows, vocabulary), torch.randn(rows, 1))


# the threads a fork may leave behind: jemalloc's background thread (pyarrow's allocator), whose fork handlers
# take and release its locks around the fork
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)


def other_threads() -> list[str]:
    """The names of this process's threads besides the calling one (which fork copies; a lock another holds
    would stay held in the child forever)."""
    names = []
    for thread in os.listdir("/proc/self/task"):
        if int(thread) != threading.get_native_id():
            with open(f"/proc/self/task/{thread}/comm") as f:
                names.append(f.read().strip())
    return names


def fork_with_fds(fds: list[int], numbers: list[int], closing: list[socket.socket]) -> int:
    """fork(); in the child, in a session of its own, `closing` closed and `fds` moved to `numbers`. Only from a
    process with no thread but FORK_SAFE_THREADS: otherwise the server ends (the tests run fresh)."""
    unsafe = [name for name in other_threads() if name not in FORK_SAFE_THREADS]
    if unsafe:
        sys.exit(f"tests/preloaded.py: will not fork with other threads running: {unsafe}")
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        for sock in closing:
            sock.close()
        # out of the way first: a target number may be another passed descriptor's
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
        for fd in fds:
            os.close(fd)
        for fd, number in zip(moved, numbers):
            os.dup2(fd, number)
            os.close(fd)
    else:
        for fd in fds:
            os.close(fd)
    return pid


def kill_session(pid: int):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # forked but not yet the leader of its session: nothing else of it runs yet
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def relay(connection: socket.socket) -> dict:
    """In a process forked for a stand-in: fork its command and return its request there; here, tell the
    stand-in the pid and then the wait status, and kill the command's session should the stand-in end first."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 64)
    request = pickle.loads(message)
    pid = fork_with_fds(fds, request["fds"], [connection])
    if pid == 0:
        return request
    connection.sendall(pickle.dumps(pid))
    exited = os.pidfd_open(pid)
    if connection in select.select([connection, exited], [], [])[0]:
        kill_session(pid)
    _, status = os.waitpid(pid, 0)
    if status:
        kill_session(pid)
    with contextlib.suppress(OSError):
        connection.sendall(pickle.dumps(status))
    os._exit(0)


def serve(channel: socket.socket, listener: socket.socket, folder: str) -> dict:
    """Fork a child for each of the test's requests, and a relay for each stand-in's; return (in the child, or
    in the stand-in's command) its request. The server itself never returns: it removes `folder` and exits
    when the test process has ended."""
    relays = set()
    child = exited = None  # the test's command while it runs: its pid and pidfd
    while True:
        relays -= {pid for pid in relays if os.waitpid(pid, os.WNOHANG)[0]}
        ready = select.select([channel, listener, *([exited] if child else [])], [], [])[0]
        if listener in ready:
            connection, _ = listener.accept()
            pid = fork_with_fds([], [], [channel, listener])
            if pid == 0:
                return relay(connection)
            connection.close()
            relays.add(pid)
            continue
        if channel in ready:
            message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 3)
            if not message:  # the test process ended
                if child:
                    kill_session(child)
                shutil.rmtree(folder, ignore_errors=True)
                os._exit(0)
            if message == b"kill":  # the test gave up on its command (or it ended as the test gave up on it)
                if child:
                    kill_session(child)
                continue
            if child:
                sys.exit("tests/preloaded.py: a second command while one runs (tests/scripts.py sends one at a time)")
            child = fork_with_fds(fds, [0, 1, 2], [channel, listener])
            if child == 0:
                return pickle.loads(message)
            channel.sendall(pickle.dumps(child))
            exited = os.pidfd_open(child)
            continue
        _, status = os.waitpid(child, 0)
        os.close(exited)
        if status:  # a failed or killed run's other processes (its engine, its ranks) go with it
            kill_session(child)
        channel.sendall(pickle.dumps(status))
        child = None


# what the interpreter reads as it starts and the libraries preloaded here as they load (OpenMP's and MKL's
# thread counts): a command whose environment sets them otherwise runs in a fresh interpreter. The rest of a
# command's environment (a launcher's RANK, the engine's VLLM_* settings, which vLLM reads as it uses them) is
# its own, set before the script starts.
READ_AT_IMPORT = ("PYTHONPATH", "PYTHONHASHSEED", "LD_PRELOAD", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def run_python(request: dict, executable: str, started_with: dict):
    """What `python *request["argv"]` does, in the request's folder and environment (and, for a stand-in's,
    with its cores and signal dispositions), with `executable` as sys.executable; in a fresh interpreter if the
    request's READ_AT_IMPORT differ from those the server `started_with`."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "cores" in request:
        os.sched_setaffinity(0, request["cores"])
        for number in request["ignored"]:
            signal.signal(number, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    if {name: os.environ.get(name) for name in READ_AT_IMPORT} != started_with:
        os.execv(PYTHON, [PYTHON, *request["argv"]])
    argv = list(request["argv"])
    options = []
    while argv and argv[0] in OPTIONS:
        options.append(argv.pop(0))
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-c", "-m")):
        os.execv(PYTHON, [PYTHON, *request["argv"]])
    sys.executable = executable
    multiprocessing.set_executable(executable)
    if "-u" in options:
        sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True, errors="backslashreplace")
    if argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # the stand-ins reach the server at an abstract Unix socket (its name after a null byte)
    address = f"kit-tests-preloaded-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + address)
    listener.listen()
    folder = tempfile.mkdtemp(prefix="kit-tests-preloaded-")
    executable = os.path.join(folder, "python")
    with open(executable, "w") as f:
        f.write(f"#!/bin/sh\nexec '{PYTHON}' -S '{STAND_IN}' {address} \"$@\"\n")
    os.chmod(executable, 0o755)
    started_with = {name: os.environ.get(name) for name in READ_AT_IMPORT}  # before the imports set their own
    preload()
    # what is preloaded stays: the children's collections (and a finalizing interpreter's, 2 s at exit) skip it
    gc.freeze()
    run_python(serve(socket.socket(fileno=int(sys.argv[1])), listener, folder), executable, started_with)
