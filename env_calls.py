"""Calls into an environment (environments.EpisodeLoop's, the only caller of reset and step, and its tools'): each
in a thread of its own under --env_timeout, collected as they finish, and each reply checked against the contract,
with one line naming the environment, the episode and what was wrong."""

import itertools
import math
import queue
import threading
import time

import numpy as np

import common


class CallTimeout(Exception):
    """A call into an environment that ran past --env_timeout."""


class CallsInFlight:
    """Calls into environments, each in a daemon thread of its own under --env_timeout (a call that hangs does not
    keep the process from exiting), collected as they finish: call_concurrently's, and EpisodeLoop's steps."""

    def __init__(self, timeout: float):
        self.timeout, self.done, self.serials = timeout, queue.SimpleQueue(), itertools.count()
        self.running = {}  # serial -> (key, where, deadline)

    def start(self, key, call, where: str):
        """`call` (no arguments) under `key` (comparable: results come in its order); `where` names it in errors."""
        serial = next(self.serials)

        def run():  # the time it ended goes with it: a caller that collects later does not count its wait
            try:
                result = call()
                self.done.put((serial, result, None, time.monotonic()))
            except BaseException as error:  # the environment's code: every error is reported
                self.done.put((serial, None, error, time.monotonic()))

        self.running[serial] = (key, where, time.monotonic() + self.timeout)
        threading.Thread(target=run, daemon=True).start()

    def finished(self, wait: float) -> list[tuple]:
        """The calls finished since the last time, as (key, where, result, error, the time.monotonic() it ended) in
        the order of their keys, waiting up to `wait` seconds for a first one; a call past its timeout finishes with
        a CallTimeout, now (its result, should it come later, is dropped)."""
        done = []
        try:
            done.append(self.done.get(timeout=wait) if wait > 0 else self.done.get_nowait())
            while True:
                done.append(self.done.get_nowait())
        except queue.Empty:
            pass
        finished = [(*self.running.pop(serial)[:2], result, error, ended) for serial, result, error, ended in done
                    if serial in self.running]
        now = time.monotonic()
        for serial, (key, where, deadline) in list(self.running.items()):
            if now > deadline:
                del self.running[serial]
                timeout = CallTimeout(f"did not return within --env_timeout {self.timeout:g} s")
                finished.append((key, where, None, timeout, now))
        return sorted(finished, key=lambda call: call[0])


def failure_line(where: str, error: BaseException) -> str:
    """What a failed call says: `where`, then how it failed."""
    if isinstance(error, CallTimeout):
        return f"{where} {error}"
    return f"{where} raised {type(error).__name__}: {error}"


def call_concurrently(calls: list, timeout: float, describe) -> list:
    """Each of `calls` (no-argument functions) in a thread of its own, all at once (CallsInFlight); their results in
    order, once every one has returned. One that raises, or runs past `timeout` seconds, stops the run: describe(i)
    names the i-th call."""
    in_flight, results = CallsInFlight(timeout), {}
    for i, call in enumerate(calls):
        in_flight.start(i, call, describe(i))
    while in_flight.running:
        for i, where, result, error, _ in in_flight.finished(wait=0.05):
            if error is not None:
                common.fail(failure_line(where, error))
            results[i] = result
    return [results[i] for i in range(len(calls))]


def check_message(message, where: str, what: str, roles: tuple[str, ...]):
    """A message an environment sent: a str, or a list of messages ({"role": one of `roles`, "content": str}); one
    line saying how it breaks the contract otherwise."""
    if isinstance(message, str):
        return
    if not isinstance(message, list) or not message or not all(
            isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in message):
        common.fail(f"{where} returned {what}={message!r:.80}; it is a str or a list of messages "
                    f"{{'role': {' or '.join(map(repr, roles))}, 'content': str}}")


def check_step(result, where: str, chat_template: bool) -> tuple[str | list[dict] | None, float, bool]:
    """The (message, reward, done) of a step, or one line saying how `result` breaks the contract."""
    if not isinstance(result, tuple) or len(result) != 3:
        common.fail(f"{where} returned {type(result).__name__} {result!r:.80}; step returns a tuple "
                    "(next message: str, list of messages or None, reward: float, done: bool)")
    message, reward, done = result
    if not isinstance(done, bool | np.bool_):
        common.fail(f"{where} returned done={done!r} ({type(done).__name__}); done must be a bool")
    if isinstance(reward, bool) or not isinstance(reward, int | float | np.integer | np.floating) \
            or not math.isfinite(reward):
        common.fail(f"{where} returned reward={reward!r}; the reward must be a finite number")
    if message is None and not done:
        common.fail(f"{where} returned message=None with done=False; the next message must be a str or a list of "
                    "messages (None only when done)")
    if message is not None:
        check_message(message, where, "message", ("user", "tool"))
        if isinstance(message, list) and not chat_template:
            common.fail(f"{where} returned a list of messages, which reach the policy through a chat template: give "
                        "--chat_template (or --chat_template_path)")
    return message, float(reward), bool(done)
