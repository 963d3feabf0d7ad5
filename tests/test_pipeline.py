"""The steps around RL: the README's whole pipeline on the toy world (sft.py -> reward_model.py ->
online_dpo.py -> eval_checkpoints.py), SFT's and the reward model's resume, and sft.py and reward_model.py on a
researcher's own models (an untrained Qwen2 with a chat template, a BERT encoder reward model);
eval_checkpoints.py's errors (its tables are checked against a training run's own evaluations in test_online_dpo.py)."""

import json
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from own_inputs import bert_wordpiece_tokenizer, policies, questions, write_jsonl
from scripts import PREEMPTED_EXIT_CODE, ROOT, read_metrics, run_script, start_script


def evaluations(run_dir, name: str) -> list[float]:
    return [m[name] for m in read_metrics(run_dir) if name in m]


# The README's whole pipeline, shortened: one SFT epoch, one reward-model epoch, 10 RL updates
SHORTER = {"sft.py": ["--num_epochs", "1", "--eval_every", "64"], "reward_model.py": ["--num_epochs", "1"],
           "online_dpo.py": ["--total_episodes", "640", "--eval_every", "1000", "--save_every", "5"],
           "eval_checkpoints.py": ["--eval_num_prompts", "128"]}


def readme_pipeline() -> list[list[str]]:
    """The commands of the README's "The whole pipeline" section, as argument lists."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## The whole pipeline")[1]
    block = section.split("```bash\n")[1].split("```")[0]
    return [line.split() for line in block.splitlines()]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The README's four commands run in a fresh folder, each shortened (flags appended override)."""
    folder = tmp_path_factory.mktemp("pipeline")
    outputs = {}
    for python, script, *args in readme_pipeline():
        assert python == "python", script
        outputs[script] = run_script(*args, *SHORTER[script], script=script, check=False, cwd=folder, timeout=600)
        assert outputs[script].returncode == 0, outputs[script].stderr[-3000:]
    return folder, outputs


@pytest.mark.slow
def test_the_readmes_pipeline_runs_and_its_rl_step_learns(pipeline):
    from datasets import load_from_disk

    import toy

    folder, outputs = pipeline
    assert list(outputs) == ["sft.py", "reward_model.py", "online_dpo.py", "eval_checkpoints.py"]
    losses = evaluations(folder / "runs" / "sft", "eval/loss")
    assert len(losses) == 5 and losses[-1] < 0.3 * losses[0], losses  # steps 0, 64, 128, 192, 256
    # relabelling: every pair now ordered as the gold judge orders it; about LABEL_NOISE of them swapped
    relabelled = load_from_disk(str(folder / "runs" / "rm" / "relabelled_dataset"))
    for split, size in (("train", 4096), ("validation", 256)):
        rows = relabelled[split]
        gold_chosen, gold_rejected = (toy.gold_score(rows["prompt"], rows[c]) for c in ("chosen", "rejected"))
        assert len(rows) == size and all(c >= r for c, r in zip(gold_chosen, gold_rejected))
        swapped = sum(a != b for a, b in zip(load_from_disk(toy.PREFERENCE_DATASET)[split]["chosen"], rows["chosen"]))
        assert 0.15 * size < swapped < 0.35 * size
        assert f"relabelled {split}: {swapped} of {size} pairs" in outputs["reward_model.py"].stdout
    assert evaluations(folder / "runs" / "rm", "eval/accuracy")[-1] > 0.85
    # the RL step on the pipeline's own SFT policy and reward model: snapshots at updates 5 and 10 (the final
    # policy is update 10 too), each evaluated; the gold score rises (the SFT policy of one epoch rambles
    # more than the toy's, so the win-rate moves later than the gold score)
    table = [json.loads(line) for line in (folder / "runs" / "dpo" / "eval" / "eval.jsonl").read_text().splitlines()]
    assert [(row["policy"], row["update"]) for row in table] == [
        ("runs/sft/policy", 0), ("runs/dpo/policies/update-5", 5), ("runs/dpo/policies/update-10", 10)]
    assert table[-1]["eval/gold_score"] > table[0]["eval/gold_score"] + 0.5, table
    assert table[-1]["eval/num_eos_tokens"] > table[0]["eval/num_eos_tokens"] + 0.2, table


SAVED_MODEL = {"sft.py": "policy", "reward_model.py": "reward_model"}  # in each pipeline script's output_dir


