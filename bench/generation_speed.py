"""Where does vLLM overtake HF generate on this machine? Times both on Llama models of a few sizes.

Each model is made from a config, saved with save_pretrained and loaded by both engines, then
asked for the same batch: `--rows` prompts of 20 tokens, `--new_tokens` sampled tokens each.
Both sides get the same number of threads. Each size's batch is timed `--repeats` times on each side, the two
sides taking turns (HF, vLLM, HF, ...), so that a slow spell of the machine falls on both; the ratio is HF's
seconds over vLLM's per round, given as the median over the rounds and their range. `--results_file` keeps every
round's seconds.

    python bench/generation_speed.py --results_file bench/results/generation_speed.json
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_placement  # noqa: E402  (the kit's root on the path first)

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import off_policy_corrections  # noqa: E402  (bench's helpers: the machine, a results file written whole)


@dataclass
class Args:
    hidden_sizes: tuple[int, ...] = (128, 512, 1024, 2048)
    """model widths to try (layers = 2 + hidden/512, heads of 64, vocabulary 8k)"""
    rows: int = 128
    """completions per batch"""
    new_tokens: int = 32
    """tokens sampled per completion"""
    threads: int = 1
    """threads for each engine (vLLM binds its OpenMP threads to the last cores)"""
    repeats: int = 3
    """rounds per size: each round times HF's batch, then vLLM's"""
    results_file: str | None = None
    """where to keep every round's seconds, per size, with the machine (JSON); none by default"""


def main(args: Args):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.update(vllm_placement.cpu_engine_environment(sorted(os.sched_getaffinity(0))[-args.threads:], 2))
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = torch.randint(10, 8000, (args.rows, 20), generator=torch.Generator().manual_seed(0))
    print(f"{'hidden':>7} {'params':>8} {'HF s':>7} {'vLLM s':>7} {'vLLM/HF speed, median (range)':>30}")
    sizes = {}
    for hidden in args.hidden_sizes:
        config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 3,
                             num_hidden_layers=2 + hidden // 512, num_attention_heads=hidden // 64,
                             num_key_value_heads=hidden // 64, max_position_embeddings=128, eos_token_id=None)
        with tempfile.TemporaryDirectory() as folder:
            model = LlamaForCausalLM(config).eval()
            model.save_pretrained(folder)
            llm = LLM(model=folder, tokenizer=None, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
                      enforce_eager=True, seed=0)
            params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
                                    detokenize=False)
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts.tolist()]
            with torch.no_grad():
                model.generate(prompts[:2], max_new_tokens=2, do_sample=True)  # warm-ups
            llm.generate(inputs[:2], params, use_tqdm=False)
            hf_seconds, vllm_seconds = [], []
            for _ in range(args.repeats):
                start = time.time()
                with torch.no_grad():
                    model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=True, top_k=0, pad_token_id=0)
                hf_seconds.append(time.time() - start)
                start = time.time()
                llm.generate(inputs, params, use_tqdm=False)
                vllm_seconds.append(time.time() - start)
            del llm
        parameters = sum(p.numel() for p in model.parameters())
        speeds = [hf / fast for hf, fast in zip(hf_seconds, vllm_seconds)]
        sizes[str(hidden)] = {"parameters": parameters, "hf_seconds": hf_seconds, "vllm_seconds": vllm_seconds}
        print(f"{hidden:7d} {parameters / 1e6:7.1f}M {statistics.median(hf_seconds):7.2f} "
              f"{statistics.median(vllm_seconds):7.2f} {statistics.median(speeds):14.2f}x "
              f"({min(speeds):.2f}-{max(speeds):.2f})", flush=True)
    if args.results_file:
        kept = {"date": time.strftime("%Y-%m-%d"), "machine": off_policy_corrections.machine(),
                "torch_threads": torch.get_num_threads(), "args": asdict(args), "sizes": sizes}
        off_policy_corrections.write_whole(args.results_file, kept)


if __name__ == "__main__":
    main(tyro.cli(Args))
