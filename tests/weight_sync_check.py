"""vLLM's greedy completions equal HF's after a weight sync, and seeded sampling does not depend on
batching: run by test_engine_greedy_equals_hf_greedy_after_weight_sync in the engine's environment,
for a policy and prompts of a dataset split (with its prompt column).

    PYTHONPATH=. python tests/weight_sync_check.py POLICY DATASET PROMPT_COLUMN SPLIT
"""

import sys

import torch

import common
import data
import vllm_generator
import vllm_placement
import weight_transport

ENGINE_ARGS = vllm_placement.EngineArgs(vllm_device="cpu", vllm_gpu_memory_utilization=0.9)
GENERATION = common.GenerationArgs()


def engine_environment() -> dict[str, str]:
    """The generator process's environment on a CPU: the engine in-process, on the last core (refused on a
    GPU node, so asked for only when a test runs)."""
    return vllm_placement.engine_placement(ENGINE_ARGS, world_size=1).environment


def check_greedy_after_weight_sync(policy_path, dataset, prompt_column, split):
    """Train the policy a few steps, load its weights into the engine from memory, compare vLLM greedy
    with HF greedy."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(policy_path)  # before the engine, as in vllm_generator.start_engine
    # in this process, on the core engine_environment() names
    llm = vllm_placement.start_vllm(policy_path, False, 0, 64 + GENERATION.response_length, False,
                                    ENGINE_ARGS.vllm_gpu_memory_utilization)
    for module in policy.modules():
        module.do_not_compile = True  # vLLM's Transformers backend (GPT-NeoX) decorated HF classes just now
    common.init_distributed()
    tokenizer = data.load_tokenizer(policy_path)
    eos_ids = data.eos_token_ids(policy_path, tokenizer)
    prompts = data.load_prompts(data.DataArgs(dataset_name=dataset, prompt_column=prompt_column, max_prompt_length=64),
                                tokenizer, split)["input_ids"][:32]
    training = common.OptimizerArgs(per_device_train_batch_size=8, gradient_accumulation_steps=1)
    engine = common.prepare_deepspeed(policy, common.DistributedArgs(), training,
                                      torch.optim.AdamW(policy.parameters(), lr=1e-2))
    query_ids, query_mask = common.left_pad(prompts, tokenizer.pad_token_id, engine.device)

    def hf_greedy():
        output = engine.module.generate(input_ids=query_ids, attention_mask=query_mask, do_sample=False,
                                        max_new_tokens=GENERATION.response_length, eos_token_id=eos_ids,
                                        pad_token_id=tokenizer.pad_token_id)[:, query_ids.shape[1]:]
        return [row[:n].tolist() for row, n in zip(*common.truncate_after_eos(output, eos_ids,
                                                                                  tokenizer.pad_token_id)[:2])]

    def vllm_greedy():
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = SamplingParams(temperature=0, max_tokens=GENERATION.response_length, stop_token_ids=eos_ids)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    before = hf_greedy()
    assert vllm_greedy() == before
    # the exact check of each load compares the tensors vLLM keeps as they are (on a CPU: the embeddings and
    # norms of Llama, Qwen2 and GPT-2; the output layer of GPT-NeoX, which runs through vLLM's Transformers backend)
    pairs = weight_transport.one_to_one_tensors(llm, engine.module)
    assert pairs, "no tensor of the engine equals the policy's"
    for _ in range(3):  # a few large steps that change the greedy completions
        loss = -engine(input_ids=query_ids[:8], attention_mask=query_mask[:8]).logits[:, -1, 5].mean()
        engine.backward(loss)
        engine.step()
    after = hf_greedy()
    assert after != before, "the training steps did not change the policy's greedy completions"
    try:  # the engine still holds the weights before the steps
        weight_transport.check_engine_holds(llm, engine.module, pairs, version=3)
        raise AssertionError("an engine that kept its old weights passed the exact check")
    except RuntimeError as error:
        assert str(error).endswith("differ from the weights sent: the engine did not take the new weights"), error
    weight_transport.load_engine_weights(llm, engine.module)
    weight_transport.check_engine_holds(llm, engine.module, pairs, version=3)
    assert vllm_greedy() == after
    # seeded sampling: a row's completion depends on its prompt and seed alone, however vLLM batches
    # it, also in a batch of more prompt tokens than one engine step takes (4096 on a CPU)
    batch, pad = prompts * (4096 // sum(map(len, prompts)) + 1), tokenizer.pad_token_id
    assert sum(map(len, batch)) > 4096
    seeds = list(range(len(batch)))
    responses, _ = vllm_generator.vllm_generate(llm, batch, seeds, GENERATION, eos_ids, pad)
    alone, _ = vllm_generator.vllm_generate(llm, batch[-1:], seeds[-1:], GENERATION, eos_ids, pad)
    assert torch.equal(responses[-1:], alone)
    print("greedy completions equal after weight sync")


if __name__ == "__main__":
    check_greedy_after_weight_sync(*sys.argv[1:])
