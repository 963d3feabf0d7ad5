"""Unit tests of the shared rollout details, on hand-computed numbers and tiny local models."""

import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import word_tokenizer
from scripts import free_port

import common
import data
import math_reward
import outputs

PAD, EOS, OTHER_EOS = 0, 1, 7


# ---- truncation after the first stop token ----------------------------------------------------
def test_truncation_no_eos_keeps_everything():
    responses = torch.tensor([[5, 6, 5, 6]])
    truncated, lengths, contains_eos = common.truncate_after_eos(responses, [EOS], PAD)
    assert truncated.tolist() == [[5, 6, 5, 6]]
    assert lengths.tolist() == [4] and contains_eos.tolist() == [False]


def test_truncation_pads_after_first_eos_and_keeps_it():
    responses = torch.tensor([[5, EOS, 6, EOS], [EOS, 5, 6, 5]])
    truncated, lengths, contains_eos = common.truncate_after_eos(responses, [EOS], PAD)
    assert truncated.tolist() == [[5, EOS, PAD, PAD], [EOS, PAD, PAD, PAD]]
    assert lengths.tolist() == [2, 1]  # EOS first: a one-token response
    assert contains_eos.tolist() == [True, True]


def test_truncation_honours_every_eos_id():
    responses = torch.tensor([[5, OTHER_EOS, 6, EOS], [5, 6, EOS, OTHER_EOS]])
    truncated, lengths, _ = common.truncate_after_eos(responses, [EOS, OTHER_EOS], PAD)
    assert truncated.tolist() == [[5, OTHER_EOS, PAD, PAD], [5, 6, EOS, PAD]]
    assert lengths.tolist() == [2, 3]


def test_a_rollout_drops_the_columns_that_are_padding_in_every_row():
    task = SimpleNamespace(eos_ids=[EOS], tokenizer=SimpleNamespace(pad_token_id=PAD))
    responses = torch.tensor([[5, EOS, 6, 6, 6], [5, 6, EOS, 5, 5], [EOS, PAD, PAD, PAD, PAD]])
    rollout = common.truncate_rollout(torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2), responses, task)
    assert rollout.responses.tolist() == [[5, EOS, PAD], [5, 6, EOS], [EOS, PAD, PAD]]
    assert rollout.mask.tolist() == [[True, True, False], [True] * 3, [True, False, False]]


def test_truncation_with_eos_equal_to_pad():
    # generate pads finished rows with the pad id, which here is also the stop token
    responses = torch.tensor([[5, 6, 0, 0], [5, 6, 5, 6]])
    truncated, lengths, contains_eos = common.truncate_after_eos(responses, [0], 0)
    assert lengths.tolist() == [3, 4] and contains_eos.tolist() == [True, False]
    assert common.response_mask(lengths, 4).tolist() == [[True, True, True, False], [True] * 4]
    assert truncated.tolist() == [[5, 6, 0, 0], [5, 6, 5, 6]]


# ---- log-probs -----------------------------------------------------------------------------------
def test_logprobs_use_temperature():
    logits = torch.tensor([[[math.log(1.0), math.log(3.0)]]])  # probabilities 1/4, 3/4 at temperature 1
    assert common.logprobs_from_logits(logits, torch.tensor([[1]]), 1.0).item() == pytest.approx(math.log(0.75))
    # temperature 0.5 squares the odds: 1:9
    assert common.logprobs_from_logits(logits, torch.tensor([[1]]), 0.5).item() == pytest.approx(math.log(0.9), 1e-5)


def test_top_p_logprobs_are_those_of_the_renormalized_nucleus():
    logits = torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]).log().repeat(1, 3, 1)  # probabilities at temperature 1
    tokens = torch.tensor([[0, 1, 2]])
    # top_p 0.7: the nucleus is {0.5, 0.3} (0.05 + 0.15 <= 0.3 are cut); a token outside it keeps its own mass
    expected = [math.log(0.5 / 0.8), math.log(0.3 / 0.8), math.log(0.15 / 0.95)]
    assert common.logprobs_from_logits(logits, tokens, 1.0, top_p=0.7)[0].tolist() == pytest.approx(expected)
    assert common.logprobs_from_logits(logits, tokens, 1.0)[0].tolist() == pytest.approx([math.log(p) for p in
                                                                                          (0.5, 0.3, 0.15)])


