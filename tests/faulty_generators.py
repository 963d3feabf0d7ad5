"""Generator processes with an injected fault, for online_dpo_vllm.py's fault tests.

The generator runs in a spawned process, which imports this module and calls the function that
replaced vllm_generator.generate_ahead in the trainer (tests/run_with_faulty_generator.py); the fault is
injected there, in the generator's own copy of vllm_generator (or of weight_transport).
"""

import os
import time

import rollouts
import vllm_generator
import weight_transport


def with_fault(function, fault, at_call: int):
    """`function`, calling `fault()` first at its `at_call`-th call."""
    calls = []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            fault()
        return function(*args, **kwargs)

    return faulty


def raise_fault():
    raise RuntimeError("injected generator fault")


def failing_generate_ahead(*args):
    """Raises at the second batch (the evaluations between batches sample too, but not through sample_batch)."""
    rollouts.sample_batch = with_fault(rollouts.sample_batch, raise_fault, at_call=2)
    vllm_generator.generate_ahead(*args)


def never_starting_generate_ahead(*args):
    """Never reports that its engine has started."""
    time.sleep(3600)


def hanging_generate_ahead(*args):
    """Hangs at batch 3, which checkpoint 2 waits for (it saves the batches sampled ahead)."""
    rollouts.sample_batch = with_fault(rollouts.sample_batch, lambda: time.sleep(3600), at_call=3)
    vllm_generator.generate_ahead(*args)


def stale_engine_generate_ahead(*args):
    """Receives every weight version but never loads one into the engine: it keeps sampling with the
    starting weights, as vLLM bugs have done."""
    weight_transport.load_engine_weights = lambda llm, model, in_flight=False: None
    vllm_generator.generate_ahead(*args)


def partly_loading_generate_ahead(*args):
    """Loads each weight version with its linear layers' weights 10% off: the tensors vLLM keeps one-to-one
    (embeddings, norms), which the exact check compares, are right, the fused and repacked ones wrong."""

    def load_engine_weights(llm, model, in_flight=False):
        weights = ((name, tensor * 1.1 if name.endswith("proj.weight") else tensor)  # the toy's Llama layers
                   for name, tensor in model.state_dict().items())
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

    weight_transport.load_engine_weights = load_engine_weights
    vllm_generator.generate_ahead(*args)


def hanging_receiver_generate_ahead(*args):
    """Its weight receiver hangs at the first version the trainer sends (opening its shared buffer)."""
    weight_transport.SharedWeights = lambda *args: time.sleep(3600)
    vllm_generator.generate_ahead(*args)


def dying_before_connecting_generate_ahead(*args):
    """Starts its engine, then dies when the trainer has it connect the weight channel (NCCL, on a GPU)."""
    weight_transport.weight_channel = lambda *args: os._exit(1)
    vllm_generator.generate_ahead(*args)
