"""The vLLM generator's rules, on hand-written values: which weights sample each batch (the staleness
rule) and what the engine's placement decides (vllm_placement)."""

import os
import re
from unittest import mock

import pytest
import torch

import common
import vllm_generator
import vllm_placement
import weight_transport


def test_the_staleness_rule_is_the_papers():
    """Batch t is sampled with the weights after update t-1-K; a resumed run's first batches with the
    checkpoint's weights (version 5 here), never with older ones it no longer has."""
    assert [vllm_generator.sampling_version(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]  # synchronous
    assert [vllm_generator.sampling_version(t, 1) for t in range(1, 5)] == [0, 0, 1, 2]  # batch 1 on-policy
    assert [vllm_generator.sampling_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]
    assert [vllm_generator.sampling_version(t, 1, first_version=5) for t in range(6, 9)] == [5, 5, 6]


def placement_args(**overrides):
    return vllm_placement.EngineArgs(**{"vllm_device": "cpu", **overrides})


def test_the_placement_decides_cores_turns_and_transport(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    own_cores = vllm_placement.engine_placement(placement_args(vllm_cpu_threads=1), world_size=1)
    assert (own_cores.engine_cores, own_cores.trainer_cores) == ([3], [0, 1, 2])
    assert own_cores.environment["VLLM_CPU_OMP_THREADS_BIND"] == "3" and not own_cores.takes_turns
    shared = vllm_placement.engine_placement(placement_args(vllm_device="shared"), world_size=1)
    assert shared.engine_cores == shared.trainer_cores == [0, 1, 2, 3] and shared.takes_turns
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a node of 4 GPUs, as plain python sees it
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    gpu = vllm_placement.engine_placement(placement_args(vllm_device="cuda:3"), world_size=3)
    assert gpu.environment["CUDA_VISIBLE_DEVICES"] == "3" and not gpu.takes_turns
    # the generator process of an engine on a GPU runs on the node's cores, not on those the first rank is bound to
    assert (gpu.engine_cores, gpu.trainer_cores) == (list(range(8)), [0, 1, 2, 3])
    # weights over NCCL only between two GPUs: through shared memory on a CPU and within the trainer's own device
    assert [p.weights_over_nccl for p in (own_cores, shared, gpu)] == [False, False, True]
    # beside the trainer on its GPU the engine takes less memory by default; on a GPU of its own what stays free
    assert [p.gpu_memory_utilization for p in (shared, gpu)] == [0.3, None]
    named = vllm_placement.engine_placement(placement_args(vllm_device="shared", vllm_gpu_memory_utilization=0.5), 1)
    assert named.gpu_memory_utilization == 0.5
    # two nodes of one rank: each node's rank shares its device with its node's engine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert vllm_placement.engine_placement(placement_args(vllm_device="shared"), world_size=2).takes_turns


def test_nodes_split_the_global_batchs_rows_and_seeds():
    """Each node's engine samples its node's rows of the global batch with the seeds one engine would give
    them; the nodes of a launcher's environment."""
    one_engine = vllm_generator.row_seeds(1, 7, range(0, 12))
    assert vllm_generator.row_seeds(1, 7, range(0, 6)) + vllm_generator.row_seeds(1, 7, range(6, 12)) == one_engine
    assert len(set(one_engine)) == 12 and vllm_generator.row_seeds(1, 8, range(0, 12)) != one_engine
    assert vllm_placement.ranks_per_node(16, {"LOCAL_WORLD_SIZE": "8"}) == 8  # torchrun
    assert vllm_placement.ranks_per_node(16, {"LOCAL_SIZE": "4"}) == 4  # deepspeed's launcher
    assert vllm_placement.ranks_per_node(3, {}) == 3  # python script.py, or one node
    with pytest.raises(SystemExit, match=re.escape("6 ranks do not fill nodes of 4 ranks each")):
        vllm_placement.ranks_per_node(6, {"LOCAL_WORLD_SIZE": "4"})


@pytest.mark.parametrize(("overrides", "world_size", "message"), [
    ({"vllm_device": "shared"}, 2, "--vllm_device shared puts the engine on the device of a single training rank "
                                   "per node, not 2"),
    ({"vllm_device": "tpu"}, 1, "--vllm_device 'tpu' is none of 'cpu', 'cuda:<index>' and 'shared'"),
    ({"vllm_cpu_threads": 4}, 1, "--vllm_cpu_threads 4 must leave the trainer at least one of the 4 cores"),
    ({"vllm_device": "cpu", "on_gpu_node": True}, 1, "--vllm_device cpu needs vLLM's CPU build (vllm-cpu), and this "
                                                     "is a GPU node with the GPU build: use cuda:<index> or shared"),
])
def test_a_bad_placement_fails_on_one_line(monkeypatch, overrides, world_size, message):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    on_gpu_node = overrides.pop("on_gpu_node", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu_node)
    with pytest.raises(SystemExit, match=re.escape(message)):
        vllm_placement.engine_placement(placement_args(**overrides), world_size)


@pytest.mark.parametrize(("device", "world_size", "environment", "visible_gpus", "engine"), [
    (None, 1, {}, 2, "1"),  # python script.py on a 2-GPU machine: the GPU after the trainer's
    ("cuda:3", 1, {}, 4, "3"),
    # a SLURM job's GPUs 4-7, torchrun with 3 ranks (it keeps the mask): logical indices through it
    (None, 3, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_WORLD_SIZE": "3"}, 4, "7"),
    ("cuda:3", 3, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_WORLD_SIZE": "3"}, 4, "7"),
    # two nodes of 8 GPUs, 7 ranks each: the node's 8th GPU, not cuda:14
    (None, 14, {"LOCAL_WORLD_SIZE": "7"}, 8, "7"),
    # deepspeed --num_gpus 3 shows each rank only the training GPUs 0-2: the engine takes physical GPU 3
    (None, 3, {"CUDA_VISIBLE_DEVICES": "0,1,2", "LOCAL_SIZE": "3"}, 3, "3"),
    # deepspeed --include localhost:4,5,6 on a SLURM job's GPUs 4-7: GPU 7, or the one named
    (None, 3, {"CUDA_VISIBLE_DEVICES": "4,5,6", "LOCAL_SIZE": "3"}, 3, "7"),
    ("cuda:7", 3, {"CUDA_VISIBLE_DEVICES": "4,5,6", "LOCAL_SIZE": "3"}, 3, "7"),
])
def test_the_engines_gpu_follows_the_jobs_mask_and_the_nodes_ranks(device, world_size, environment, visible_gpus,
                                                                   engine):
    assert vllm_placement.engine_gpu(device, world_size, environment, visible_gpus) == engine


def test_several_engines_per_node_take_the_gpus_after_the_training_ones():
    """6 training ranks and 2 engines on each of two 8-GPU nodes: GPUs 6 and 7, under either launcher."""
    torchrun = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "LOCAL_WORLD_SIZE": "6"}
    assert [vllm_placement.engine_gpu(None, 12, torchrun, 8, engine) for engine in (0, 1)] == ["6", "7"]
    deepspeed = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5", "LOCAL_SIZE": "6"}
    assert [vllm_placement.engine_gpu(None, 12, deepspeed, 6, engine) for engine in (0, 1)] == ["6", "7"]
    with pytest.raises(SystemExit, match=re.escape("the vLLM engine's GPU cuda:8 does not exist")):
        vllm_placement.engine_gpu("cuda:7", 12, torchrun, 8, engine=1)
    assert vllm_placement.ranks_per_engine(2, 12, {"LOCAL_WORLD_SIZE": "6"}) == 3
    with pytest.raises(SystemExit, match=re.escape("--vllm_engines_per_node 2 does not divide the 3 training ranks")):
        vllm_placement.ranks_per_engine(2, 6, {"LOCAL_WORLD_SIZE": "3"})


@pytest.mark.parametrize(("device", "world_size", "environment", "visible_gpus", "message"), [
    ("cuda:1", 3, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_WORLD_SIZE": "3"}, 4,
     "--vllm_device cuda:1 is a training GPU (the 3 ranks of this node train on cuda:0-2 of "
     "CUDA_VISIBLE_DEVICES=4,5,6,7)"),
    (None, 4, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_WORLD_SIZE": "4"}, 4,
     "the vLLM engine's GPU cuda:4 does not exist: the 4 ranks of this node see CUDA_VISIBLE_DEVICES=4,5,6,7"),
    ("cuda:8", 1, {}, 8, "the vLLM engine's GPU cuda:8 does not exist: the 1 ranks of this node see 8 GPUs"),
    ("cuda:5", 3, {"CUDA_VISIBLE_DEVICES": "4,5,6", "LOCAL_SIZE": "3"}, 3,
     "--vllm_device cuda:5 is a training GPU (the ranks of this node train on CUDA_VISIBLE_DEVICES=4,5,6)"),
    ("cuda:0", 1, {}, 0, "--vllm_device cuda:0 needs a GPU, and this machine has none"),
    # deepspeed --num_gpus 4 on a node of 4 GPUs: no GPU is left for the engine
    (None, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LOCAL_SIZE": "4"}, 4,
     "the vLLM engine's GPU 4 does not exist: this node has GPUs 0-3, and its ranks train on "
     "CUDA_VISIBLE_DEVICES=0,1,2,3"),
    ("cuda:x", 1, {}, 2, "--vllm_device 'cuda:x' is none of 'cpu', 'cuda:<index>' and 'shared'"),
])
def test_a_bad_engine_gpu_fails_on_one_line_naming_the_mask(device, world_size, environment, visible_gpus, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        vllm_placement.engine_gpu(device, world_size, environment, visible_gpus, node_gpus=4)


def test_the_engines_memory_share_leaves_what_the_generator_process_still_allocates():
    """On an 80 GiB GPU with 64 GiB free (its copy of the policy loaded) and 33 GiB still to allocate (two
    versions of an 8B policy in bf16, NCCL's buffers): 0.38 by default, rounded down, and a larger request
    is refused with a suggestion that fits."""
    gib = 2**30
    assert vllm_placement.engine_memory_share(None, 64 * gib, 80 * gib, 33 * gib) == 0.38  # 0.3875
    assert vllm_placement.engine_memory_share(0.3, 64 * gib, 80 * gib, 33 * gib) == 0.3
    with pytest.raises(RuntimeError, match=re.escape("--vllm_gpu_memory_utilization 0.39 asks for 31.2 GiB of the "
                                                     "engine's GPU, and its 80.0 GiB GPU has 64.0 GiB free, and the "
                                                     "generator process needs 33.0 GiB beside the engine")) as error:
        vllm_placement.engine_memory_share(0.39, 64 * gib, 80 * gib, 33 * gib)
    assert str(error.value).endswith("lower it to at most 0.38")
    with pytest.raises(RuntimeError, match="no memory is left for the vLLM engine"):
        vllm_placement.engine_memory_share(None, 30 * gib, 80 * gib, 33 * gib)


def test_the_engine_uses_cuda_graphs_and_chunked_prefill_on_a_gpu_only():
    assert vllm_placement.engine_options(False, stepwise=False, on_gpu=True) == {"enforce_eager": False}
    assert vllm_placement.engine_options(True, stepwise=False, on_gpu=True) == {"enforce_eager": True}
    assert vllm_placement.engine_options(False, stepwise=False, on_gpu=False) == {
        "enforce_eager": True, "enable_chunked_prefill": False}
    # in flight, every step's tokens are those of the weights loaded before it: no step scheduled ahead
    assert vllm_placement.engine_options(False, stepwise=True, on_gpu=True) == {"enforce_eager": False,
                                                                                 "async_scheduling": False}


def engine_logprob_gap(llm, policy, prompts: list[list[int]], generation) -> float:
    """The largest |engine log-prob - `policy`'s log-prob| of the tokens the engine samples for `prompts`."""
    responses, engine_logprobs = vllm_generator.vllm_generate(llm, prompts, list(range(len(prompts))), generation,
                                                              eos_ids=[1], pad_token_id=0)  # (N, R) each
    device = policy.device
    query_ids, query_mask = common.left_pad(prompts, 0, device)
    _, lengths, _ = common.truncate_after_eos(responses.to(device), [1], 0)
    with torch.no_grad():
        own = common.response_logprobs(policy, query_ids, query_mask, responses.to(device), lengths,
                                       generation.temperature)
    return (engine_logprobs.to(device) - own).abs().max().item()


def logprob_gaps_around_loads(folder, environment: dict, device: str) -> list[float]:
    """The engine's log-prob gaps (engine_logprob_gap) to its weights' own on prompts of three KV blocks (a block
    is 128 tokens on a CPU, 16 on a GPU), before any load, then after a load of other weights and a load of the
    first ones again, on the prompts seen before the loads and on one that shares two blocks with them."""
    from conftest import word_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer(words=[f"w{i}" for i in range(61)])  # pad 0, eos 1: 64 tokens
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    old, new = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    old.save_pretrained(folder / "policy")
    tokenizer.save_pretrained(folder / "policy")
    old, new = old.to(device), new.to(device)
    generation = common.GenerationArgs(response_length=8, temperature=1.0)
    with mock.patch.dict(os.environ, {**vllm_placement.IN_PROCESS, **environment}):
        llm = vllm_placement.start_vllm(str(folder / "policy"), bf16=False, seed=0, max_model_len=408,
                                        enforce_eager=True, gpu_memory_utilization=0.3)
        generator = torch.Generator().manual_seed(1)
        seen = [torch.randint(2, 64, (390,), generator=generator).tolist() for _ in range(2)]
        unseen = [seen[0][:256] + torch.randint(2, 64, (100,), generator=generator).tolist()]
        gaps = [engine_logprob_gap(llm, old, seen, generation)]
        for policy in (new, old):
            weight_transport.load_engine_weights(llm, policy)
            gaps.append(engine_logprob_gap(llm, policy, seen + unseen, generation))
    return gaps


@pytest.mark.slow
def test_an_engine_samples_long_repeated_prompts_with_the_weights_it_loaded_last(tmp_path):
    """vLLM keeps the KV of every full block of a prompt (prefix caching) and a weight load does not clear it:
    a prompt seen before the load would then be continued from KV computed with the old weights (0.185 per
    token off here). After each load the engine's log-probs of its samples must be the new weights' own."""
    gaps = logprob_gaps_around_loads(tmp_path, {"VLLM_CPU_KVCACHE_SPACE": "1", "CUDA_VISIBLE_DEVICES": ""}, "cpu")
    assert max(gaps) < 1e-5, f"engine log-probs off by {gaps} per token before, after the first and second load"