def test_top_p_logprobs_equal_those_hf_generate_sampled_from():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import toy

    toy.build()
    policy = AutoModelForCausalLM.from_pretrained(toy.SFT_POLICY)
    tokenizer = AutoTokenizer.from_pretrained(toy.SFT_POLICY)
    query = tokenizer(["SUBREDDIT: r/pets POST: my dog got a new collar TL;DR:"] * 8, return_tensors="pt")
    torch.manual_seed(0)
    output = policy.generate(**query, do_sample=True, temperature=0.7, top_p=0.8, top_k=0, max_new_tokens=6,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    tokens = output.sequences[:, query["input_ids"].shape[1]:]  # (8, 6), the scores below after temperature and top_p
    sampled_from = torch.stack(output.scores, dim=1).log_softmax(-1).gather(2, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        logits = policy(output.sequences).logits[:, query["input_ids"].shape[1] - 1:-1]
    ours = common.logprobs_from_logits(logits, tokens, 0.7, top_p=0.8)
    stopped = (tokens == tokenizer.eos_token_id).cumsum(1) - (tokens == tokenizer.eos_token_id).long() > 0
    torch.testing.assert_close(ours[~stopped], sampled_from[~stopped], atol=1e-4, rtol=0)
    assert (ours[~stopped] > common.logprobs_from_logits(logits, tokens, 0.7)[~stopped]).any()  # truncation mattered


def test_one_rank_trains_at_stage_0_with_the_plain_clipped_adamw_step(tiny_dir, monkeypatch):
    """ZeRO-2 on a single rank runs as stage 0 without the gradient all-reduce; its step is exactly
    clip_grad_norm_ + AdamW."""
    from transformers import AutoModelForCausalLM

    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    common.load_deepspeed().init_distributed("gloo")
    try:
        training = common.OptimizerArgs(per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                        max_grad_norm=0.01)  # small enough that the clipping acts
        ours, plain = (AutoModelForCausalLM.from_pretrained(tiny_dir / "policy") for _ in range(2))
        engine = common.prepare_deepspeed(ours, common.DistributedArgs(zero_stage=2), training,
                                          torch.optim.AdamW(ours.parameters(), lr=1e-2))
        assert engine.zero_optimization_stage() == 0 and not engine.enable_backward_allreduce
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        input_ids = torch.tensor([[2, 3, 4, 5], [5, 4, 3, 2], [3, 3, 4, 4], [2, 5, 2, 5]])
        for _ in range(2):
            engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
            engine.step()
            plain(input_ids=input_ids, labels=input_ids).loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), training.max_grad_norm)
            assert norm > 10 * training.max_grad_norm
            optimizer.step()
            optimizer.zero_grad()
        for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a, b, msg=name)
    finally:
        torch.distributed.destroy_process_group()


def test_a_world_of_one_holds_its_rendezvous_port_while_deepspeed_loads(monkeypatch):
    """A plain `python script.py`'s rendezvous is bound from the start: a parallel job that binds the port it
    names while DeepSpeed loads (seconds, as CI's parallel tests did: EADDRINUSE) cannot take it. Twice, as a
    process that makes two runs."""
    import signal
    import socket

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # restored (absent) after the test, whatever init_distributed set
    load_deepspeed, taken = common.load_deepspeed, []

    def load_deepspeed_while_a_parallel_job_binds_the_port():
        thief = socket.socket()
        try:
            thief.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            taken.append(thief)
        except OSError:
            thief.close()
        return load_deepspeed()

    monkeypatch.setattr(common, "load_deepspeed", load_deepspeed_while_a_parallel_job_binds_the_port)
    handlers = {number: signal.getsignal(number) for number in common.PREEMPTION_SIGNALS}
    try:
        for _ in range(2):
            assert common.init_distributed() == (0, 1)
            total = torch.ones(1)
            torch.distributed.all_reduce(total)
            assert total.item() == 1 and not taken
            torch.distributed.destroy_process_group()
    finally:
        for thief in taken:
            thief.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for number, handler in handlers.items():
            signal.signal(number, handler)


