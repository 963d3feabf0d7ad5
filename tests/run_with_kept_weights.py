"""A vLLM kit script (named by the first argument) that keeps, on rank 0, the trainer's weights at every
version it publishes to the engine and its share of every batch it trains on (the engine's samples and
log-probs, and with --inflight_updates each token's version), and saves both to kept.pt in the run's output
directory: what a test needs to check, from outside the generator, which weights sampled each batch. The
prompts of each batch it trains on go to trained_prompts.jsonl there as it takes them (a killed run's too).

    PYTHONPATH=. python tests/run_with_kept_weights.py online_dpo_vllm --async_steps 2 --output_dir runs/x ...
"""

import importlib
import json
import os
import sys

import torch

import async_generator
import cli
import common

if __name__ == "__main__":
    # the first argument, after the --local_rank=N the deepspeed launcher puts first
    name = next(argument for argument in sys.argv[1:] if not argument.startswith("--local_rank"))
    sys.argv.remove(name)
    script = importlib.import_module(name)
    leader = int(os.environ.get("RANK", "0")) == 0
    kept = {"weights": {}, "batches": {}}
    generator_class = async_generator.AsyncGenerator
    batch_for, publish_weights = generator_class.batch_for, generator_class.publish_weights

    def keeping_batch_for(generator, update: int):
        batch = batch_for(generator, update)
        if leader:
            kept["batches"][update] = {name: getattr(batch, name) for name in (
                "queries", "responses", "logprobs", "version", "token_versions") if getattr(batch, name) is not None}
            if batch.episodes is not None:  # grpo_multiturn_vllm.py's: the tokens after the first message, the policy's
                kept["batches"][update] |= {name: batch.episodes[name] for name in ("lengths", "action_mask")}
            with open(os.path.join(args.run.output_dir, "trained_prompts.jsonl"), "a") as file:
                file.write(json.dumps({"update": update, "prompt_indices": list(batch.prompt_indices)}) + "\n")
        return batch

    def keeping_publish_weights(generator, policy, version: int, part: str | None = None):
        with common.full_parameters(policy, part) as model:  # every rank: ZeRO-3 gathers
            if leader:
                kept["weights"][version] = {name: value.detach().clone() for name, value in model.state_dict().items()}
        return publish_weights(generator, policy, version, part)

    async_generator.AsyncGenerator.batch_for = keeping_batch_for
    async_generator.AsyncGenerator.publish_weights = keeping_publish_weights
    args = cli.parse(script.Args)
    script.main(args)
    if leader:
        torch.save({**kept, "temperature": args.generation.temperature, "top_p": args.generation.top_p},
                   os.path.join(args.run.output_dir, "kept.pt"))
