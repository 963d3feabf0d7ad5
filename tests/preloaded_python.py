"""The stand-in for `python` in the processes tests/preloaded.py forks (run with `python -S`: nothing but the
standard library): `preloaded_python.py ADDRESS [python's arguments]` asks the server at the abstract Unix
socket ADDRESS to fork the command from its preloaded image with this process's file descriptors (at the
same numbers: a multiprocessing pipe, the resource tracker's), working directory, environment, cores and
ignored and blocked signals; then passes on every signal it is sent that the command would act on, and ends
as the command ends: with its exit code, or killed by the same signal."""

import contextlib
import os
import pickle
import signal
import socket
import sys

PASSED_ON = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # the listing's own, closed by now
        return False
    return True


ignored = [number for number in PASSED_ON if signal.getsignal(number) == signal.SIG_IGN]
blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
fds = [fd for fd in sorted(map(int, os.listdir("/proc/self/fd"))) if is_open(fd)]
request = {"argv": sys.argv[2:], "cwd": os.getcwd(), "env": dict(os.environ), "cores": os.sched_getaffinity(0),
           "ignored": ignored, "blocked": blocked, "fds": fds}
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
server.connect("\0" + sys.argv[1])  # an abstract Unix socket
socket.send_fds(server, [pickle.dumps(request)], fds)


def answer():
    message = server.recv(4096)
    if not message:
        sys.exit(f"tests/preloaded_python.py: the server ended before {sys.argv[2:]} did")
    return pickle.loads(message)


pid = answer()


def pass_on(number, frame):
    with contextlib.suppress(ProcessLookupError):  # ended meanwhile: its status is on its way
        os.kill(pid, number)


for number in set(PASSED_ON) - set(ignored):
    signal.signal(number, pass_on)
status = answer()
if os.WIFSIGNALED(status):
    if os.WTERMSIG(status) != signal.SIGKILL:  # which no handler can catch
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
sys.exit(os.waitstatus_to_exitcode(status))
