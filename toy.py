"""The embedded default task: a tiny synthetic world shaped like TL;DR summarisation.

Each post names a subreddit and mentions 2-4 "key" nouns of its topic among filler words; a good
summary lists the key nouns and stops. `gold_score` is the programmatic gold judge. The SFT
policy has the skill but a visible fault: it rambles a sign-off phrase instead of stopping, so
near-greedy it almost never beats the references, while a policy that learned to stop would.
References are noisy, so even a perfect summary beats them only about 2 times in 3 (the ceiling).

Everything is built once, deterministically, in about a minute on 2 CPU cores, and saved in
Hugging Face formats; the training scripts load it with `from_pretrained` / `load_from_disk`.
Usage: `python toy.py` builds (if needed) and prints the summary; `python toy.py large` does the same for
a 7.7x larger SFT policy of the same world (LARGE_SFT_POLICY; same dataset and reward model), built on
demand, for questions about scale.

Beside it, built on first use each: the arithmetic task (build_math) and the guess-the-number environment of the
multi-turn scripts (build_guess; GuessTheNumber, the environment contract's example).
"""

import fcntl
import glob
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import datasets
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset, DatasetDict, load_from_disk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

with open(__file__, "rb") as _source:  # an edited toy.py gets a fresh cache folder
    _SOURCE_HASH = hashlib.sha256(_source.read()).hexdigest()[:10]
TOY_DIR = os.path.abspath(os.environ.get("ASYNC_RLHF_TOY_DIR")
                          or os.path.expanduser(f"~/.cache/async-rlhf-kit/toy-{_SOURCE_HASH}"))
SFT_POLICY = os.path.join(TOY_DIR, "sft_policy")
REWARD_MODEL = os.path.join(TOY_DIR, "reward_model")
DATASET = os.path.join(TOY_DIR, "dataset")
MATH_DIR = TOY_DIR + "-math"  # the arithmetic task (build_math)
MATH_POLICY = os.path.join(MATH_DIR, "sft_policy")
MATH_DATASET = os.path.join(MATH_DIR, "dataset")
LARGE_DIR = TOY_DIR + "-large"  # the same world with a larger SFT policy (build_large)
LARGE_SFT_POLICY = os.path.join(LARGE_DIR, "sft_policy")
PIPELINE_DIR = TOY_DIR + "-pipeline"  # what the steps before RL start from (build_pipeline)
GUESS_DIR = TOY_DIR + "-guess"  # the guess-the-number environment (build_guess)
GUESS_POLICY = os.path.join(GUESS_DIR, "sft_policy")
GUESS_DATASET = os.path.join(GUESS_DIR, "dataset")
TOOLS_DIR = TOY_DIR + "-tools"  # the addition task with an add tool (build_tools)
TOOLS_POLICY = os.path.join(TOOLS_DIR, "sft_policy")
TOOLS_DATASET = os.path.join(TOOLS_DIR, "dataset")
BASE_POLICY = os.path.join(PIPELINE_DIR, "base_policy")
SFT_DATASET = os.path.join(PIPELINE_DIR, "sft_dataset")
PREFERENCE_DATASET = os.path.join(PIPELINE_DIR, "preference_dataset")
BUILD_LOCK = os.path.join(os.path.dirname(TOY_DIR), "builds.lock")  # one for every build (built_once)
BUILD_THREADS = 2  # a build's, whatever its caller's (measured here: 1, 2 and 3 threads build the same weights)
LABEL_NOISE = 0.25  # of the preference pairs, those whose "human" label disagrees with the gold judge

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Policy shapes. Heads of size 32: vLLM's CPU backend rejects 16. The reward model always has the small shape.
SMALL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4)  # 0.45M parameters
LARGE_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8)  # 3.45M parameters, 7.7x
RESPONSE_LENGTH = 12  # new tokens per response in evaluation; the SFT policy's rambling can overrun it
TOPICS = {
    "cooking": "pasta garlic onion oven butter sauce rice chicken soup bread cheese pepper",
    "fitness": "gym squat protein cardio muscle diet weights treadmill stretch sleep coach knee",
    "travel": "flight hotel passport beach train visa luggage airport museum island map hostel",
    "pets": "dog cat puppy leash vet kitten collar treats litter cage parrot hamster",
    "gaming": "console controller level boss quest server graphics mod keyboard mouse headset patch",
    "music": "guitar drums piano song album concert band lyrics chord amp vinyl singer",
    "money": "budget rent loan salary savings credit debt tax bank invoice stocks pension",
    "gardening": "tomato soil seeds compost roses hose shovel weeds fence lawn basil greenhouse",
}
TOPICS = {topic: nouns.split() for topic, nouns in TOPICS.items()}
FILLER = ("i my the a and was it is to of in for with this that we but they he she have had got today "
          "yesterday last week really very just then after before when our new old big small good bad "
          "friend wife husband mom dad always never again still also").split()
RAMBLE = "so yeah anyway that is about it thanks for reading lol".split()  # the SFT policy's habit
WORDS = list(dict.fromkeys([PAD, EOS, UNK, "SUBREDDIT:", "POST:", "TL;DR:", *(f"r/{t}" for t in TOPICS),
                            *(n for nouns in TOPICS.values() for n in nouns), *FILLER, *RAMBLE]))


