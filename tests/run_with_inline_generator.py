"""A vLLM script (named by the first argument: online_dpo_vllm, rloo_vllm or ppo_vllm) with its
generator process replaced by InlineGenerator: each batch is sampled in the trainer's process when the
trainer asks for it. test_k0_gives_the_same_losses_as_inline_generation runs it with --async_steps 0
on one rank and compares its losses with the real generator process's.

    PYTHONPATH=. python tests/run_with_inline_generator.py online_dpo_vllm --async_steps 0 ...
"""

import dataclasses
import importlib
import os
import shutil
import sys
import tempfile
from types import SimpleNamespace
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

import async_generator
import cli
import common
import rollouts
import vllm_generator
import vllm_placement


class InlineGenerator:
    """Stands in for async_generator.AsyncGenerator: batch t is sampled with the weights published after
    update t-1 (the definition of K=0), in this process, with the same per-row seeds."""

    def __init__(self, asynchronous, engine_args, source, run, state, num_updates):
        assert asynchronous.async_steps == 0 and state.update == 0 and torch.distributed.get_world_size() == 1
        self.due = async_generator.evaluated_updates(run.eval_every, state.update, num_updates)  # in the trainer
        self.engine_args, self.source, self.seed = engine_args, source, run.seed
        # what sample_batch reads of a generator process's job
        self.job = SimpleNamespace(asynchronous=asynchronous, source=source)
        self.published, self.version = tempfile.mkdtemp(), 0  # weights by version, as safetensors folders
        # the trainer's threads as start_generator leaves them (the thread count changes float sums)
        cores = len(os.sched_getaffinity(0))
        shared = engine_args.vllm_device == "shared"
        torch.set_num_threads(cores if shared else cores - engine_args.vllm_cpu_threads)

    def wait_for_engine(self):
        from transformers import AutoModelForCausalLM

        # the engine's model in processes of its own: run in this one, vLLM changes the trainer's numerics
        placement = vllm_placement.engine_placement(self.engine_args, world_size=1)
        environment = {**placement.environment, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        with mock.patch.dict(os.environ, environment):
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(name)  # the engine's processes are not training ranks
            self.llm = vllm_placement.start_vllm(self.source.policy_path, self.source.bf16, self.seed,
                                                 self.source.max_model_len(), self.engine_args.vllm_enforce_eager,
                                                 placement.gpu_memory_utilization)
        self.sampling_policy = AutoModelForCausalLM.from_pretrained(self.source.policy_path).eval()

    def batch_for(self, update: int) -> vllm_generator.Batch:
        if self.version != update - 1:  # through a folder: this engine runs in processes of its own
            self.version = update - 1
            folder = os.path.join(self.published, f"version-{self.version}")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            self.llm.reset_prefix_cache()  # as weight_transport.load_engine_weights does
            self.sampling_policy.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
        indices = self.source.sampler.next_indices()
        queries = [self.source.prompts[i] for i in indices for _ in range(self.source.num_samples)]
        seeds = vllm_generator.row_seeds(self.seed, update, range(len(queries)))
        batch = rollouts.sample_batch(self.llm, self.sampling_policy, indices, queries, seeds, update, self.job)
        batch.metrics["time/weight_load"] = 0.0
        return dataclasses.replace(batch.as_tensors(), version=self.version)

    def publish_weights(self, policy, version: int, part: str | None = None):
        with common.full_parameters(policy, part) as model:
            folder = os.path.join(self.published, f"version-{version}")
            os.makedirs(folder)
            # clone: tied embeddings share storage, which safetensors refuses
            save_file({name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
                      os.path.join(folder, "model.safetensors"))

    def evaluations(self, update: int, wait: bool) -> list[tuple[int, None]]:
        """As AsyncGenerator's with --eval_in_trainer: the trainer evaluates each update due, when it is done."""
        due = [version for version in self.due if version <= update]
        self.due = self.due[len(due):]
        return [(version, None) for version in due]

    def checkpoint_state(self, update: int) -> tuple[list, None]:
        return [], None  # K=0: nothing is sampled ahead, no engine state

    def stop(self):
        shutil.rmtree(self.published, ignore_errors=True)


if __name__ == "__main__":
    script = importlib.import_module(sys.argv.pop(1))
    async_generator.AsyncGenerator = InlineGenerator
    script.main(cli.parse(script.Args))
