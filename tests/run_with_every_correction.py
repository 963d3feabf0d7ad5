"""A vLLM ratio script (named by the first argument: grpo_vllm, rloo_vllm, ppo_vllm) that, at every call of
corrections.off_policy_terms, also makes what each of the six --off_policy_correction values would make of the
same inputs (the training forward's, the sampling and the start-of-update log-probs the script passes), and saves
them with the update they belong to, to every_correction.pt in the run's output directory. The run itself trains
with the correction its flags name. What a test needs to see, on the script's own inputs, where the corrections
agree (the first update of a K-stale run: one set of weights sampled and trains) and where they part.

    PYTHONPATH=. python tests/run_with_every_correction.py grpo_vllm --async_steps 2 --output_dir runs/x ...
"""

import dataclasses
import importlib
import os
import sys

import torch

import async_generator
import cli
import corrections

CORRECTIONS = ("none", "decoupled", "pure_is", "tis", "mask", "m2po")

if __name__ == "__main__":
    name = sys.argv.pop(1)
    script = importlib.import_module(name)
    calls, current = [], {"update": 0}
    batch_for, off_policy_terms = async_generator.AsyncGenerator.batch_for, corrections.off_policy_terms

    def noting_batch_for(generator, update: int):
        current["update"] = update
        return batch_for(generator, update)

    def every_correction(new_logprobs, sampling_logprobs, start_logprobs, mask, flags, sequence_level):
        made = {}
        for correction in CORRECTIONS:
            terms = off_policy_terms(new_logprobs, sampling_logprobs, start_logprobs, mask,
                                     dataclasses.replace(flags, off_policy_correction=correction), sequence_level)
            made[correction] = {"anchor": terms.anchor.clone(), "token_weights": terms.token_weights.clone(),
                                "clip": terms.clip}
        calls.append({"update": current["update"], "mask": mask.detach().clone(), "corrections": made,
                      "step": new_logprobs.detach().clone(), "start": start_logprobs.detach().clone(),
                      "sampling": sampling_logprobs.detach().clone()})
        return off_policy_terms(new_logprobs, sampling_logprobs, start_logprobs, mask, flags, sequence_level)

    async_generator.AsyncGenerator.batch_for = noting_batch_for
    corrections.off_policy_terms = every_correction
    args = cli.parse(script.Args)
    script.main(args)
    torch.save(calls, os.path.join(args.run.output_dir, "every_correction.pt"))