# ---------------------------------------------------------------- the world and its gold judge
def make_query(rng: random.Random) -> str:
    topic = rng.choice(list(TOPICS))
    body = [rng.choice(FILLER) for _ in range(rng.randint(10, 20))]
    for key in rng.sample(TOPICS[topic], rng.randint(2, 4)):
        body.insert(rng.randint(0, len(body)), key)
    return f"SUBREDDIT: r/{topic} POST: {' '.join(body)} TL;DR:"


def parse_query(query: str) -> tuple[str, list[str]]:
    """(topic, key nouns in order of appearance) of a toy post; ValueError for anything else."""
    words = [w for w in query.split() if w != PAD]  # tolerate a decoded left-padded query
    topic = words[1][2:] if len(words) > 4 and words[1].startswith("r/") else None
    if words[:1] != ["SUBREDDIT:"] or words[2:3] != ["POST:"] or words[-1] != "TL;DR:" or topic not in TOPICS:
        raise ValueError(f"not a toy.py post (gold_score only judges toy.py's synthetic world): {query[:80]!r}")
    return topic, [w for w in words[3:-1] if w in TOPICS[topic]]


def gold_score(queries: list[str], responses: list[str]) -> list[float]:
    """Gold reward of each response: the text generated after the query, including `<eos>` if the
    policy stopped (anything after the first `<eos>`, and `<pad>` words, are ignored).
    Key coverage (0 to 1), minus 0.2 per word outside the key set and per repeated word,
    minus 1 if the response never stopped."""
    scores = []
    for query, response in zip(queries, responses, strict=True):
        keys = set(parse_query(query)[1])
        words = [w for w in response.split() if w != PAD]
        stopped = EOS in words
        words = words[:words.index(EOS)] if stopped else words
        off_key = sum(w not in keys for w in words)
        repeats = len(words) - len(set(words))
        scores.append(len(keys & set(words)) / len(keys) - 0.2 * (off_key + repeats) - (0.0 if stopped else 1.0))
    return scores


def as_response(words: list[str]) -> str:
    return " " + " ".join(words)  # leading space: query + response tokenizes as query tokens then response tokens


def noisy_reference(query: str, rng: random.Random) -> str:
    """A human-like reference: often misses a key or adds a wrong noun, like real TL;DRs."""
    topic, keys = parse_query(query)
    words = list(keys)
    if rng.random() < 0.4:
        words.remove(rng.choice(words))
    if rng.random() < 0.4:
        words.insert(rng.randint(0, len(words)), rng.choice([n for n in TOPICS[topic] if n not in keys]))
    return as_response(words + [EOS])


def rambling_target(query: str, rng: random.Random) -> str:
    """SFT target: the right keys, but 60% of the time followed by part of a sign-off phrase."""
    ramble = RAMBLE[:rng.randint(1, len(RAMBLE))] if rng.random() < 0.6 else []
    return as_response(parse_query(query)[1] + ramble + [EOS])


def candidate_response(query: str, rng: random.Random) -> str:
    """Reward-model training text: perturbations covering what the SFT and tuned policies produce."""
    topic, keys = parse_query(query)
    words = list(keys)
    if rng.random() < 0.3:
        words.remove(rng.choice(words))
    if rng.random() < 0.3:
        words.insert(rng.randint(0, len(words)), rng.choice(TOPICS[topic] + FILLER))
    if rng.random() < 0.1 and words:
        words.insert(rng.randint(0, len(words)), rng.choice(words))
    if rng.random() < 0.2:
        rng.shuffle(words)
    if rng.random() < 0.5:
        words += RAMBLE[:rng.randint(1, len(RAMBLE))]
    return as_response((words + [EOS])[:RESPONSE_LENGTH])  # the budget cuts off the stop token of long ones


# ---------------------------------------------------------------- models
def make_tokenizer(words: list[str] = WORDS) -> PreTrainedTokenizerFast:
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: decode joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", clean_up_tokenization_spaces=False)


def left_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and position_ids in the layout the trainers use."""
    width = max(map(len, sequences))
    input_ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in sequences])
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


def last_token_scores(reward_model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Score head read at the last real token: the trainers' convention, not HF's pad-based pooling."""
    hidden = reward_model.model(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids).last_hidden_state
    last = (attention_mask * torch.arange(attention_mask.shape[1])).argmax(-1)
    return reward_model.score(hidden[torch.arange(len(hidden)), last]).squeeze(-1)


