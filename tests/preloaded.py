"""A fork server for the tests: a process that has imported the libraries every kit script imports (torch,
transformers, DeepSpeed, vLLM, datasets, peft, matplotlib: 6-8 s in a fresh interpreter, most of a short toy
run) and runs each `python script.py args` as a forked child of itself: the script run as __main__ with the
same argv, working directory, environment and standard streams, in a session of its own, exiting with the
code (or dying of the signal) the command would. The kit's own modules are not preloaded: each child
imports them as a fresh interpreter would. The generator process a vLLM script starts is spawned as always
(a fresh interpreter), as are the processes the deepspeed launcher and torchrun start.

tests/scripts.py starts one per pytest worker and sends it one command at a time over a socket pair (the
file descriptor in argv[1]): a pickled request with the child's stdin, stdout and stderr as passed file
descriptors; the answers are the child's pid and, once it has ended, its wait status. A request while a
child runs kills the child's session (the test gave up on it); an empty read (the test process ended) ends
the server.
"""

import contextlib
import os
import pickle
import runpy
import select
import signal
import socket
import sys


def preload():
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import tyro  # noqa: F401
    import vllm.engine.llm_engine  # noqa: F401

    # transformers imports its model classes lazily, on first use
    for name in ("AutoModelForCausalLM", "AutoModelForSequenceClassification", "AutoTokenizer", "LlamaForCausalLM",
                 "LlamaForSequenceClassification", "GPT2LMHeadModel", "PreTrainedTokenizerFast", "get_scheduler"):
        getattr(transformers, name)


def serve(channel: socket.socket) -> dict:
    """Fork a child for each request; return (in the child) its request. The server itself never returns."""
    while True:
        message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 3)
        if not message:
            os._exit(0)
        if message == b"kill":  # for a child that ended as the test gave up on it
            continue
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            return pickle.loads(message)
        for fd in fds:
            os.close(fd)
        channel.sendall(pickle.dumps(pid))
        exited = os.pidfd_open(pid)
        if channel in select.select([channel, exited], [], [])[0]:  # the test gave up on the child, or ended
            gave_up = channel.recv(16)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            if not gave_up:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        os.close(exited)
        if status:  # a failed or killed run's other processes (its engine) go with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        channel.sendall(pickle.dumps(status))


def run_as_main(request: dict):
    """What `python script args` does: the script's folder first on sys.path, the script as __main__."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    server = socket.socket(fileno=int(sys.argv[1]))
    preload()
    run_as_main(serve(server))
