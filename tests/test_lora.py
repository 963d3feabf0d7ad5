"""LoRA (--use_peft): the weights the engine samples with equal peft's own merge on every policy
architecture, the reference is the base model, and the scripts learn, resume exactly and save an adapter
that peft loads, synchronous and asynchronous. Two ranks at ZeRO-3 with LoRA: test_two_ranks.py; a
researcher's Qwen2 chat policy with a BERT reward model: test_own_inputs*.py."""

import copy
import json
import shutil

import pytest
import torch
from own_inputs import policies
from scripts import (
    assert_learns,
    assert_same_weights_and_metrics,
    read_metrics,
    run_script,
)

import common
import lora
import toy

LORA = lora.LoraArgs(use_peft=True, lora_r=4, lora_alpha=8)


def policy_with_trained_adapter(name: str):
    """A freshly initialised policy of architecture `name` with a LoRA adapter whose B is not zero (as after
    training: at initialisation B A is 0 and any merge would pass)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(policies()[name][0])
    common.disable_dropout(policy)  # as lora.load_policy does (GPT-2's config has dropout)
    policy = lora.with_lora(policy, LORA, "CAUSAL_LM")
    for parameter_name, parameter in policy.named_parameters():
        if "lora_B" in parameter_name:
            parameter.data.normal_()
    return policy


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox", "gpt2"])
def test_merged_weights_equal_peft_merge_and_the_reference_is_the_base_model(name):
    policy = policy_with_trained_adapter(name)
    base = copy.deepcopy(policy.get_base_model())  # still holding the adapter's layers: unloaded below
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    sent = {weight_name: make() for weight_name, _, make in lora.merged_weights(policy)}
    assert list(sent) == list(merged)  # the plain architecture's names, in its order
    assert all(torch.equal(sent[n], merged[n]) for n in merged)
    adapted = [n for n, made_of, _ in lora.merged_weights(policy) if len(made_of) == 3]
    assert adapted and all(not torch.equal(sent[n], base.get_parameter(n.replace(".weight", ".base_layer.weight")))
                           for n in adapted)  # the adapter is in what is sent
    # the trained model's own base weights are untouched (merged out of place)
    assert all(torch.equal(p, base.get_parameter(n.removeprefix("base_model.model.")))
               for n, p in policy.named_parameters() if "base_layer" in n)

    input_ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        reference = lora.AdapterOff(policy)(input_ids=input_ids).logits
        with_adapter = policy(input_ids=input_ids).logits
        unloaded = copy.deepcopy(policy).unload()  # the base model without the adapter's layers
        assert torch.equal(reference, unloaded(input_ids=input_ids).logits)
    assert not torch.allclose(reference, with_adapter)


def test_the_default_targets_are_the_attention_and_mlp_projections():
    targets = {name: sorted({n.split(".")[-2] for n, made_of, _ in lora.merged_weights(
        policy_with_trained_adapter(name)) if len(made_of) == 3}) for name in ("llama", "gpt_neox", "gpt2")}
    assert targets == {
        "llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
        "gpt_neox": ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"],
        "gpt2": ["c_attn", "c_fc", "c_proj"],
    }


# The toy run (scripts.TOY_RUN: 5 updates of 64 prompts, checkpoints every 2) with LoRA, evaluated before and
# after, at the learning rate LoRA takes: 1e-3, and 2e-3 for DPO, which gains 0.07 in 5 updates at 1e-3 (0.52
# at 2e-3, asynchronous 0.52-0.59; at 1e-4 without LoRA it also needs about 10 updates, test_online_dpo.py)
LORA_RUN = ["--total_episodes", "320", "--eval_every", "5", "--eval_num_prompts", "128", "--save_every", "2",
            "--use_peft"]


def resumed_from_checkpoint_4(whole, resumed, script, args):
    """A copy of the `whole` run at its checkpoint 4, resumed: it trains update 5 from the checkpoint alone."""
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("policy", "policy_merged", "wandb"))
    run_script(*args, "--output_dir", resumed, "--resume", script=script)


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_dpo")
    args = [*LORA_RUN, "--learning_rate", "2e-3", "--lora_dropout", "0.05", "--save_merged"]
    run_script(*args, "--output_dir", folder / "whole", script="online_dpo.py")
    resumed_from_checkpoint_4(folder / "whole", folder / "resumed", "online_dpo.py", args)
    return folder / "whole", folder / "resumed"


@pytest.mark.slow
def test_online_dpo_learns_with_lora_and_resumes_exactly(dpo_runs):
    whole, resumed = dpo_runs
    assert_learns(whole)
    assert_same_weights_and_metrics(whole, resumed, ["loss/policy_avg", "objective/scores", "eval/gold_win_rate"],
                                    after_update=4)


@pytest.mark.slow
def test_checkpoints_hold_the_adapter_and_the_saved_adapter_loads_with_peft(dpo_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    whole, _ = dpo_runs
    counts = read_metrics(whole)[0]
    assert counts["model/trainable_parameters"] > 0 and counts["model/trainable_share"] < 0.25, counts
    # the checkpoint's module state is the adapter alone; the base is never saved
    saved = torch.load(whole / "checkpoints" / "update-4" / "engine" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"]
    assert saved and all("lora_" in name for name in saved), list(saved)[:5]
    assert sum(tensor.numel() for tensor in saved.values()) == counts["model/trainable_parameters"]
    config = json.loads((whole / "policy" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (16, 32, 0.05)
    # peft's own merge of the saved adapter is the merged policy the run saved (what the engine samples from)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(toy.SFT_POLICY), whole / "policy")
    by_peft = adapter.merge_and_unload().state_dict()
    merged, info = AutoModelForCausalLM.from_pretrained(whole / "policy_merged", output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert by_peft.keys() == merged.state_dict().keys()
    assert all(torch.equal(by_peft[name], merged.state_dict()[name]) for name in by_peft)
    assert json.loads((whole / "policy_merged" / "trained.json").read_text())["update"] == 5


@pytest.mark.slow
def test_eval_checkpoints_evaluates_lora_snapshots(dpo_runs, tmp_path):
    whole, _ = dpo_runs
    out = tmp_path / "eval"
    run_script("--run_dir", whole, "--output_dir", out, script="eval_checkpoints.py")
    table = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [row["update"] for row in table] == [0, 2, 4, 5]
    trained = {m["update"]: m for m in read_metrics(whole) if "eval/gold_win_rate" in m}
    for update in (0, 5):  # the updates the run itself evaluated
        row = next(row for row in table if row["update"] == update)
        assert row["eval/gold_win_rate"] == pytest.approx(trained[update]["eval/gold_win_rate"], abs=1e-7)


@pytest.mark.slow
# heavy (not in CI): ppo.py's adapters are ppo_vllm.py's, online DPO's LoRA learns (and resumes) in the synchronous
# script and the engine's merged adapter is checked with ppo_vllm.py's
@pytest.mark.parametrize("script", [*(pytest.param(script, marks=pytest.mark.heavy)
                                      for script in ("ppo.py", "online_dpo_vllm.py")), "ppo_vllm.py"])
def test_learns_with_lora(tmp_path, script):
    """PPO (its value model with an adapter of its own and its head) and the asynchronous scripts (K=1: the
    engine samples from the adapter merged into each weight send) beat the SFT policy."""
    out = tmp_path / "run"
    checked = ["--logprob_check_every", "1"] if script.endswith("_vllm.py") else []
    learning_rate = "2e-3" if script.startswith("online_dpo") else "1e-3"  # DPO learns to stop slower at 1e-3
    run_script(*LORA_RUN, "--learning_rate", learning_rate, *checked, "--output_dir", out, script=script)
    assert_learns(out)
    train = [m for m in read_metrics(out) if "loss/policy_avg" in m]
    if script.endswith("_vllm.py"):  # the engine's log-probs are the trainer's: it holds base + adapter
        assert [m["async/staleness"] for m in train] == [0, 1, 1, 1, 1]
        # the fp32 level: the engine's merged weights against the trainer's base + adapter (measured: 4e-7)
        assert max(m["async/logprob_diff"] for m in train) < 1e-6, [m["async/logprob_diff"] for m in train]
    if script.startswith("ppo"):  # policy and value model each train their adapter, the value head in full
        saved = torch.load(out / "checkpoints" / "update-4" / "engine" / "mp_rank_00_model_states.pt",
                           weights_only=False)["module"]
        assert {name.split(".")[0] for name in saved} == {"policy", "value_model"}
        assert all("lora_" in name or "modules_to_save" in name for name in saved), list(saved)
