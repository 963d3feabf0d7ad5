import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("WANDB_MODE", "offline")

WORDS = ["hello", "world", "cat", "dog", "sat", "on", "the", "mat", "TL;DR:"]


def word_tokenizer(words=WORDS, specials=("<pad>", "<eos>", "<unk>")):
    """A word-level tokenizer built in code, saved and loaded like a hub tokenizer would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=specials[0], eos_token=specials[1],
                                   unk_token="<unk>")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny causal LM and a tiny reward model, saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = word_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder / "policy")
    tokenizer.save_pretrained(folder / "policy")
    LlamaForSequenceClassification(LlamaConfig(**config.to_dict(), num_labels=1)).save_pretrained(folder / "reward")
    tokenizer.save_pretrained(folder / "reward")
    return folder

