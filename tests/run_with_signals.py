"""A kit script (named by the first argument) that sends itself preemption signals, as a scheduler
would: to its whole process group (the generator process, and under the deepspeed launcher the
launcher and every rank), from rank 0. The second argument lists when, as JSON [update, point, signal]
triples, counting the updates of this launch from 1; the points:

    "generation"  as the update's batch is sampled (sync) or taken from the engine, which is then sampling
                  the next batch (async)
    "training"    at the update's first micro-batch step
    "saving"      as the update's checkpoint starts to be written

    PYTHONPATH=. python tests/run_with_signals.py rloo '[[1, "training", "SIGUSR1"], [1, "saving", "SIGTERM"]]' ...
"""

import importlib
import json
import os
import signal
import sys

import deepspeed

import async_generator
import cli
import common
import outputs


def signal_at(point: str, events: list, update: list[int]):
    """Send the signals of `events` that are due at `point` of the current update."""
    for event_update, event_point, name in events:
        if (event_update, event_point) == (update[0], point) and int(os.environ.get("RANK", "0")) == 0:
            os.killpg(os.getpgrp(), getattr(signal, name))


def signalling(function, point: str, events: list, update: list[int], starts_update=False):
    def wrapped(*args, **kwargs):
        if starts_update:
            update[0] += 1
        signal_at(point, events, update)
        return function(*args, **kwargs)

    return wrapped


if __name__ == "__main__":
    # the first two arguments, after the --local_rank=N the deepspeed launcher puts first
    name, events = [argument for argument in sys.argv[1:] if not argument.startswith("--local_rank")][:2]
    sys.argv.remove(name)
    sys.argv.remove(events)
    script, events, update = importlib.import_module(name), json.loads(events), [0]
    common.sample_responses = signalling(common.sample_responses, "generation", events, update, starts_update=True)
    async_generator.AsyncGenerator.batch_for = signalling(async_generator.AsyncGenerator.batch_for, "generation",
                                                          events, update, starts_update=True)
    outputs.write_checkpoint = signalling(outputs.write_checkpoint, "saving", events, update)
    optimizer_step, stepped_in = deepspeed.DeepSpeedEngine.step, set()

    def step(engine, *args, **kwargs):
        if update[0] not in stepped_in:  # the update's first step
            stepped_in.add(update[0])
            signal_at("training", events, update)
        return optimizer_step(engine, *args, **kwargs)

    deepspeed.DeepSpeedEngine.step = step
    script.main(cli.parse(script.Args))
