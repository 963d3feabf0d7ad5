"""Every synchronous script on a researcher's own inputs (tests/own_inputs.py): policies of four
architectures, encoder and decoder reward models, a reward function, prompt-only chat data. Each
case trains 2 updates, evaluates, and saves a policy that loads; the vLLM script's runs are in
test_own_inputs_vllm.py (its own file, so that the two run on different workers)."""

import json

import pytest
from own_inputs import build, case_argv, cases
from scripts import assert_trained_policy_saved, read_metrics, run_script

SYNC_SCRIPTS = ["online_dpo.py", "ppo.py", "rloo.py", "bok.py", "grpo.py"]


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    return build(tmp_path_factory.mktemp("own_inputs"))


def check_case(case: dict, out):
    metrics = read_metrics(out)
    train = [m for m in metrics if "loss/policy_avg" in m]
    evals = [m for m in metrics if "eval/kl" in m]
    assert [m["update"] for m in train] == [1, 2] and [m["update"] for m in evals] == [0, 1, 2]
    gold = {"eval/gold_win_rate", "eval/gold_score"}
    for m in evals:
        assert {"eval/proxy_score", "eval/kl", *case["eval"]} <= m.keys() and not (gold - set(case["eval"])) & m.keys()
    assert_trained_policy_saved(out, case["policy"])
    if "--use_peft" in case["flags"]:  # the adapter as asked for, which peft loaded above
        adapter = json.loads((out / "policy" / "adapter_config.json").read_text())
        assert (sorted(adapter["target_modules"]), adapter["r"], adapter["lora_alpha"]) == (["q_proj", "v_proj"], 4, 8)
    if case["policy"].endswith("gpt2"):  # its pad token is its stop token: completions that stop count as stopped
        assert all(m["val/num_eos_tokens"] > 0 for m in train) and max(m["eval/proxy_score"] for m in evals) > -1
    recorded = json.loads((out / "args.json").read_text())
    assert recorded["args"]["model_name_or_path"] == case["policy"] and recorded["versions"]["torch"]
    return train, evals


# the fast tier runs every case through online DPO; the whole suite through each synchronous script
@pytest.mark.parametrize("script", [script if script == "online_dpo.py" else
                                    pytest.param(script, marks=pytest.mark.slow) for script in SYNC_SCRIPTS])
def test_every_case_trains_evaluates_and_saves(tmp_path, artefacts, script):
    own = cases(artefacts)
    argvs = [case_argv(script, case, tmp_path / f"case{i}") for i, case in enumerate(own.values())]
    result = run_script(script.removesuffix(".py"), json.dumps(argvs), script="tests/run_in_one_process.py")
    outcomes = json.loads(result.stdout.split("RESULTS ")[-1])
    assert outcomes == ["finished without an error"] * len(own), dict(zip(own, outcomes))
    for i, (name, case) in enumerate(own.items()):
        train, evals = check_case(case, tmp_path / f"case{i}")
        if "reward function" in name:  # the function's 0/1, or the -1 penalty: a mean over 8 prompts
            assert all(round(8 * m["eval/proxy_score"], 6).is_integer() for m in evals), evals


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt_neox", "gpt2"])
def test_left_padded_log_probs_equal_the_sampling_ones(artefacts, name):
    """Rows of different prompt lengths, left-padded: the trainer's log-probs of the sampled tokens
    equal those HF generate sampled them from, and those of each row scored alone, without padding."""
    import torch
    from own_inputs import questions
    from transformers import AutoModelForCausalLM

    import common
    import data

    policy = AutoModelForCausalLM.from_pretrained(artefacts[name]).eval()
    tokenizer = data.load_tokenizer(artefacts[name])
    eos_ids, pad, temperature = data.eos_token_ids(artefacts[name], tokenizer), tokenizer.pad_token_id, 0.7
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"]
               for text in ("two ?", questions()[0][0], "what is one plus one ? the answer is")]
    query_ids, query_mask = common.left_pad(prompts, pad, "cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        out = policy.generate(input_ids=query_ids, attention_mask=query_mask, do_sample=True, max_new_tokens=6,
                              temperature=temperature + 1e-7, top_k=0, top_p=1.0, eos_token_id=eos_ids,
                              pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
        responses, lengths, _ = common.truncate_after_eos(out.sequences[:, query_ids.shape[1]:], eos_ids, pad)
        # (rows, new tokens, vocab): the scores HF sampled from, after its own temperature warper; their
        # log-softmax is computed here by hand, independently of the kit's logprobs_from_logits
        sampled_from = torch.stack(out.scores, dim=1)
        expected = torch.log_softmax(sampled_from.float(), dim=-1).gather(
            -1, responses[:, :sampled_from.shape[1], None]).squeeze(-1)
        padded = common.response_logprobs(policy, query_ids, query_mask, responses, lengths, temperature)
        alone = [common.response_logprobs(policy, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                                          responses[i:i + 1], lengths[i:i + 1], temperature)[0]
                 for i, p in enumerate(prompts)]
    mask = common.response_mask(lengths, responses.shape[1])
    assert mask.sum() >= 6
    for i in range(len(prompts)):
        real = mask[i]
        assert torch.allclose(padded[i][real], expected[i][real[:expected.shape[1]]], atol=1e-4), (name, i)
        assert torch.allclose(padded[i][real], alone[i][real], atol=1e-4), (name, i)