@pytest.mark.slow
# reward_model.py's resume heavy (not in CI): it checkpoints and resumes through sft.py's code (common.py)
@pytest.mark.parametrize("step", [0, pytest.param(1, marks=pytest.mark.heavy)], ids=["sft.py", "reward_model.py"])
def test_pipeline_steps_resume_exactly_after_a_preemption(pipeline, tmp_path, step):
    # the pipeline's SFT (reward model) run again, preempted (SIGTERM) once it logged step 5: it finishes the
    # step, checkpoints it and exits 75; resumed, it ends with the same weights and losses
    folder, _ = pipeline
    _, script, *args = readme_pipeline()[step]
    whole = folder / next(value for flag, value in zip(args, args[1:]) if flag == "--output_dir")
    args = [*args, *SHORTER[script], "--output_dir", tmp_path / "resumed"]
    process = start_script(*args, script=script, cwd=folder)
    metrics = tmp_path / "resumed" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and '"update": 5,' in metrics.read_text()):
        assert process.poll() is None, "the run ended before it could be preempted"
        assert time.time() < deadline, "step 5 not logged within 600 s"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == PREEMPTED_EXIT_CODE
    assert not (tmp_path / "resumed" / SAVED_MODEL[script]).exists()
    run_script(*args, "--resume", script=script, cwd=folder, timeout=600)

    from safetensors.torch import load_file

    whole_weights, resumed_weights = (load_file(run / SAVED_MODEL[script] / "model.safetensors")
                                      for run in (whole, tmp_path / "resumed"))
    assert whole_weights.keys() == resumed_weights.keys()
    assert all(torch.equal(whole_weights[name], resumed_weights[name]) for name in whole_weights)
    for name in ("train/loss", "eval/loss"):
        assert evaluations(whole, name) == evaluations(tmp_path / "resumed", name) != [], name


def test_sft_loss_is_the_token_mean_of_a_chat_policy_and_falls(tmp_path):
    # a Qwen2 policy with a byte-level BPE tokenizer and a chat template, on a .jsonl of its own
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, tokenizer = policies()["qwen2"]
    torch.manual_seed(0)  # untrained, as a pretrained base model would be for this data
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "qwen2")
    tokenizer.save_pretrained(tmp_path / "qwen2")
    rows = [{"question": q, "answer": f" the answer is {a} ."} for q, a in questions()]
    data_file = write_jsonl(tmp_path / "qa.jsonl", rows)
    out = tmp_path / "run"
    run_script("--model_name_or_path", tmp_path / "qwen2", "--dataset_name", data_file, "--prompt_column", "question",
               "--completion_column", "answer", "--chat_template", "--eval_num_examples", "8", "--num_epochs", "8",
               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3",
               "--eval_every", "4", "--warmup_steps", "4", "--output_dir", out, script="sft.py")

    # by hand: the prompt through the chat template, the completion and the stop token; the mean
    # negative log-likelihood over the completion tokens of the 8 held-out examples (the last 8 rows)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2")
    total_nll, total_tokens = 0.0, 0
    for row in rows[-8:]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
        completion = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        total_nll += F.cross_entropy(logits, torch.tensor(completion), reduction="sum").item()
        total_tokens += len(completion)
    losses = evaluations(out, "eval/loss")
    assert losses[0] == pytest.approx(total_nll / total_tokens, rel=1e-5)
    assert losses[-1] < 0.5 * losses[0], losses
    lr = {m["update"]: m["lr"] for m in read_metrics(out) if "lr" in m}
    assert (lr[1], lr[4], lr[18]) == pytest.approx((3e-3 / 4, 3e-3, 3e-3 * 14 / 28))  # warm-up, then linear decay
    # 32 training rows, 8 a step: 4 steps an epoch
    assert [m["update"] for m in read_metrics(out) if "eval/loss" in m] == list(range(0, 33, 4))
    policy, info = AutoModelForCausalLM.from_pretrained(out / "policy", output_loading_info=True)
    assert not any(info.values()) and json.loads((out / "policy" / "trained.json").read_text())["update"] == 32


