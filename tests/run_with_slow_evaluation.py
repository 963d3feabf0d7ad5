"""A kit script (named by the first argument) whose first evaluation takes longer by the seconds the
second argument gives, as a large policy's first evaluation on hundreds of prompts does while the vLLM
engine starts beside it.

    PYTHONPATH=. python tests/run_with_slow_evaluation.py online_dpo_vllm 150 --total_episodes 64 ...
"""

import importlib
import sys
import time

import cli
import evaluation

if __name__ == "__main__":
    script, delay = importlib.import_module(sys.argv.pop(1)), float(sys.argv.pop(1))
    evaluate, calls = evaluation.evaluate, []

    def slow_first_evaluation(*args, **kwargs):
        if not calls:
            time.sleep(delay)
        calls.append(1)
        return evaluate(*args, **kwargs)

    evaluation.evaluate = slow_first_evaluation
    script.main(cli.parse(script.Args))