# ---- the math reward -------------------------------------------------------------------------------
@pytest.mark.parametrize(("completion", "solution", "reward"), [
    ("7 + 8 = 15 , 3 + 4 + 1 = 8 #### 85", "... #### 85", 1.0),  # right
    ("7 + 8 = 15 , 3 + 4 = 7 #### 75", "... #### 85", 0.0),  # wrong
    ("7 + 8 = 15 , 3 + 4 + 1 = 8 so 85", "... #### 85", 0.0),  # no #### N
    ("She pays 1,200 dollars. #### 1,200", "Total: 1200 dollars.\n#### 1200", 1.0),  # commas removed
    ("#### -5", "#### -5", 1.0),  # negative numbers
    ("#### 5", "#### -5", 0.0),
    ("#### 12 and then #### 13", "#### 12", 1.0),  # several: the first counts
    ("#### 13 and then #### 12", "#### 12", 0.0),
    ("#### 2.50", "#### 2.5", 1.0),
])
def test_gsm8k_reward_on_hand_written_completions(completion, solution, reward):
    assert math_reward.gsm8k_reward(["a question"], [completion], [solution]) == [reward]


def test_masked_sum_and_mean_ignore_padding():
    values = torch.tensor([[1.0, 2.0, common.INVALID_LOGPROB], [4.0, common.INVALID_LOGPROB, common.INVALID_LOGPROB]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert common.masked_sum(values, mask).tolist() == [3.0, 4.0]
    assert common.masked_mean(values, mask) == pytest.approx(7 / 3)
    assert common.masked_mean(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])) == 0.0


def load_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return (AutoModelForCausalLM.from_pretrained(tiny_dir / "policy").eval(),
            AutoModelForSequenceClassification.from_pretrained(tiny_dir / "reward").eval())


def test_response_logprobs_match_manual_and_ignore_left_padding(tiny_dir):
    policy, _ = load_tiny(tiny_dir)
    query = torch.tensor([[4, 5, 6]])
    responses = torch.tensor([[7, 8, PAD]])
    lengths = torch.tensor([2])
    with torch.no_grad():
        got = common.response_logprobs(policy, query, torch.ones_like(query), responses, lengths, 0.7)
        logits = policy(torch.tensor([[4, 5, 6, 7, 8]])).logits[0] / (0.7 + 1e-7)
        manual = [logits[2].log_softmax(-1)[7], logits[3].log_softmax(-1)[8]]
        assert got[0, :2].tolist() == pytest.approx([m.item() for m in manual], abs=1e-5)
        assert got[0, 2].item() == common.INVALID_LOGPROB
        padded_query, padded_mask = common.left_pad([[4, 5, 6], [4, 5, 6, 7, 8]], PAD, "cpu")
        padded = common.response_logprobs(policy, padded_query, padded_mask, responses.repeat(2, 1),
                                          lengths.repeat(2), 0.7)
        assert padded[0, :2].tolist() == pytest.approx(got[0, :2].tolist(), abs=1e-5)


# ---- reward at the last real token ---------------------------------------------------------------
def test_reward_is_read_at_the_last_real_token(tiny_dir):
    _, reward_model = load_tiny(tiny_dir)
    tokenizer = word_tokenizer()
    query_ids, query_mask = common.left_pad([[4, 5], [4, 5, 6, 7]], PAD, "cpu")
    responses = torch.tensor([[8, EOS, PAD], [8, 9, 10]])
    lengths, contains_eos = torch.tensor([2, 3]), torch.tensor([True, False])
    with torch.no_grad():
        scores = common.score_responses(reward_model, query_ids, query_mask, responses, lengths, contains_eos,
                                        tokenizer)
        expected = [reward_model.score(reward_model.model(torch.tensor([row])).last_hidden_state[0, -1]).item()
                    for row in ([4, 5, 8, EOS], [4, 5, 6, 7, 8, 9, 10])]
    # unpadded, alone: neither the pad after EOS nor the left padding changes the score
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert expected[0] != pytest.approx(expected[1], abs=1e-3)