@pytest.mark.slow
def test_sfts_step_is_the_gradient_of_the_token_mean_over_the_whole_step(tmp_path):
    # one step of 32 examples in 4 micro-batches, completions of 1 to 16 tokens: AdamW's first step moves each
    # weight by lr * g / (|g| + eps) (after weight decay), g the clipped gradient of the mean negative
    # log-likelihood over every completion token of the step; a mean of micro-batch means flips the sign of
    # some of g's coordinates
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import toy

    toy.build_pipeline()
    rows = load_from_disk(toy.SFT_DATASET)["train"].select(range(40)).to_list()  # 32 to train, 8 held out
    for row in rows[::3]:
        row["completion"] = " <eos>"
    run_script("--dataset_name", write_jsonl(tmp_path / "sft.jsonl", rows), "--num_epochs", "1", "--eval_every", "0",
               "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4", "--learning_rate", "1e-3",
               "--output_dir", tmp_path / "run", script="sft.py")
    tokenizer = AutoTokenizer.from_pretrained(toy.BASE_POLICY)
    model = AutoModelForCausalLM.from_pretrained(toy.BASE_POLICY)
    total_nll, total_tokens = 0.0, 0
    for row in rows[:32]:
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"])["input_ids"]  # ends with <eos> already
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        total_nll = total_nll + F.cross_entropy(logits, torch.tensor(completion), reduction="sum")
        total_tokens += len(completion)
    (total_nll / total_tokens).backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    clip = min(1.0, 1.0 / (norm.item() + 1e-6))  # --max_grad_norm 1
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy").state_dict()
    for name, weight in model.named_parameters():
        g = weight.grad * clip
        expected = weight.detach() * (1 - 1e-3 * 0.01) - 1e-3 * g / (g.abs() + 1e-8)  # AdamW's defaults
        # where |g| is near eps (1e-8) the step depends on g's last bits: float summation order decides
        decided = g.abs() > 1e-6
        assert torch.allclose(trained[name][decided], expected[decided], atol=1e-6), name
    assert read_metrics(tmp_path / "run")[0]["train/loss"] == pytest.approx(total_nll.item() / total_tokens, rel=1e-5)


def test_reward_model_on_an_encoder_scores_what_the_rl_scripts_read(tmp_path):
    # a BERT classifier with a WordPiece tokenizer and no stop token: its training score of a pair is the
    # score the RL scripts give the same prompt + completion text (common.score_texts)
    from transformers import BertConfig, BertForSequenceClassification

    import common

    tokenizer = bert_wordpiece_tokenizer()
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64, num_labels=1,
                                             pad_token_id=0)).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    answers = [a for _, a in questions()]
    rows = [{"prompt": q, "chosen": f" the answer is {a} .", "rejected": f" the answer is {answers[i - 1]} ?"}
            for i, (q, a) in enumerate(questions())]
    out = tmp_path / "run"
    run_script("--model_name_or_path", tmp_path / "bert", "--dataset_name", write_jsonl(tmp_path / "pairs.jsonl", rows),
               "--eval_num_examples", "8", "--num_epochs", "10", "--per_device_train_batch_size", "8",
               "--learning_rate", "1e-3", "--eval_every", "20", "--output_dir", out, script="reward_model.py")
    before = read_metrics(out)[0]
    model = BertForSequenceClassification.from_pretrained(tmp_path / "bert").eval()
    with torch.no_grad():
        chosen, rejected = (common.score_texts(model, tokenizer, [r["prompt"] + r[c] for r in rows[-8:]], [True] * 8)
                            for c in ("chosen", "rejected"))
    assert before["eval/chosen_score"] == pytest.approx(chosen.mean().item(), rel=1e-4, abs=1e-6)
    assert before["eval/rejected_score"] == pytest.approx(rejected.mean().item(), rel=1e-4, abs=1e-6)
    losses = evaluations(out, "eval/loss")
    assert evaluations(out, "eval/accuracy")[-1] == 1.0 and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
def test_bad_input_to_the_pipeline_scripts_is_a_one_line_error_and_writes_nothing(tmp_path):
    for script, args, message in [
            ("sft.py", ["--warmup_steps", "-1"], "error: --warmup_steps must be 0 or positive, got -1"),
            ("sft.py", ["--completion_column", "answer"], "has no column 'answer'; it has ['prompt', 'completion'"),
            ("reward_model.py", ["--rejected_column", "chosen"],
             "error: --chosen_column and --rejected_column are both 'chosen'; they must differ"),
            ("reward_model.py", ["--relabel_with", "toy", "--dataset_name", str(tmp_path / "pairs.jsonl")],
             "--relabel_with toy scores the embedded toy world's posts only")]:
        write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "hello", "chosen": " a", "rejected": " b"}])
        result = run_script(*args, "--output_dir", tmp_path / "run", script=script, check=False)
        assert result.returncode != 0 and message in result.stderr.strip().splitlines()[-1], (script, result.stderr)
        assert not (tmp_path / "run").exists()
    (tmp_path / "args.json").write_text(json.dumps({"args": {"dataset_name": "x"}, "versions": {}}))
    result = run_script("--run_dir", tmp_path, script="eval_checkpoints.py", check=False)
    assert result.returncode != 0 and "has no saved policy" in result.stderr.strip().splitlines()[-1]
    result = run_script("--run_dir", tmp_path / "nothing", script="eval_checkpoints.py", check=False)
    assert result.returncode != 0 and "has no args.json" in result.stderr.strip().splitlines()[-1]
