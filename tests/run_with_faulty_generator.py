"""online_dpo_vllm.py with its generator process running a function of faulty_generators.py (named
by the first argument) instead of common.generate_ahead.

    PYTHONPATH=. python tests/run_with_faulty_generator.py failing_generate_ahead --total_episodes 64 ...
"""

import sys

import faulty_generators

import common
import online_dpo_vllm

if __name__ == "__main__":
    common.generate_ahead = getattr(faulty_generators, sys.argv.pop(1))
    online_dpo_vllm.main(common.cli(online_dpo_vllm.Args, online_dpo_vllm.PRESETS))