def test_rollout_metrics_count_eos_over_every_rank(monkeypatch):
    rollout = common.Rollout(query_ids=torch.ones(3, 2, dtype=torch.long), query_mask=torch.ones(3, 2),
                             responses=torch.tensor([[5, EOS], [5, 5], [EOS, PAD]]), lengths=torch.tensor([2, 2, 1]),
                             contains_eos=torch.tensor([True, False, True]))
    logprobs, ref_logprobs = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, 1.0]]), torch.full((3, 2), -1.0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)  # this rank's half of the batch
    metrics = common.rollout_metrics(rollout, logprobs, ref_logprobs, torch.tensor([1.0, -1.0, 3.0]), kl_coef=0.5)
    assert metrics["val/num_eos_tokens"] == 4  # 2 here, as many on the other rank (all_reduce_mean averages)
    kl = [-1.0, 0.0, -2.0]  # sums over real tokens only: the pad of row 3 holds INVALID_LOGPROB
    assert metrics["objective/kl"] == pytest.approx(sum(kl) / 3)
    assert metrics["objective/entropy"] == pytest.approx((3 + 2 + 3) / 3)
    assert metrics["objective/scores"] == pytest.approx(1.0)
    assert metrics["objective/rlhf_reward"] == pytest.approx(sum(s - 0.5 * k for s, k in zip([1, -1, 3], kl)) / 3)


def test_reward_model_with_another_tokenizer_sees_the_same_text(tiny_dir):
    _, reward_model = load_tiny(tiny_dir)
    policy_tokenizer = word_tokenizer()
    # same words, different ids and special tokens: the scores must come from decode + re-encode
    reward_tokenizer = word_tokenizer(words=list(reversed(word_tokenizer().convert_ids_to_tokens(range(3, 12)))),
                                      specials=("[PAD]", "[END]", "<unk>"))
    query = policy_tokenizer("the cat sat on", add_special_tokens=False)["input_ids"]
    response = policy_tokenizer("the mat <eos>", add_special_tokens=False)["input_ids"]
    query_ids, query_mask = common.left_pad([query], policy_tokenizer.pad_token_id, "cpu")
    responses, lengths, contains_eos = common.truncate_after_eos(torch.tensor([response + [PAD]]), [EOS], PAD)
    with torch.no_grad():
        score = common.score_responses(reward_model, query_ids, query_mask, responses, lengths, contains_eos,
                                       policy_tokenizer, reward_tokenizer)
        ids = reward_tokenizer("the cat sat on the mat [END]", add_special_tokens=False, return_tensors="pt")
        expected = reward_model(**ids).logits[0, 0]  # transformers' own scoring of the re-encoded text
    assert ids["input_ids"][0, -1].item() == reward_tokenizer.eos_token_id
    assert score.item() == pytest.approx(expected.item(), abs=1e-5)