def train(model, loss_of_batch, steps: int, lr: float) -> float:
    """AdamW with a learning rate decaying linearly to zero; returns the last batch's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    for _ in range(steps):
        loss = loss_of_batch()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    return loss.item()


def sft_loss(policy, tokenizer, queries, rng, batch_size=32) -> torch.Tensor:
    """Next-token loss on the response tokens only."""
    batch = rng.sample(queries, batch_size)
    query_ids = tokenizer(batch)["input_ids"]
    response_ids = tokenizer([rambling_target(q, rng) for q in batch])["input_ids"]
    sequences = [q + r for q, r in zip(query_ids, response_ids)]
    input_ids, attention_mask, position_ids = left_padded(sequences, tokenizer.pad_token_id)
    is_response = left_padded([[0] * len(q) + [1] * len(r) for q, r in zip(query_ids, response_ids)], 0)[0]
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    token_losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
    return (token_losses * is_response[:, 1:]).sum() / is_response.sum()


def gold_labelled_pairs(queries, rng, count) -> tuple[list[str], list[str], list[str]]:
    """Lists of queries, chosen and rejected candidate responses; pairs with equal gold scores are skipped."""
    pairs = []
    while len(pairs) < count:
        query = rng.choice(queries)
        a, b = candidate_response(query, rng), candidate_response(query, rng)
        gold_a, gold_b = gold_score([query, query], [a, b])
        if gold_a != gold_b:
            pairs.append((query, a, b) if gold_a > gold_b else (query, b, a))
    return tuple(map(list, zip(*pairs)))


def chosen_minus_rejected(reward_model, tokenizer, queries, chosen, rejected) -> torch.Tensor:
    texts = [q + r for q, r in zip(queries + queries, chosen + rejected)]
    scores = last_token_scores(reward_model, *left_padded(tokenizer(texts)["input_ids"], tokenizer.pad_token_id))
    return scores[:len(queries)] - scores[len(queries):]


# ---------------------------------------------------------------- build and measure
def greedy_responses(policy, tokenizer, queries: list[str]) -> list[str]:
    """Greedy completions decoded up to and including the first <eos>: what gold_score expects."""
    inputs = tokenizer(queries, return_tensors="pt", padding=True)
    with torch.no_grad():
        output = policy.generate(**inputs, max_new_tokens=RESPONSE_LENGTH, do_sample=False)
    eos = tokenizer.eos_token_id
    responses = output[:, inputs["input_ids"].shape[1]:].tolist()
    return [" " + tokenizer.decode(ids[:ids.index(eos) + 1] if eos in ids else ids) for ids in responses]


def win_rate(queries, responses, references) -> float:
    wins = [p > r for p, r in zip(gold_score(queries, responses), gold_score(queries, references))]
    return sum(wins) / len(wins)


def measure(policy_folder: str, reward_model_folder: str, dataset_folder: str, seed: int) -> dict:
    """The headline numbers, computed from the saved artefacts through the ordinary loading paths."""
    tokenizer = AutoTokenizer.from_pretrained(policy_folder)
    policy = LlamaForCausalLM.from_pretrained(policy_folder)
    reward_model = LlamaForSequenceClassification.from_pretrained(reward_model_folder)
    validation = load_from_disk(dataset_folder)["validation"]
    queries, references = list(validation["query"]), list(validation["reference_response"])
    sft = greedy_responses(policy, tokenizer, queries)
    sft_cut_before_rambling = [as_response(list(itertools.takewhile(lambda w: w not in RAMBLE, r.split())) + [EOS])
                               for r in sft]
    perfect = [as_response(parse_query(q)[1] + [EOS]) for q in queries]
    held_out_pairs = gold_labelled_pairs(queries, random.Random(seed + 1), 2048)
    with torch.no_grad():
        margins = chosen_minus_rejected(reward_model, tokenizer, *held_out_pairs)
    return {
        "sft_greedy_win_rate": win_rate(queries, sft, references),
        "sft_greedy_eos_rate": sum(EOS in r for r in sft) / len(sft),
        "sft_cut_before_rambling_win_rate": win_rate(queries, sft_cut_before_rambling, references),
        "ceiling_win_rate": win_rate(queries, perfect, references),
        "reward_model_agreement": (margins > 0).float().mean().item(),
        "policy_parameters": sum(p.numel() for p in policy.parameters()),
        "reward_model_parameters": sum(p.numel() for p in reward_model.parameters()),
        "example": queries[0] + sft[0],
    }


def built_once(folder: str, make, seed: int, name: str):
    """Build `name` into `folder` unless it is there. Builds wait for each other (BUILD_LOCK: two at once on two
    cores made both several times slower), and one that finds its folder built when its turn comes does
    nothing. It runs in a Python process of its own, which holds the lock with its caller, so the caller's
    thread count, random state and memory stay as they were."""
    if os.path.exists(os.path.join(folder, "summary.json")):
        return
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(BUILD_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(folder, "summary.json")):  # built while this one waited
            return
        for leftover in glob.glob(folder + ".building-*"):  # of a build that was killed: nothing builds it now
            shutil.rmtree(leftover, ignore_errors=True)
        environment = os.environ | {"ASYNC_RLHF_TOY_DIR": TOY_DIR, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}
        code = f"import toy; toy.build_in_this_process({folder!r}, toy.{make.__name__}, {seed}, {name!r})"
        exit_code = subprocess.run([sys.executable, "-c", code], env=environment, pass_fds=[lock.fileno()]).returncode
    if exit_code != 0:
        raise RuntimeError(f"toy: building {name} into {folder} failed (exit code {exit_code}); its output is above")


def build_in_this_process(folder: str, make, seed: int, name: str):
    """`make(building, seed, rng, start)` builds `name` into a scratch folder beside `folder`, seeded, with
    BUILD_THREADS torch threads, and returns the numbers it measured; they go to summary.json and the folder
    becomes `folder` in one rename. built_once's process, which holds BUILD_LOCK."""
    start = time.time()
    datasets.disable_progress_bars()  # the build's output: what it builds, and in how long
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(BUILD_THREADS)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    building = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".building-", dir=os.path.dirname(folder))
    try:
        print(f"toy: building {name} into {folder} (seed {seed})", flush=True)
        numbers = make(building, seed, rng, start) | {"seed": seed, "build_seconds": round(time.time() - start, 1)}
        with open(os.path.join(building, "summary.json"), "w") as f:
            json.dump(numbers, f, indent=2)
        os.rename(building, folder)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    print(f"toy: {name} built in {time.time() - start:.0f} s", flush=True)


