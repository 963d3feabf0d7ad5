"""A kit script (named by the first argument) that SIGKILLs its whole process group (itself, under a launcher
the launcher and every rank, and the vLLM engine) as checkpoint 4 is being written: its partial directory
made, the engine's state not yet in it, where a scheduler's kill or the out-of-memory killer can strike. From
inside, so that it happens on every run: a watcher polling for the partial directory can miss it on a loaded
machine.

    PYTHONPATH=. python tests/run_killed_while_checkpointing.py online_dpo --save_every 2 ...
"""

import importlib
import os
import signal
import sys

import deepspeed

import cli

if __name__ == "__main__":
    # the first argument, after the --local_rank=N the deepspeed launcher puts first
    name = next(argument for argument in sys.argv[1:] if not argument.startswith("--local_rank"))
    sys.argv.remove(name)
    script = importlib.import_module(name)
    save_checkpoint = deepspeed.DeepSpeedEngine.save_checkpoint

    def killed_while_checkpoint_4_is_written(engine, save_dir, *args, **kwargs):
        if os.path.basename(save_dir) == ".partial-update-4":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return save_checkpoint(engine, save_dir, *args, **kwargs)

    deepspeed.DeepSpeedEngine.save_checkpoint = killed_while_checkpoint_4_is_written
    script.main(cli.parse(script.Args))