def test_encoder_reward_model_scores_its_own_encoding_of_the_text():
    from own_inputs import WORDS, bert_wordpiece_tokenizer
    from transformers import BertConfig, BertForSequenceClassification

    policy_tokenizer = word_tokenizer(words=WORDS)
    bert_tokenizer = bert_wordpiece_tokenizer()  # [CLS] ... [SEP], right padding, no EOS
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(bert_tokenizer), hidden_size=32, num_labels=1,
                                                    num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=64)).eval()
    assert not common.is_decoder_classifier(bert) and bert_tokenizer.eos_token is None
    prompts, completions = ["what is one plus two ?", "what is two plus two ?"], [" three . <eos>", " four four"]
    query_ids, query_mask = common.left_pad([policy_tokenizer(p, add_special_tokens=False)["input_ids"]
                                             for p in prompts], policy_tokenizer.pad_token_id, "cpu")
    responses = [policy_tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    width = max(map(len, responses))
    responses = torch.tensor([r + [PAD] * (width - len(r)) for r in responses])
    responses, lengths, contains_eos = common.truncate_after_eos(responses, [policy_tokenizer.eos_token_id], PAD)
    with torch.no_grad():
        scores = common.score_responses(bert, query_ids, query_mask, responses, lengths, contains_eos,
                                        policy_tokenizer, bert_tokenizer)
        # alone, unpadded: its own special tokens around the words, no stop token text
        expected = [bert(**bert_tokenizer(text, return_tensors="pt")).logits[0, 0].item()
                    for text in ("what is one plus two? three.", "what is two plus two? four four")]
    assert bert_tokenizer("what is one plus two? three.")["input_ids"][0] == bert_tokenizer.cls_token_id
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_encoder_reward_model_reads_the_end_of_a_text_longer_than_its_positions():
    """A tokenizer with no model_max_length (as one built locally): the model's 16 positions are the limit,
    and the text keeps its end, the completion, and its special tokens."""
    from own_inputs import bert_wordpiece_tokenizer
    from transformers import BertConfig, BertForSequenceClassification

    bert_tokenizer = bert_wordpiece_tokenizer()
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(bert_tokenizer), hidden_size=32, num_labels=1,
                                                    num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=16)).eval()
    assert bert_tokenizer.model_max_length > 16
    long_prompt = "the cat sat on the mat " * 5  # 30 words
    with torch.no_grad():
        score = common.score_texts(bert, bert_tokenizer, [long_prompt + "red dog", "a cat"], [True, True])
        words = bert_tokenizer(long_prompt + "red dog", add_special_tokens=False)["input_ids"]
        end = bert_tokenizer.decode(words[-14:])  # 14 words and [CLS], [SEP]
        expected = bert(**bert_tokenizer(end, return_tensors="pt")).logits[0, 0].item()
    assert end.endswith("red dog") and score[0].item() == pytest.approx(expected, abs=1e-5)


def test_decoder_reward_model_whose_tokenizer_has_no_eos_gets_no_eos_text(tiny_dir):
    _, reward_model = load_tiny(tiny_dir)
    no_eos = word_tokenizer()
    no_eos.eos_token = None
    texts = ["the cat sat", "the cat sat"]
    with torch.no_grad():
        stopped, unstopped = common.score_texts(reward_model, no_eos, texts, [True, False]).tolist()
        with_eos = common.score_texts(reward_model, word_tokenizer(), texts, [True, False]).tolist()
    assert stopped == pytest.approx(unstopped, abs=1e-6)  # nothing appended for the stop
    assert with_eos[0] != pytest.approx(with_eos[1], abs=1e-4)  # "<eos>" appended where the completion stopped


def test_reward_function_gets_prompts_completions_and_the_other_columns_per_sample():
    import datasets

    tokenizer = word_tokenizer()
    calls = []

    def reward_fn(prompts, completions, answer, source):
        calls.append((prompts, completions, answer, source))
        return [float(a in c) for c, a in zip(completions, answer)]

    rows = datasets.Dataset.from_dict({"prompt": ["the cat", "the dog"], "answer": ["mat", "sat"],
                                       "source": ["a", "b"], "input_ids": [[3, 4], [3, 5]]})[[0, 1]]  # as sampled
    query_ids, query_mask = common.left_pad([[3, 4], [3, 4], [3, 5], [3, 5]], PAD, "cpu")
    mat, sat = tokenizer.convert_tokens_to_ids(["mat", "sat"])
    rollout = common.Rollout(query_ids, query_mask, torch.tensor([[mat, EOS], [sat, EOS], [mat, EOS], [sat, PAD]]),
                             torch.tensor([2, 2, 2, 1]), torch.tensor([True, True, True, False]))
    task = SimpleNamespace(tokenizer=tokenizer, reward_fn=reward_fn, reward_fn_name="test:reward_fn",
                           prompt_column="prompt")
    scores = common.function_rewards(task, rollout, rows, "update 3")
    assert scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    # completions as the policy wrote them after its prompt (here with the space the tokenizer puts there)
    assert calls == [(["the cat", "the cat", "the dog", "the dog"], [" mat", " sat", " mat", " sat"],
                      ["mat", "mat", "sat", "sat"], ["a", "a", "b", "b"])]


