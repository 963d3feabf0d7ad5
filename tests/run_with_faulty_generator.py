"""A vLLM script (named by the first argument) with its generator process running a function of
faulty_generators.py (named by the second) instead of vllm_generator.generate_ahead.

    PYTHONPATH=. python tests/run_with_faulty_generator.py rloo_vllm failing_generate_ahead --total_episodes 64 ...
"""

import importlib
import sys

import faulty_generators

import cli
import vllm_generator

if __name__ == "__main__":
    script = importlib.import_module(sys.argv.pop(1))
    vllm_generator.generate_ahead = getattr(faulty_generators, sys.argv.pop(1))
    script.main(cli.parse(script.Args))
