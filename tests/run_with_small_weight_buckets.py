"""A vLLM kit script (named by the first argument) that sends its weights to the engine in buckets of at most
the bytes the second argument gives (weight_transport.WEIGHT_BUCKET_BYTES; a large policy's weights take many
buckets, the toy's fit one), and prints how many buckets each send took. On the CPU the trainer gathers
and copies bucket by bucket into the shared buffer, which the engine's process reads whole: only the
trainer needs the smaller size.

    PYTHONPATH=. python tests/run_with_small_weight_buckets.py online_dpo_vllm 65536 --total_episodes 64 ...
"""

import importlib
import sys

import cli
import weight_transport

if __name__ == "__main__":
    script, weight_transport.WEIGHT_BUCKET_BYTES = importlib.import_module(sys.argv.pop(1)), int(sys.argv.pop(1))
    weight_buckets = weight_transport.weight_buckets

    def counted_weight_buckets(sizes: list[int], element_bytes: int) -> list[range]:
        buckets = weight_buckets(sizes, element_bytes)
        print(f"weight buckets: {len(buckets)} for {len(sizes)} parameters", flush=True)
        return buckets

    weight_transport.weight_buckets = counted_weight_buckets
    script.main(cli.parse(script.Args))