@pytest.mark.parametrize(("name", "message"), [
    ("raises", "update 3: --reward_fn tests/reward_fns.py:raises raised ValueError: a bug in the reward function"),
    ("one_score_short", "update 3: --reward_fn tests/reward_fns.py:one_score_short returned 1 scores for 2 "
                        "completions"),
])
def test_a_failing_reward_function_stops_naming_the_update(name, message):
    import datasets

    spec = f"tests/reward_fns.py:{name}"
    reward_fn = data.load_python_object(spec, "--reward_fn", "function")
    task = SimpleNamespace(tokenizer=word_tokenizer(), reward_fn=reward_fn, reward_fn_name=spec, prompt_column="prompt")
    rollout = common.Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                             torch.tensor([[5], [6]]), torch.tensor([1, 1]), torch.tensor([False, False]))
    rows = datasets.Dataset.from_dict({"prompt": ["p", "q"], "input_ids": [[1], [1]]})[[0, 1]]
    with pytest.raises(SystemExit) as stop:
        common.function_rewards(task, rollout, rows, "update 3")
    assert str(stop.value.code) == f"error: {message}"


def test_reward_function_specs_resolve_or_fail_on_one_line():
    says_the_answer = data.load_python_object("tests/reward_fns.py:says_the_answer", "--reward_fn", "function")
    assert says_the_answer([], [], answer=[]) == []
    assert data.load_python_object("math:sqrt", "--reward_fn", "function")(4.0) == 2.0  # module:name
    for spec, message in [("tests/missing.py:f", "no file 'tests/missing.py'"),
                          ("no_such_module:f", "cannot import module 'no_such_module'"),
                          ("tests/reward_fns.py:nothing", "has no function 'nothing'"),
                          ("says_the_answer", "must be path/to/file.py:function or module:function")]:
        with pytest.raises(SystemExit) as stop:
            data.load_python_object(spec, "--reward_fn", "function")
        assert message in str(stop.value.code) and "\n" not in str(stop.value.code), spec


# ---- data ---------------------------------------------------------------------------------------
def data_args(path, **overrides):
    return data.DataArgs(**{"dataset_name": str(path), "max_prompt_length": 4, "model_name_or_path": "tiny",
                            **overrides})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prompts_from_jsonl_drop_long_ones_with_a_count(tmp_path, capsys):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"query": "the cat sat"}, {"query": "the cat sat on the mat"}])
    prompts = data.load_prompts(data_args(path), word_tokenizer(), "train")
    assert [len(ids) for ids in prompts["input_ids"]] == [3]
    assert "dropped 1 of 2 prompts" in capsys.readouterr().out


def test_prompts_from_a_save_to_disk_directory_keep_their_columns(tmp_path):
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"query": ["hello world"], "ref": ["cat"]})}) \
        .save_to_disk(tmp_path / "data")
    prompts = data.load_prompts(data_args(tmp_path / "data"), word_tokenizer(), "validation")
    assert prompts["ref"] == ["cat"] and prompts["query"] == ["hello world"] and prompts["input_ids"] == [[3, 4]]


def test_chat_template_wraps_the_prompt(tmp_path):
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}hello {{ m['content'] }}{% endfor %} TL;DR:"
    path = write_jsonl(tmp_path / "p.jsonl", [{"query": "cat"}])
    prompts = data.load_prompts(data_args(path, chat_template=True), tokenizer, "train")
    assert tokenizer.decode(prompts["input_ids"][0]) == "hello cat TL;DR:"


