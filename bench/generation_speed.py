"""Where does vLLM overtake HF generate on this machine? Times both on Llama models of a few sizes.

Each model is made from a config, saved with save_pretrained and loaded by both engines, then
asked for the same batch: `--rows` prompts of 20 tokens, `--new_tokens` sampled tokens each.
Both sides get the same number of threads.

    python bench/generation_speed.py             # about 5 minutes on 2 CPU cores
"""

import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_placement  # noqa: E402  (the kit's root on the path first)


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


def main(args: Args):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.update(vllm_placement.cpu_engine_environment(sorted(os.sched_getaffinity(0))[-args.threads:], 2))
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = torch.randint(10, 8000, (args.rows, 20), generator=torch.Generator().manual_seed(0))
    print(f"{'hidden':>7} {'params':>8} {'HF s':>7} {'vLLM s':>7} {'vLLM/HF speed':>14}")
    for hidden in args.hidden_sizes:
        config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 3,
                             num_hidden_layers=2 + hidden // 512, num_attention_heads=hidden // 64,
                             num_key_value_heads=hidden // 64, max_position_embeddings=128, eos_token_id=None)
        with tempfile.TemporaryDirectory() as folder:
            model = LlamaForCausalLM(config).eval()
            model.save_pretrained(folder)
            model.generate(prompts[:2], max_new_tokens=2, do_sample=True)  # warm-up
            start = time.time()
            with torch.no_grad():
                model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=True, top_k=0, pad_token_id=0)
            hf_seconds = time.time() - start
            llm = LLM(model=folder, tokenizer=None, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
                      enforce_eager=True, seed=0)
            params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
                                    detokenize=False)
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts.tolist()]
            llm.generate(inputs[:2], params, use_tqdm=False)  # warm-up
            start = time.time()
            llm.generate(inputs, params, use_tqdm=False)
            vllm_seconds = time.time() - start
            del llm
        parameters = sum(p.numel() for p in model.parameters()) / 1e6
        speed = hf_seconds / vllm_seconds
        print(f"{hidden:7d} {parameters:7.1f}M {hf_seconds:7.2f} {vllm_seconds:7.2f} {speed:13.2f}x", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
