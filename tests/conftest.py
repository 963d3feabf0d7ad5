import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("WANDB_MODE", "offline")
# one thread per test process: the two xdist workers (pyproject.toml) share two cores, and more
# threads than cores make OpenMP's spinning threads wait on each other
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The slowest files first: with --dist loadfile a free worker takes the next file, so longest-first makes the
# workers finish at about the same time (xdist's loadgroup, which could spread a file's independent tests, does
# not group with pytest 9: its group names never reach the tests' ids). The fast tier's vLLM runs first, in one
# file: each pins its trainer and engine to cores of their own, so two at once would wait on each other; beside
# them the multi-turn tests. Then the files by their slow tests' time (measured 2026-12-02, 4 workers: 24 minutes
# for test_online_dpo_vllm.py down to seconds; a long file taken last made the slow tier's tail).
SLOWEST_FIRST = ["test_vllm_scripts.py", "test_multiturn.py", "test_online_dpo_vllm.py", "test_multiturn_vllm.py",
                 "test_tools.py", "test_inflight.py", "test_reliability.py", "test_grpo_vllm.py",
                 "test_own_inputs_vllm.py", "test_online_dpo.py", "test_pipeline.py", "test_engine_evaluation.py",
                 "test_two_ranks.py", "test_rloo_bok.py", "test_ppo_vllm.py", "test_lora.py", "test_off_policy.py",
                 "test_rloo_vllm.py", "test_ppo.py", "test_own_inputs.py", "test_math.py", "test_grpo.py",
                 "test_hub_templates.py", "test_bench.py"]


def pytest_sessionstart(session):
    """Before the workers start: the embedded tasks the tests use, built on the idle machine (nothing when they
    are built). Built by the first test to ask, a build would share the two cores with the other worker's tests
    and count in its test's time. The arithmetic task and the tool task only where slow tests run: no fast one
    uses them."""
    if hasattr(session.config, "workerinput") or session.config.option.collectonly:
        return
    import toy

    toy.build_pipeline()  # the toy world first
    toy.build_guess()
    if "not slow" not in session.config.option.markexpr:
        toy.build_math()
        toy.build_tools()


def pytest_terminal_summary(terminalreporter, config):
    if config.option.markexpr == "not slow":
        terminalreporter.write_line("the fast tier: python -m pytest -m 'slow or not slow' runs the whole suite, the "
                                    "tests marked slow too (CI does, but for those marked heavy)")


def pytest_collection_modifyitems(items):
    def position(item):
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=position)  # stable: a file's tests keep their order


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


@pytest.fixture
def one_rank_group():
    """torch.distributed as a plain `python script.py` has it: one gloo rank (for the functions that reduce
    over ranks)."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        for name, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
            patch.setenv(name, value)
        from scripts import free_port

        patch.setenv("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group("gloo")
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()