@pytest.mark.parametrize(("rows", "args", "message"), [
    ([{"text": "cat"}], {}, "has no column 'query'; it has ['text']"),
    ([], {}, "is empty"),
    ([{"query": "the cat sat on the mat"}], {}, "every prompt of"),
    ([{"query": "cat"}], {"chat_template": True}, "has no chat template"),
])
def test_bad_data_gives_a_clear_error(tmp_path, rows, args, message):
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(SystemExit, match=re.escape(message)):
        data.load_prompts(data_args(path, **args), word_tokenizer(), "train")


def test_empty_parquet_gives_a_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"query": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(SystemExit, match="split 'train' is empty"):
        data.load_prompts(data_args(tmp_path / "empty.parquet"), word_tokenizer(), "train")


def test_missing_split_and_missing_path(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"query": "cat"}])
    with pytest.raises(SystemExit, match="has one split, 'train', not 'validation'"):
        data.load_split(str(path), "validation")
    with pytest.raises(SystemExit, match="does not exist"):
        data.load_split(str(tmp_path / "nowhere" / "data"), "train")


def test_tokenizer_without_pad_token_is_refused(tmp_path):
    tokenizer = word_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="has no pad token"):
        data.load_tokenizer(str(tmp_path))


def test_left_pad():
    ids, mask = common.left_pad([[5], [6, 7, 8]], PAD, "cpu")
    assert ids.tolist() == [[PAD, PAD, 5], [6, 7, 8]] and mask.tolist() == [[0, 0, 1], [1, 1, 1]]


def test_prompt_sampler_gives_ranks_disjoint_prompts_and_resumes_exactly():
    ranks = [data.PromptSampler(10, 2, rank, 2, seed=3) for rank in range(2)]
    first = [[s.next_indices() for _ in range(5)] for s in ranks]  # 2 epochs of 2 batches, and one more
    for batch in range(5):
        assert not set(first[0][batch]) & set(first[1][batch])
    resumed = data.PromptSampler(10, 2, 1, 2, seed=3)
    resumed.position = 3
    assert [resumed.next_indices() for _ in range(2)] == first[1][3:]
    # an epoch is 2 batches of 2 x 2 prompts: 8 distinct prompts of the 10 (2 left out), reshuffled the next epoch
    epochs = [first[0][e] + first[1][e] + first[0][e + 1] + first[1][e + 1] for e in (0, 2)]
    assert all(len(set(epoch)) == 8 and set(epoch) <= set(range(10)) for epoch in epochs)
    assert epochs[0] != epochs[1]


def test_curves_png_is_drawn_from_metrics_jsonl(tmp_path):
    import json

    import matplotlib.image

    lines = [{"update": u, "time": 1000.0 + 30 * u, "episode": 64 * u, "eval/gold_win_rate": 0.1 * u,
              "eval/proxy_score": 0.5 * u, "eval/kl": 0.2 * u} for u in range(4)]
    lines.insert(1, {"update": 1, "time": 1010.0, "loss/policy_avg": 0.5})  # a training line is skipped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    outputs.plot_curves(str(tmp_path))
    image = matplotlib.image.imread(tmp_path / "curves.png")
    assert image.shape[:2] == (7 * 80, 13 * 80)  # six panels at 80 dpi
    assert image.std() > 0.01  # something is drawn
    assert not list(tmp_path.glob(".curves*"))  # written atomically, no leftovers


def test_curves_are_drawn_at_most_once_a_minute_and_at_the_end(tmp_path, one_rank_group, monkeypatch):
    drawn = []  # the evaluations each drawing showed

    def plot_curves(output_dir):
        with open(tmp_path / "metrics.jsonl") as f:
            drawn.append([m["update"] for m in map(json.loads, f) if "eval/proxy_score" in m])

    monkeypatch.setattr(outputs, "plot_curves", plot_curves)
    logger = outputs.MetricsLogger(outputs.RunArgs(output_dir=str(tmp_path)), {}, 4, 0, ())
    for update in range(4):
        logger.log_evaluation(update, 8 * update, {"eval/proxy_score": 0.1 * update})
        if update == 1:  # a minute passes
            logger.curves_drawn_at -= outputs.CURVES_EVERY_SECONDS
    logger.close()
    assert drawn == [[0, 1, 2], [0, 1, 2, 3]]  # not at the start, when the first evaluation alone is no curve


