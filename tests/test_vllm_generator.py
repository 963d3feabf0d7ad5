"""The vLLM generator's rules, on hand-written values: which weights sample each batch (the staleness
rule) and what the engine's placement decides."""

import os
from types import SimpleNamespace

import pytest

import vllm_generator


def test_the_staleness_rule_is_the_papers():
    """Batch t is sampled with the weights after update t-1-K; a resumed run's first batches with the
    checkpoint's weights (version 5 here), never with older ones it no longer has."""
    assert [vllm_generator.sampling_version(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]  # synchronous
    assert [vllm_generator.sampling_version(t, 1) for t in range(1, 5)] == [0, 0, 1, 2]  # batch 1 on-policy
    assert [vllm_generator.sampling_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]
    assert [vllm_generator.sampling_version(t, 1, first_version=5) for t in range(6, 9)] == [5, 5, 6]


def placement_args(**overrides):
    return SimpleNamespace(**{"vllm_device": "cpu", "vllm_cpu_threads": 1, "vllm_cpu_kv_cache_gib": 1,
                              **overrides})


def test_the_placement_decides_cores_turns_and_transport(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    own_cores = vllm_generator.engine_placement(placement_args(vllm_cpu_threads=1), world_size=1)
    assert (own_cores.engine_cores, own_cores.trainer_cores) == ([3], [0, 1, 2])
    assert own_cores.environment["VLLM_CPU_OMP_THREADS_BIND"] == "3" and not own_cores.takes_turns
    shared = vllm_generator.engine_placement(placement_args(vllm_device="shared"), world_size=1)
    assert shared.engine_cores == shared.trainer_cores == [0, 1, 2, 3] and shared.takes_turns
    gpu = vllm_generator.engine_placement(placement_args(vllm_device="cuda:3"), world_size=3)
    assert gpu.environment["CUDA_VISIBLE_DEVICES"] == "3" and not gpu.takes_turns
    # weights over NCCL only between two GPUs: gloo on a CPU and within the trainer's own device
    assert [p.weights_over_nccl for p in (own_cores, shared, gpu)] == [False, False, True]
    assert [p.weight_device for p in (own_cores, shared, gpu)] == ["cpu", "cpu", "cuda"]


@pytest.mark.parametrize(("overrides", "world_size", "message"), [
    ({"vllm_device": "shared"}, 2, "--vllm_device shared puts the engine on the device of a single training rank"),
    ({"vllm_device": "tpu"}, 1, "--vllm_device 'tpu' is none of 'cpu', 'cuda:<index>' and 'shared'"),
    ({"vllm_cpu_threads": 4}, 1, "--vllm_cpu_threads 4 must leave the trainer at least one of the 4 cores"),
])
def test_a_bad_placement_fails_on_one_line(monkeypatch, overrides, world_size, message):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    with pytest.raises(SystemExit, match=message):
        vllm_generator.engine_placement(placement_args(**overrides), world_size)