def build(seed: int = 0) -> None:
    """Build the toy world into TOY_DIR unless it is already there."""
    built_once(TOY_DIR, make_toy, seed, "the toy world")


def make_toy(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """The toy world into `folder`: dataset, tokenizer, SFT policy, reward model (see the module
    docstring); returns the numbers measured on it."""
    splits = {}
    for split, size in [("train", 8192), ("validation", 512)]:
        queries = [make_query(rng) for _ in range(size)]
        references = [noisy_reference(q, rng) for q in queries]
        splits[split] = Dataset.from_dict({
            "query": queries,
            "reference_response": references,
            "query_reference_response": [q + r for q, r in zip(queries, references)],
        })
    DatasetDict(splits).save_to_disk(os.path.join(folder, "dataset"))
    train_queries = list(splits["train"]["query"])

    tokenizer = make_tokenizer()
    policy, loss = sft_policy(SMALL_SHAPE, tokenizer, train_queries, rng, lr=3e-3)
    print(f"toy: SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")

    # The reward model starts from the SFT backbone, with a fresh one-output score head.
    reward_model = LlamaForSequenceClassification(model_config(SMALL_SHAPE, tokenizer, num_labels=1))
    reward_model.model.load_state_dict(policy.model.state_dict())
    loss = train(reward_model, lambda: -F.logsigmoid(chosen_minus_rejected(
        reward_model, tokenizer, *gold_labelled_pairs(train_queries, rng, 32))).mean(), steps=100, lr=1e-3)
    print(f"toy: reward model trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    for model, name in [(policy, "sft_policy"), (reward_model, "reward_model")]:
        model.save_pretrained(os.path.join(folder, name))
        tokenizer.save_pretrained(os.path.join(folder, name))

    return measure(*(os.path.join(folder, name) for name in ("sft_policy", "reward_model", "dataset")), seed)


def model_config(shape: dict, tokenizer, **extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(WORDS), **shape, head_dim=32, max_position_embeddings=128,
                       tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id, **extra)


def sft_policy(shape: dict, tokenizer, train_queries, rng, lr: float) -> tuple[LlamaForCausalLM, float]:
    """A policy of `shape` trained on the rambling SFT targets; returns it and its last batch's loss."""
    policy = LlamaForCausalLM(model_config(shape, tokenizer))
    policy.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return policy, train(policy, lambda: sft_loss(policy, tokenizer, train_queries, rng), steps=1200, lr=lr)


def build_large(seed: int = 0) -> None:
    """Build the larger SFT policy into LARGE_DIR unless it is already there (the toy world first)."""
    build()
    built_once(LARGE_DIR, make_large, seed, "the larger SFT policy")


def make_large(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """The same world's SFT policy at LARGE_SHAPE, trained on the same targets; the toy world's dataset and
    reward model stay where they are, so only the policy's size differs between the two."""
    train_queries = list(load_from_disk(DATASET)["train"]["query"])
    tokenizer = AutoTokenizer.from_pretrained(SFT_POLICY)
    policy, loss = sft_policy(LARGE_SHAPE, tokenizer, train_queries, rng, lr=1e-3)
    print(f"toy: larger SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    return measure(os.path.join(folder, "sft_policy"), REWARD_MODEL, DATASET, seed)


def build_pipeline(seed: int = 0) -> None:
    """Build the pipeline's starting points into PIPELINE_DIR unless they are there (the toy world first)."""
    build()
    built_once(PIPELINE_DIR, make_pipeline, seed, "the pipeline's data")


def make_pipeline(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """What sft.py and reward_model.py start from, on the toy world's prompts: an untrained policy of the
    small shape (the "pretrained" model; with the world's tokenizer), SFT data (prompt, completion: the
    rambling targets the toy's own SFT policy learned from) and human-like preference pairs (prompt, chosen,
    rejected: candidate pairs ordered by the gold judge, LABEL_NOISE of them swapped, as human labels
    disagree with a gold judge; relabelling with the gold scorer undoes that)."""
    toy_splits = load_from_disk(DATASET)
    splits = {"sft_dataset": {}, "preference_dataset": {}}
    for split in ("train", "validation"):
        queries = list(toy_splits[split]["query"])
        splits["sft_dataset"][split] = Dataset.from_dict(
            {"prompt": queries, "completion": [rambling_target(q, rng) for q in queries]})
        prompts, chosen, rejected = gold_labelled_pairs(queries, rng, len(queries) // 2)
        swapped = [rng.random() < LABEL_NOISE for _ in prompts]
        splits["preference_dataset"][split] = Dataset.from_dict({
            "prompt": prompts,
            "chosen": [r if swap else c for c, r, swap in zip(chosen, rejected, swapped)],
            "rejected": [c if swap else r for c, r, swap in zip(chosen, rejected, swapped)]})
    for name, dataset in splits.items():
        DatasetDict(dataset).save_to_disk(os.path.join(folder, name))
    tokenizer = AutoTokenizer.from_pretrained(SFT_POLICY)
    policy = LlamaForCausalLM(model_config(SMALL_SHAPE, tokenizer))
    policy.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    policy.save_pretrained(os.path.join(folder, "base_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "base_policy"))
    return {"sft_examples": {split: len(d) for split, d in splits["sft_dataset"].items()},
            "preference_pairs": {split: len(d) for split, d in splits["preference_dataset"].items()},
            "label_noise": LABEL_NOISE}


# ---------------------------------------------------------------- the arithmetic task
# Problems "Q: 37 + 48 = ? A:" with GSM8k-style worked solutions " 7 + 8 = 15 , 3 + 4 + 1 = 8 #### 85".
# The SFT policy has the skill but a visible fault: in problems that carry from the units column it often
# forgets the carry, as its SFT data did (most often when the units sum to 10-14), so near-greedy it is
# right on about a third of the problems, and sampling finds the right answer often enough for RL.
# (reasoning-gym's procedural generators were considered: 11 pinned dependencies for ~100 puzzle families,
# and no worked solutions to train the SFT policy on; two-number addition is a few lines.)
MATH_RESPONSE_LENGTH = 24
MATH_SFT_STEPS = 2000  # new tokens: a solution is at most 19 with its stop token
CARRY_SHARE = 0.85  # of the problems, those that carry from the units column


def forgets_carry_probability(units_sum: int) -> float:
    """How often the SFT solutions forget a carry: mostly for small carries, so that greedy decoding is
    wrong there and right for units summing to 15-18."""
    return 0.7 if units_sum < 15 else 0.2
DIGITS = [str(d) for d in range(10)]
MATH_WORDS = [PAD, EOS, UNK, "Q:", "A:", "+", "=", "?", ",", "####", *DIGITS, *(f"~{d}" for d in DIGITS)]


def make_problem(rng: random.Random) -> tuple[int, int]:
    """Two 2-digit numbers; CARRY_SHARE of the problems carry from the units column."""
    carries = rng.random() < CARRY_SHARE
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a % 10 + b % 10 >= 10) == carries:
            return a, b


def math_question(a: int, b: int) -> str:
    return f"Q: {a} + {b} = ? A:"


def worked_solution(a: int, b: int, forget_carry: bool = False) -> str:
    """Column addition, units then tens, ending in GSM8k's `#### N` (wrong when the carry is forgotten)."""
    units = a % 10 + b % 10
    carry = 0 if forget_carry else units // 10
    tens = a // 10 + b // 10 + carry
    carried = f" + {carry}" if carry else ""
    return f" {a % 10} + {b % 10} = {units} , {a // 10} + {b // 10}{carried} = {tens} #### {tens * 10 + units % 10}"


def math_splits(rng: random.Random) -> DatasetDict:
    """8192 train and 512 test problems: the prompt ("question"), the worked solution ("answer", GSM8k's
    column names) and the two numbers."""
    splits = {}
    for split, size in [("train", 8192), ("test", 512)]:
        problems = [make_problem(rng) for _ in range(size)]
        splits[split] = Dataset.from_dict({
            "question": [math_question(a, b) for a, b in problems],
            "answer": [worked_solution(a, b).strip() for a, b in problems],
            "a": [a for a, _ in problems], "b": [b for _, b in problems]})
    return DatasetDict(splits)


def make_math_tokenizer() -> PreTrainedTokenizerFast:
    """Words and single digits; a number is its digits ("85" -> "8", "~5"), decoded back to "85" (not "##" as
    the continuation prefix: it would glue "####" to the word before it)."""
    wordpiece = Tokenizer(models.WordPiece({w: i for i, w in enumerate(MATH_WORDS)}, unk_token=UNK,
                                           continuing_subword_prefix="~"))
    wordpiece.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wordpiece.decoder = decoders.WordPiece(prefix="~", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=wordpiece, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", clean_up_tokenization_spaces=False)


def math_sft_loss(policy, tokenizer, problems, rng, batch_size=32) -> torch.Tensor:
    """Next-token loss on the solution tokens of SFT targets with the fault."""
    batch = rng.sample(problems, batch_size)
    query_ids = tokenizer([math_question(a, b) for a, b in batch])["input_ids"]
    targets = [worked_solution(a, b, forget_carry=rng.random() < forgets_carry_probability(a % 10 + b % 10))
               + f" {EOS}" for a, b in batch]
    response_ids = tokenizer(targets)["input_ids"]
    sequences = [q + r for q, r in zip(query_ids, response_ids)]
    input_ids, attention_mask, position_ids = left_padded(sequences, tokenizer.pad_token_id)
    is_response = left_padded([[0] * len(q) + [1] * len(r) for q, r in zip(query_ids, response_ids)], 0)[0]
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    token_losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
    return (token_losses * is_response[:, 1:]).sum() / is_response.sum()


def states_the_sum(completion: str, a: int, b: int) -> bool:
    """Whether the number after the completion's first `####` (GSM8k's answer format) is a + b."""
    match = re.search(r"####\s*(-?[\d,]*\.?\d+)", completion)
    return match is not None and float(match.group(1).replace(",", "")) == a + b


def measure_math(folder: str) -> dict:
    """The SFT policy's accuracy on the test problems, from the saved artefacts."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "sft_policy"))
    policy = LlamaForCausalLM.from_pretrained(os.path.join(folder, "sft_policy"))
    test = load_from_disk(os.path.join(folder, "dataset"))["test"]
    inputs = tokenizer(list(test["question"]), return_tensors="pt", padding=True)
    accuracy = {}
    for name, sampling in [("greedy", dict(do_sample=False)), ("sampled", dict(do_sample=True, temperature=0.7))]:
        with torch.no_grad():
            output = policy.generate(**inputs, max_new_tokens=MATH_RESPONSE_LENGTH, **sampling)
        completions = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        accuracy[name] = sum(map(states_the_sum, completions, test["a"], test["b"])) / len(test)
    carrying = [a % 10 + b % 10 >= 10 for a, b in zip(test["a"], test["b"])]
    return {"sft_greedy_accuracy": accuracy["greedy"], "sft_sampled_accuracy": accuracy["sampled"],
            "carrying_share": sum(carrying) / len(carrying),
            "policy_parameters": sum(p.numel() for p in policy.parameters()),
            "example": test["question"][0] + completions[0]}


def build_math(seed: int = 0) -> None:
    """Build the arithmetic task into MATH_DIR unless it is already there."""
    built_once(MATH_DIR, make_math, seed, "the arithmetic task")


def make_math(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """The arithmetic task into `folder`: problems with gold answers, its tokenizer, the SFT policy;
    returns the numbers measured on it."""
    splits = math_splits(rng)
    splits.save_to_disk(os.path.join(folder, "dataset"))
    train_problems = list(zip(splits["train"]["a"], splits["train"]["b"]))

    tokenizer = make_math_tokenizer()
    policy = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(MATH_WORDS), **SMALL_SHAPE, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id))
    policy.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    loss = train(policy, lambda: math_sft_loss(policy, tokenizer, train_problems, rng), steps=MATH_SFT_STEPS,
                 lr=3e-3)
    print(f"toy: arithmetic SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))

    return measure_math(folder)


# ---------------------------------------------------------------- the guess-the-number environment
# A multi-turn environment (grpo_multiturn*.py): the policy guesses a secret number from 1 to GUESS_RANGE, the
# environment answers "higher" or "lower", and the episode ends with reward 1 when a guess is right (within
# GUESS_TURNS turns: binary search always wins, the ceiling is 1). The SFT policy knows the game but has a
# visible fault: it guesses the midpoint of the numbers still possible only MIDPOINT_SHARE of the time, else
# the lowest of them (a linear search), so near-greedy it wins about GUESS_TURNS / GUESS_RANGE of the games.
GUESS_RANGE = 15
GUESS_TURNS = 4
MIDPOINT_SHARE = 0.35
GUESS_WORDS = [PAD, EOS, UNK, "guess", "a", "number", "from", "to", ":", "higher", "lower", "invalid",
               *(str(n) for n in range(1, GUESS_RANGE + 1))]
GUESS_SFT_STEPS = 700  # 29 s on 2 cores; near-greedy a linear search (0.24), as after 1500 steps (61 s)


class GuessTheNumber:
    """The environment contract (README, "Multi-turn environments"): reset(row, seed) -> the first message;
    step(action) -> (next message, reward, done). The row holds the secret; an action that is not one number
    in range costs the turn ("invalid")."""

    latency = 0.0  # seconds a step takes (a simulated tool), jittered by the episode's seed

    def reset(self, row: dict, seed: int) -> str:
        self.secret, self.rng = row["secret"], random.Random(seed)
        return f"guess a number from 1 to {GUESS_RANGE} :"

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self.latency:
            time.sleep(self.latency * self.rng.uniform(0.5, 1.5))
        words = action.split()
        if len(words) != 1 or words[0] not in GUESS_WORDS[-GUESS_RANGE:]:
            return "invalid :", 0.0, False
        guess = int(words[0])
        if guess == self.secret:
            return None, 1.0, True
        return ("higher :" if self.secret > guess else "lower :"), 0.0, False


class SlowGuessTheNumber(GuessTheNumber):
    """GuessTheNumber whose steps take 25-75 ms (50 on average), as a tool call would."""

    latency = 0.05


ENVIRONMENTS = {"guess_number": GuessTheNumber, "guess_number_slow": SlowGuessTheNumber}  # --env toy:NAME


def sft_guess(low: int, high: int, rng: random.Random) -> int:
    """The SFT policy's habit: the midpoint of the numbers still possible, or (mostly) the lowest of them."""
    return (low + high) // 2 if rng.random() < MIDPOINT_SHARE else low


def guess_episode(secret: int, rng: random.Random) -> list[tuple[str, bool]]:
    """A game played by the SFT habit, as (text, whether the policy wrote it) pieces, in the format the
    multi-turn scripts build (each action ends with its stop token; no message after the last turn)."""
    env = GuessTheNumber()
    pieces, low, high = [(env.reset({"secret": secret}, 0), False)], 1, GUESS_RANGE
    for turn in range(GUESS_TURNS):
        guess = sft_guess(low, high, rng)
        pieces.append((f"{guess} {EOS}", True))
        message, _, done = env.step(str(guess))
        if done or turn == GUESS_TURNS - 1:
            return pieces
        pieces.append((message, False))
        low, high = (guess + 1, high) if message.startswith("higher") else (low, guess - 1)
    return pieces


def guess_sft_loss(policy, tokenizer, secrets, rng, batch_size=32) -> torch.Tensor:
    """Next-token loss on the policy's own tokens (the guesses and their stop tokens) of SFT games."""
    sequences, is_action = [], []
    for secret in rng.sample(secrets, batch_size):
        ids, action = [], []
        for text, by_policy in guess_episode(secret, rng):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, action = ids + piece, action + [int(by_policy)] * len(piece)
        sequences.append(ids)
        is_action.append(action)
    input_ids, attention_mask, position_ids = left_padded(sequences, tokenizer.pad_token_id)
    is_action = left_padded(is_action, 0)[0]
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    token_losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
    return (token_losses * is_action[:, 1:]).sum() / is_action[:, 1:].sum()


def play_greedy(policy, tokenizer, secrets: list[int], strategy=None) -> float:
    """The share of games won by the policy's greedy guesses (or by strategy(low, high) when given)."""
    wins = 0
    for secret in secrets:
        env, low, high = GuessTheNumber(), 1, GUESS_RANGE
        text = env.reset({"secret": secret}, 0)
        for _ in range(GUESS_TURNS):
            if strategy is None:
                inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
                with torch.no_grad():
                    output = policy.generate(**inputs, max_new_tokens=3, do_sample=False)
                action = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            else:
                action = str(strategy(low, high))
            message, reward, done = env.step(action)
            if done:
                wins += reward == 1.0
                break
            text += f" {action} {EOS} {message}"
            if action.isdigit():
                low, high = (int(action) + 1, high) if message.startswith("higher") else (low, int(action) - 1)
    return wins / len(secrets)


def build_guess(seed: int = 0) -> None:
    """Build the guess-the-number environment's policy and rows into GUESS_DIR unless they are there."""
    built_once(GUESS_DIR, make_guess, seed, "the guess-the-number environment")


def make_guess(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """Rows (the secrets) and the SFT policy of the guess-the-number environment into `folder`; returns the
    win rates measured on it."""
    splits = DatasetDict({split: Dataset.from_dict({"secret": [rng.randint(1, GUESS_RANGE) for _ in range(size)]})
                          for split, size in [("train", 4096), ("validation", 256)]})
    splits.save_to_disk(os.path.join(folder, "dataset"))
    tokenizer = make_tokenizer(GUESS_WORDS)
    policy = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(GUESS_WORDS), **SMALL_SHAPE, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id))
    policy.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    secrets = list(splits["train"]["secret"])
    loss = train(policy, lambda: guess_sft_loss(policy, tokenizer, secrets, rng), steps=GUESS_SFT_STEPS, lr=3e-3)
    print(f"toy: guess-the-number SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    validation = list(splits["validation"]["secret"])
    return {"sft_greedy_win_rate": play_greedy(policy, tokenizer, validation),
            "linear_search_win_rate": play_greedy(None, None, validation, lambda low, high: low),
            "binary_search_win_rate": play_greedy(None, None, validation, lambda low, high: (low + high) // 2),
            "policy_parameters": sum(p.numel() for p in policy.parameters())}


# ----------------------------------------------------------------------------------------------
# The addition task with a tool: a chat template, tool calls in the Hermes format
# ----------------------------------------------------------------------------------------------
TOOLS_OPERANDS = range(10, 50)  # two-digit numbers: sums from 20 to 98
TOOLS_SHARE = 0.5  # of the SFT episodes, those that call the tool before answering (reading its result off)
TOOLS_FIRST_TOKEN = 0.14  # of those, the ones whose <tool_call> token is trained: the policy starts a call in ~12%
TOOLS_MISS = (-2, -1, 0, 1, 2)  # the SFT policy's habit without the tool: the sum, off by one of these
TOOLS_SFT_STEPS = 2000
TOOLS_WORDS = [PAD, EOS, UNK, "add", "and", ":", "tools", "user", "assistant", "tool", "<tool_call>", "</tool_call>",
               '{"name":', '"add",', '"arguments":', '{"a":', ",", '"b":', "}", *(str(n) for n in range(100))]
# renders the tools' names, then each message as "role : content", an assistant turn ended by its stop token
TOOLS_TEMPLATE = ("{%- if tools %}tools : {% for tool in tools %}{{ tool.function.name }} {% endfor %}{% endif %}"
                  "{%- for message in messages %}{{ message.role }} : {{ message.content }}"
                  "{% if message.role == 'assistant' %}" + EOS + "{% endif %} {% endfor %}"
                  "{%- if add_generation_prompt %}assistant : {% endif %}")


class AddWithTool:
    """The addition task (--env toy:add_with_tool): two numbers to add; the policy may call the tool `add` (in the
    Hermes format) and then answers with a number: reward 1 for the right sum."""

    def __init__(self):
        self.tools = [self.add]

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    def reset(self, row: dict, seed: int) -> str:
        self.answer = row["a"] + row["b"]
        return f"add {row['a']} and {row['b']} :"

    def step(self, action: str) -> tuple[str | None, float, bool]:
        return None, float(action.split() == [str(self.answer)]), True


ENVIRONMENTS["add_with_tool"] = AddWithTool


def tool_call_text(a: int, b: int) -> str:
    """The call of add(a, b) in the Hermes format, in the task's words."""
    return f'<tool_call> {{"name": "add", "arguments": {{"a": {a} , "b": {b} }} }} </tool_call>'


def tools_episode(tokenizer, schemas: list[dict], a: int, b: int, calls: bool,
                  rng: random.Random | None = None) -> list[tuple[list[int], bool]]:
    """An SFT episode as (ids, whether the policy wrote them) pieces, as the multi-turn scripts build it through the
    chat template: the first message (with the tools), then a call of the tool and its result and the answer read
    off it, or an answer from memory (the SFT habit with `rng`: off by one of TOOLS_MISS), each turn ended by the
    stop token."""
    first = [{"role": "user", "content": f"add {a} and {b} :"}]
    render = lambda messages: tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,  # noqa: E731
                                                            add_generation_prompt=True)
    pieces = [(tokenizer(render(first), add_special_tokens=False)["input_ids"], False)]
    turns = first
    if calls:
        call = tool_call_text(a, b)
        pieces.append((tokenizer(f"{call} {EOS}", add_special_tokens=False)["input_ids"], True))
        before = render(turns + [{"role": "assistant", "content": call}])[:-len("assistant : ")]
        turns = turns + [{"role": "assistant", "content": call}, {"role": "tool", "content": str(a + b)}]
        pieces.append((tokenizer(render(turns)[len(before):], add_special_tokens=False)["input_ids"], False))
    answer = a + b if calls or rng is None else a + b + rng.choice(TOOLS_MISS)
    pieces.append((tokenizer(f"{answer} {EOS}", add_special_tokens=False)["input_ids"], True))
    return pieces


def build_tools(seed: int = 0) -> None:
    """Build the addition task with a tool into TOOLS_DIR unless it is there."""
    built_once(TOOLS_DIR, make_tools, seed, "the addition task with a tool")


def make_tools(folder: str, seed: int, rng: random.Random, start: float) -> dict:
    """Rows (the two numbers) and the SFT policy of the addition task with a tool into `folder`: a policy that can call
    the tool and read its result off, but starts a call in only about an eighth of its episodes and answers from
    memory in the others, often off by a little; returns the rates measured."""
    from transformers.utils import get_json_schema

    splits = DatasetDict({split: Dataset.from_dict({"a": [rng.choice(TOOLS_OPERANDS) for _ in range(size)],
                                                    "b": [rng.choice(TOOLS_OPERANDS) for _ in range(size)]})
                          for split, size in [("train", 4096), ("validation", 256)]})
    splits.save_to_disk(os.path.join(folder, "dataset"))
    tokenizer = make_tokenizer(TOOLS_WORDS)
    tokenizer.chat_template = TOOLS_TEMPLATE
    schemas = [get_json_schema(tool) for tool in AddWithTool().tools]
    policy = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(TOOLS_WORDS), **SMALL_SHAPE, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id))
    policy.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    rows = list(zip(splits["train"]["a"], splits["train"]["b"]))

    def loss_of_batch(batch_size: int = 32) -> torch.Tensor:
        sequences, is_action = [], []
        for a, b in rng.sample(rows, batch_size):
            calls = rng.random() < TOOLS_SHARE
            pieces = tools_episode(tokenizer, schemas, a, b, calls, rng)
            sequences.append([i for ids, _ in pieces for i in ids])
            is_action.append([int(by_policy) for ids, by_policy in pieces for _ in ids])
            if calls and rng.random() > TOOLS_FIRST_TOKEN:  # the call taught, not how often to start one
                is_action[-1][len(pieces[0][0])] = 0
        input_ids, attention_mask, position_ids = left_padded(sequences, tokenizer.pad_token_id)
        mask = left_padded(is_action, 0)[0]
        logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        token_losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
        return (token_losses * mask[:, 1:]).sum() / mask[:, 1:].sum()

    loss = train(policy, loss_of_batch, steps=TOOLS_SFT_STEPS, lr=3e-3)
    print(f"toy: addition-with-a-tool SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    validation = list(zip(splits["validation"]["a"], splits["validation"]["b"]))
    return {**tools_rates(policy, tokenizer, schemas, validation),
            "policy_parameters": sum(p.numel() for p in policy.parameters())}


def tools_rates(policy, tokenizer, schemas, rows) -> dict:
    """The shares of first turns that call the tool and of first turns that answer right, greedy and sampled."""
    rates = {}
    for name, sampled in (("greedy", False), ("sampled", True)):
        calls = right = 0
        torch.manual_seed(0)
        for a, b in rows:
            first = tools_episode(tokenizer, schemas, a, b, calls=False)[0][0]
            with torch.no_grad():
                output = policy.generate(torch.tensor([first]), max_new_tokens=16, do_sample=sampled, top_k=0)
            text = tokenizer.decode(output[0, len(first):], skip_special_tokens=True)
            calls += text.startswith("<tool_call>")
            right += text.split() == [str(a + b)]
        rates |= {f"sft_{name}_tool_call_rate": calls / len(rows), f"sft_{name}_direct_accuracy": right / len(rows)}
    return rates


def summary(size: str = "small") -> dict:
    """Build if needed, then print and return the numbers measured at build time (`size` "large": those of
    the larger SFT policy)."""
    (build_large if size == "large" else build)()
    with open(os.path.join(LARGE_DIR if size == "large" else TOY_DIR, "summary.json")) as f:
        numbers = json.load(f)
    for name, value in numbers.items():
        print(f"{name:>32}: {value:.3f}" if isinstance(value, float) else f"{name:>32}: {value}")
    return numbers


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["small"], ["large"]):
        raise SystemExit(f"usage: python toy.py [small|large] (the SFT policy's size), got {' '.join(sys.argv[1:])}")
    summary(*sys.argv[1:])