SRUN_STEP = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
             "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_JOB_ID": "123456", "MASTER_ADDR": "node-a"}


def test_srun_tasks_are_the_ranks_of_one_world():
    """srun starting every rank itself (8 tasks on 2 nodes) sets no RANK: each task is a rank of one world of 8,
    4 on each node, never 8 worlds of one rank."""
    assert common.srun_ranks(SRUN_STEP) == {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                                            "MASTER_ADDR": "node-a", "MASTER_PORT": str(20000 + 123456 % 20000)}
    one_node = {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
                "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "MASTER_PORT": "29500"}
    del one_node["MASTER_ADDR"]
    assert common.srun_ranks(one_node)["MASTER_ADDR"] == "127.0.0.1"
    assert common.srun_ranks(one_node)["MASTER_PORT"] == "29500"


@pytest.mark.parametrize(("changes", "message"), [
    ({"MASTER_ADDR": None}, "srun started 8 tasks on 2 nodes, and MASTER_ADDR is not set: export MASTER_ADDR="),
    ({"SLURM_STEP_TASKS_PER_NODE": "5,3"}, "srun started 5,3 tasks on its nodes: start the same number on every node"),
])
def test_an_srun_step_the_kit_cannot_place_fails_on_one_line(changes, message):
    environment = {name: value for name, value in {**SRUN_STEP, **changes}.items() if value is not None}
    with pytest.raises(SystemExit, match=re.escape(message)):
        common.srun_ranks(environment)


@pytest.mark.slow
def test_two_srun_tasks_make_one_world_of_two_ranks():
    """What srun gives two tasks on one node, and nothing else: init_distributed makes them ranks 0 and 1 of
    one world."""
    import subprocess
    import sys

    from scripts import ROOT, environment

    program = "import common; print('rank %d of %d' % common.init_distributed())"
    base = {name: value for name, value in environment().items()
            if name not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    slurm = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
             "SLURM_JOB_ID": "1", "MASTER_PORT": str(free_port())}
    tasks = [subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              env={**base, **slurm, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)})
             for task in range(2)]
    outputs = [task.communicate(timeout=120)[0] for task in tasks]
    assert [output.strip().splitlines()[-1] for output in outputs] == ["rank 0 of 2", "rank 1 of 2"], outputs


@pytest.mark.slow
def test_two_ranks_under_deepspeeds_launcher_compile_nothing_and_map_no_shared_memory(tmp_path):
    """DeepSpeed's shared-memory all-reduce, which the kit does not use, is off: on a new machine DeepSpeed does
    not compile it (30 s) and maps no 66 MB buffer a rank in /dev/shm (which it would never unlink); the
    ranks' all-reduce works."""
    import os
    import subprocess

    from scripts import ROOT, environment

    program = tmp_path / "program.py"
    program.write_text(f"import sys; sys.path.insert(0, {ROOT!r}); import common, torch; common.init_distributed(); "
                       "total = torch.ones(1); torch.distributed.all_reduce(total); "
                       f"open(f'{tmp_path}/rank{{torch.distributed.get_rank()}}', 'w').write(str([total.item(), "
                       "[line for line in open('/proc/self/maps') if '/dev/shm/' in line]]))\n")
    port = str(free_port())
    ranks = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", port, str(program)], cwd=ROOT,
                           text=True, capture_output=True, timeout=120,
                           env=environment({"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}))
    assert ranks.returncode == 0, ranks.stdout[-3000:] + ranks.stderr[-3000:]
    assert [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)] == ["[2.0, []]"] * 2
    assert not os.path.exists(tmp_path / "extensions")
    assert not [name for name in os.listdir("/dev/shm") if f"_{port}_" in name]
