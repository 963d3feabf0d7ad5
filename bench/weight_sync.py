"""Weight sync's share of an update in the asynchronous scripts, across policy sizes, on CPU.

Builds Llama policies of four sizes locally (the toy's tokenizer, random weights, cached next to the
toy; the largest has the 135M parameters of SmolLM2-135M's layers, 38 of them, with the toy's small
vocabulary in place of a 49k-token embedding), runs online_dpo_vllm.py (K=1, the toy's batch: 64
prompts x 2 samples x 12 tokens) for a few updates with each, and prints, per size, the seconds per
update and `time/weight_sync` (the trainer sending the weights, `time/weight_send`, plus the generator
loading them into the engine, `time/weight_load`), medians over the updates after warm-up, and the
share of the update.

    python bench/weight_sync.py                                # this checkout, about 10 minutes on 2 CPU cores
    python bench/weight_sync.py --before /path/to/other/kit    # and another checkout of the kit, interleaved
"""

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import toy  # noqa: E402  (the kit's root on the path first)

# hidden size, layers, MLP size, attention heads, key-value heads
SIZES = {"8M": (256, 8, 768, 4, 4), "34M": (512, 10, 1536, 8, 8), "135M": (576, 38, 1536, 9, 3)}


@dataclass
class Args:
    updates: int = 6
    """updates per run; the first two are warm-up and left out of the medians"""
    repeats: int = 1
    """runs per size and checkout, interleaved"""
    before: str | None = None
    """another checkout of the kit (e.g. `git worktree add /tmp/before <commit>`), run side by side"""
    sizes: tuple[str, ...] = ("toy", *SIZES)
    """policy sizes to run: toy (the toy's SFT policy, 0.45M parameters) and those of SIZES"""


def policy_path(size: str) -> str:
    """The toy's SFT policy, or a Llama of `size` with random weights and the toy's tokenizer (built once)."""
    if size == "toy":
        return toy.SFT_POLICY
    path = os.path.join(toy.TOY_DIR + "-bench", f"llama-{size}")
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden, layers, mlp, heads, kv_heads = SIZES[size]
        torch.manual_seed(0)
        partial = tempfile.mkdtemp(dir=os.path.dirname(toy.TOY_DIR))
        shutil.copytree(toy.SFT_POLICY, partial, dirs_exist_ok=True,  # tokenizer and generation config
                        ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        vocab_size = LlamaConfig.from_pretrained(toy.SFT_POLICY).vocab_size
        LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                     intermediate_size=mlp, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     max_position_embeddings=512, tie_word_embeddings=True)).save_pretrained(partial)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.rename(partial, path)
    return path


def parameter_count(path: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())


def run(kit: str, policy: str, updates: int, folder: str) -> dict:
    """One run of `kit`'s online_dpo_vllm.py: medians of seconds per update and of the weight sync's times
    (send and load apart where the checkout logs them)."""
    output_dir = tempfile.mkdtemp(dir=folder)
    command = [sys.executable, os.path.join(kit, "online_dpo_vllm.py"), "--model_name_or_path", policy,
               "--total_episodes", str(64 * updates), "--eval_every", "0", "--output_dir", output_dir]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=kit)
    if result.returncode:
        sys.exit(f"this run failed (exit {result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        train = [m for m in map(json.loads, f) if "time/weight_sync" in m]
    seconds = [b["time"] - a["time"] for a, b in zip(train, train[1:])][1:]  # updates 3 onwards
    # the last update sends nothing: no batch samples with its weights
    synced = train[2:-1]
    return {"seconds_per_update": statistics.median(seconds),
            **{part: statistics.median(m[f"time/{part}"] for m in synced)
               for part in ("weight_sync", "weight_send", "weight_load") if f"time/{part}" in synced[0]}}


def main(args: Args):
    kits = {"this": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    toy.build()
    results = {size: {kit: [] for kit in kits} for size in args.sizes}
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            policy = policy_path(size)
            for _ in range(args.repeats):
                for kit, path in kits.items():
                    results[size][kit].append(run(path, policy, args.updates, folder))
                    print(size, kit, results[size][kit][-1], flush=True)
    table = []
    print(f"\n{'policy':>8} {'params':>8} {'checkout':>9} {'s/update':>9} {'weight sync s':>14} {'send':>6}"
          f" {'load':>6} {'share':>7}")
    for size in args.sizes:
        parameters = parameter_count(policy_path(size))
        for kit in kits:
            seconds = statistics.median(r["seconds_per_update"] for r in results[size][kit])
            sync = statistics.median(r["weight_sync"] for r in results[size][kit])
            parts = {part: statistics.median(r[part] for r in results[size][kit])
                     for part in ("weight_send", "weight_load") if part in results[size][kit][0]}
            table.append({"policy": size, "parameters": parameters, "checkout": kit, "seconds_per_update": seconds,
                          "weight_sync": sync, **parts, "share": sync / seconds})
            send, load = (f"{parts[p]:6.3f}" if p in parts else f"{'-':>6}" for p in ("weight_send", "weight_load"))
            print(f"{size:>8} {parameters / 1e6:7.1f}M {kit:>9} {seconds:9.3f} {sync:14.3f} {send} {load}"
                  f" {sync / seconds:7.1%}")
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "weight_sync.json"), "w") as f:
        json.dump({"updates": args.updates, "repeats": args.repeats, "before": args.before, "table": table}, f,
                  indent=1)


if __name__ == "__main__":
    main(tyro.cli(Args))
