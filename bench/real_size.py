"""A researcher's setup at a real size, built locally (no hub here): a policy of SmolLM2-135M-Instruct's shape
(Llama, 30 layers, hidden 576, 49,152-token vocabulary, tied embeddings; random weights), its byte-level BPE
tokenizer with a ChatML chat template, trained on the docstrings of Python's standard library; an encoder
reward model (BERT, 4 layers, its own WordPiece tokenizer, random weights); and a prompt-only .jsonl of
paragraphs to summarise. Built once into a cache folder next to the toy's; the benchmarks import build().

    python bench/real_size.py      # builds (about 2 minutes on 2 CPU cores) and prints the paths
"""

import json
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import toy  # noqa: E402  (the kit's root on the path first)

FOLDER = toy.TOY_DIR + "-real-size"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def docstring_paragraphs() -> list[str]:
    """Paragraphs of 20 to 120 words from the docstrings (triple-quoted strings) of the installed Python code:
    the standard library and the kit's dependencies, enough text for a 49k-token vocabulary."""
    paragraphs = []
    for root in dict.fromkeys((sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])):
        for folder, _, names in sorted(os.walk(root)):
            for name in sorted(names):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf-8", errors="ignore") as f:
                        strings = re.findall(r'"""(.*?)"""', f.read(), flags=re.DOTALL)
                    for paragraph in (p for string in strings for p in string.split("\n\n")):
                        words = paragraph.split()
                        if 20 <= len(words) <= 120 and not paragraph.lstrip().startswith((">>>", "-", "*")):
                            paragraphs.append(" ".join(words))
    return paragraphs


def script_flags() -> list[str]:
    """A kit script's flags for this setup (built first if need be): the policy with its chat template, the
    encoder reward model, the prompt-only data, no evaluation (there is no gold scorer)."""
    artefacts = build()
    return ["--model_name_or_path", artefacts["policy"], "--reward_model_path", artefacts["reward_model"],
            "--dataset_name", artefacts["prompts"], "--prompt_column", "prompt", "--chat_template",
            "--max_prompt_length", "192", "--local_rollout_forward_batch_size", "16", "--eval_every", "0"]


def build() -> dict[str, str]:
    """The artefacts' paths by name (policy, reward_model, prompts), built once."""
    paths = {"policy": os.path.join(FOLDER, "policy"), "reward_model": os.path.join(FOLDER, "reward_model"),
             "prompts": os.path.join(FOLDER, "prompts.jsonl")}
    if os.path.exists(os.path.join(FOLDER, "done")):
        return paths
    import torch
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertTokenizerFast,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    texts = docstring_paragraphs()
    partial = tempfile.mkdtemp(dir=os.path.dirname(FOLDER))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=49152, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                            show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>", bos_token="<|im_start|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    policy = os.path.join(partial, "policy")
    LlamaForCausalLM(config).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(policy)

    word_piece = BertWordPieceTokenizer(lowercase=True)
    word_piece.train_from_iterator(texts, vocab_size=30522, show_progress=False)
    reward_model = os.path.join(partial, "reward_model")
    os.makedirs(reward_model)
    word_piece.save_model(reward_model)
    rm_tokenizer = BertTokenizerFast(os.path.join(reward_model, "vocab.txt"), do_lower_case=True)
    BertForSequenceClassification(BertConfig(vocab_size=len(rm_tokenizer), hidden_size=256, num_hidden_layers=4,
                                             num_attention_heads=4, intermediate_size=1024,
                                             num_labels=1)).save_pretrained(reward_model)
    rm_tokenizer.save_pretrained(reward_model)

    rng = random.Random(0)
    rng.shuffle(texts)
    with open(os.path.join(partial, "prompts.jsonl"), "w") as f:
        for text in texts[:2000]:
            f.write(json.dumps({"prompt": f"Summarise in one sentence: {text}"}) + "\n")
    open(os.path.join(partial, "done"), "w").close()
    shutil.rmtree(FOLDER, ignore_errors=True)
    os.rename(partial, FOLDER)
    return paths


if __name__ == "__main__":
    print(json.dumps(build(), indent=1))
