"""LoRA (--use_peft): the weights the engine samples with equal peft's own merge on every policy
architecture, the reference is the base model, and the scripts learn, resume exactly and save an adapter
that peft loads, synchronous and asynchronous, on one rank and two (ZeRO-3)."""

import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from own_inputs import policies
from scripts import (
    TOY_RUN,
    assert_learns,
    assert_same_weights_and_metrics,
    read_metrics,
    run_script,
)

import common
import toy

LORA = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"])


def policy_with_trained_adapter(name: str):
    """A freshly initialised policy of architecture `name` with a LoRA adapter whose B is not zero (as after
    training: at initialisation B A is 0 and any merge would pass)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(policies()[name][0])
    common.disable_dropout(policy)  # as common.load_policy does (GPT-2's config has dropout)
    policy = common.with_lora(policy, LORA, "CAUSAL_LM")
    for parameter_name, parameter in policy.named_parameters():
        if "lora_B" in parameter_name:
            parameter.data.normal_()
    return policy


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox", "gpt2"])
def test_merged_weights_equal_peft_merge_and_the_reference_is_the_base_model(name):
    policy = policy_with_trained_adapter(name)
    base = copy.deepcopy(policy.get_base_model())  # still holding the adapter's layers: unloaded below
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    sent = {weight_name: make() for weight_name, _, make in common.merged_weights(policy)}
    assert list(sent) == list(merged)  # the plain architecture's names, in its order
    assert all(torch.equal(sent[n], merged[n]) for n in merged)
    adapted = [n for n, made_of, _ in common.merged_weights(policy) if len(made_of) == 3]
    assert adapted and all(not torch.equal(sent[n], base.get_parameter(n.replace(".weight", ".base_layer.weight")))
                           for n in adapted)  # the adapter is in what is sent
    # the trained model's own base weights are untouched (merged out of place)
    assert all(torch.equal(p, base.get_parameter(n.removeprefix("base_model.model.")))
               for n, p in policy.named_parameters() if "base_layer" in n)

    input_ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        reference = common.AdapterOff(policy)(input_ids=input_ids).logits
        with_adapter = policy(input_ids=input_ids).logits
        unloaded = copy.deepcopy(policy).unload()  # the base model without the adapter's layers
        assert torch.equal(reference, unloaded(input_ids=input_ids).logits)
    assert not torch.allclose(reference, with_adapter)


def test_the_default_targets_are_the_attention_and_mlp_projections():
    targets = {name: sorted({n.split(".")[-2] for n, made_of, _ in common.merged_weights(
        policy_with_trained_adapter(name)) if len(made_of) == 3}) for name in ("llama", "gpt_neox", "gpt2")}
    assert targets == {
        "llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
        "gpt_neox": ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"],
        "gpt2": ["c_attn", "c_fc", "c_proj"],
    }
