"""LoRA (--use_peft) in the RL scripts: the policy with a peft adapter, its reference (the same model with the
adapter off, no second copy), and the checks of the LoRA flags. The weights the engine samples with, the
adapter merged in, are common.merged_weights (a merged save writes them too)."""

import torch

import common


def check_args(args):
    """The LoRA flags, and that --lora_target_modules names layers of the policy, before anything is written."""
    common.check_signs(args, ("lora_r", "lora_alpha"))
    if not 0 <= args.lora_dropout < 1:
        common.fail(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if not args.use_peft and args.save_merged:
        common.fail("--save_merged merges a LoRA adapter into the saved policy: it needs --use_peft")
    if args.use_peft:
        check_targets(args.model_name_or_path, args.lora_target_modules)


def check_targets(model_path: str, targets: list[str]):
    """Each of --lora_target_modules names layers of the policy (peft itself fails only when none does), checked
    on the architecture alone (meta tensors: nothing loaded) before anything is written."""
    if targets == ["all-linear"]:
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


def with_lora(model, args, task_type: str):
    """`model` with a LoRA adapter (peft) on --lora_target_modules: only the adapter trains (and, for a
    sequence classifier such as PPO's value model, its head: peft's modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    config = LoraConfig(task_type=task_type, r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules="all-linear" if targets == ["all-linear"] else targets)
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # e.g. no layer of that name
        common.fail(f"--lora_target_modules {' '.join(targets)} on {type(model).__name__}: "
                    f"{' '.join(str(error).split())[:300]} (layer names as in the model's named_modules, or "
                    "all-linear)")


def load_policy(args, dtype, reference: bool = True):
    """The policy to train and its frozen reference, both --model_name_or_path with dropout off. With
    --use_peft the policy carries a LoRA adapter and the reference is None: the same model with the adapter
    switched off (reference_policy), not a second copy in memory. Without `reference` no copy is loaded."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
    common.disable_dropout(policy)  # before the adapter: --lora_dropout stays as given
    if args.use_peft:
        return with_lora(policy, args, "CAUSAL_LM"), None
    if not reference:
        return policy, None
    ref_policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
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


def reference_policy(args, ref_policy, engine, part: str | None = None):
    """The frozen reference policy, ready to call: its own copy under DeepSpeed (ZeRO-3 partitions it too), or
    with --use_peft (`ref_policy` None) the engine's policy with its adapter off. `part`: the policy's
    attribute name when the engine trains more than the policy (PPO)."""
    if ref_policy is None:
        return AdapterOff(engine.module if part is None else getattr(engine.module, part))
    return common.prepare_deepspeed(ref_policy, args).module


def trainable_parameters(model) -> dict[str, float]:
    """model/trainable_parameters and model/trainable_share (of all of the model's parameters)."""
    counts = [(p.numel(), p.requires_grad) for p in model.parameters()]
    trainable = sum(n for n, requires_grad in counts if requires_grad)
    return {"model/trainable_parameters": trainable, "model/trainable_share": trainable / sum(n for n, _ in counts)}
