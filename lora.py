"""LoRA (--use_peft) in the RL scripts: its flags (LoraArgs) and their checks, the policy with a peft adapter,
its reference (the same model with the adapter off, no second copy), and the policy's weights as a plain model
with the adapter merged in (merged_weights: what the vLLM engine samples with, what a merged save writes)."""

import dataclasses
import functools
from dataclasses import dataclass

import torch

import common


@dataclass
class LoraArgs(common.FlagGroup):
    """LoRA: a low-rank adapter trained instead of every weight"""

    use_peft: bool = False
    """train a LoRA adapter (peft) instead of every weight: the reference policy is the same model with the
    adapter switched off (no second copy in memory); checkpoints hold the adapter and its optimizer state;
    policy/ is the adapter; a vLLM engine samples from base + adapter, merged out of place into each weight
    send; PPO's value model gets an adapter too (its score head trains whole)"""
    lora_r: int = 16
    """LoRA rank r of each adapted layer's update B A"""
    lora_alpha: int = 32
    """LoRA scale: the update is (lora_alpha / lora_r) B A"""
    lora_dropout: float = 0.0
    """dropout on each adapted layer's input to A while the model is in training mode; 0 keeps the policy's
    log-probs the same in every forward (as the kit's dropout-free models do), which the logged KL and the
    importance ratios assume"""
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    """layer names to adapt (as in the model's named_modules, e.g. q_proj v_proj), or all-linear: every linear
    layer but the output layer (attention and MLP projections of Llama, Qwen2, GPT-NeoX/Pythia, GPT-2)"""
    save_merged: bool = False
    """also write the policy with the adapter merged in, a plain model (what vLLM and from_pretrained load), to
    policy_merged/ (with --use_peft)"""

    def check(self):
        common.check_signs(self, ("lora_r", "lora_alpha"))
        if not 0 <= self.lora_dropout < 1:
            common.fail(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.use_peft and self.save_merged:
            common.fail("--save_merged merges a LoRA adapter into the saved policy: it needs --use_peft")


def check_targets(lora: LoraArgs, model_path: str):
    """With --use_peft, each of --lora_target_modules names layers of the policy (peft itself fails only when
    none does), checked on the architecture alone (meta tensors: nothing loaded) before anything is written."""
    targets = lora.lora_target_modules
    if not lora.use_peft or targets == ["all-linear"]:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    names = [name for name, _ in model.named_modules()]
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            linear = sorted({name.split(".")[-1] for name, module in model.named_modules()
                             if type(module).__name__ in ("Linear", "Conv1D")})
            common.fail(f"--lora_target_modules {target!r} names no layer of {model_path!r}; its linear layers are "
                        f"{' '.join(linear)} (or give all-linear)")


def with_lora(model, lora: LoraArgs, task_type: str):
    """`model` with a LoRA adapter (peft) on --lora_target_modules: only the adapter trains (and, for a
    sequence classifier such as PPO's value model, its head: peft's modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    targets = lora.lora_target_modules
    config = LoraConfig(task_type=task_type, r=lora.lora_r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                        target_modules="all-linear" if targets == ["all-linear"] else targets)
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # e.g. no layer of that name
        common.fail(f"--lora_target_modules {' '.join(targets)} on {type(model).__name__}: "
                    f"{' '.join(str(error).split())[:300]} (layer names as in the model's named_modules, or "
                    "all-linear)")


def load_policy(model_path: str, lora: LoraArgs, dtype, reference: bool = True):
    """The policy to train and its frozen reference, both `model_path` (--model_name_or_path) with dropout off.
    With --use_peft the policy carries a LoRA adapter and the reference is None: the same model with the
    adapter switched off (reference_policy), not a second copy in memory. Without `reference` no copy is
    loaded."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    common.disable_dropout(policy)  # before the adapter: --lora_dropout stays as given
    if lora.use_peft:
        return with_lora(policy, lora, "CAUSAL_LM"), None
    if not reference:
        return policy, None
    ref_policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    common.disable_dropout(ref_policy)
    return policy, ref_policy


class AdapterOff:
    """A LoRA policy with its adapter switched off, called like a model: the base model it started from,
    i.e. the reference policy, without a second copy in memory."""

    def __init__(self, policy):
        self.policy = policy  # a peft model

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)


def reference_policy(distributed: common.DistributedArgs, ref_policy, ds_engine, part: str | None = None):
    """The frozen reference policy, ready to call: its own copy under DeepSpeed (ZeRO-3 partitions it too), or
    with --use_peft (`ref_policy` None) the DeepSpeed engine's policy with its adapter off. `part`: the policy's
    attribute name when the DeepSpeed engine trains more than the policy (PPO)."""
    if ref_policy is None:
        return AdapterOff(ds_engine.module if part is None else getattr(ds_engine.module, part))
    return common.prepare_deepspeed(ref_policy, distributed).module


def trainable_parameters(model) -> dict[str, float]:
    """model/trainable_parameters and model/trainable_share (of all of the model's parameters)."""
    counts = [(p.numel(), p.requires_grad) for p in model.parameters()]
    trainable = sum(n for n, requires_grad in counts if requires_grad)
    return {"model/trainable_parameters": trainable, "model/trainable_share": trainable / sum(n for n, _ in counts)}


def merged_weights(model) -> list[tuple[str, list[torch.nn.Parameter], object]]:
    """The weights of the policy's plain architecture, in its parameter order (what the vLLM engine and a
    saved merged model hold): (name, the parameters the weight is made of, a function that makes it from
    them). Without an adapter each parameter is its own weight. A LoRA layer's weight is merged out of place,
    W + (alpha / r) B A (peft's get_delta_weight): the trained model's W never changes, where merging in place
    and back would drift in bf16."""
    weights = []
    for name, parameter in model.named_parameters():
        if ".lora_" in name:  # the adapter's own A and B
            continue
        plain_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")  # peft's wrapping
        if ".base_layer." in name and name.endswith(".weight"):
            layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
            adapter = [p for adapter_name, p in layer.named_parameters() if "lora_" in adapter_name]
            weights.append((plain_name, [parameter, *adapter], functools.partial(merge_lora, layer, parameter)))
        else:
            weights.append((plain_name, [parameter], functools.partial(torch.Tensor.detach, parameter)))
    return weights


@torch.no_grad()
def merge_lora(layer, weight: torch.Tensor) -> torch.Tensor:
    """W + (alpha / r) B A of a LoRA layer whose base weight is `weight`, a new tensor."""
    return weight + sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
