"""The embedded default task: a tiny synthetic world shaped like TL;DR summarisation.

Each post names a subreddit and mentions 2-4 "key" nouns of its topic among filler words; a good
summary lists the key nouns and stops. `gold_score` is the programmatic gold judge. The SFT
policy has the skill but a visible fault: it rambles a sign-off phrase instead of stopping, so
near-greedy it almost never beats the references, while a policy that learned to stop would.
References are noisy, so even a perfect summary beats them only about 2 times in 3 (the ceiling).

`build` makes the dataset, tokenizer, SFT policy and reward model once, deterministically, on CPU, and saves
them in Hugging Face formats; the training scripts load them with `from_pretrained` / `load_from_disk`.
"""

import itertools
import os
import random
import time

import torch
import torch.nn.functional as F
from datasets import Dataset, DatasetDict, load_from_disk
from transformers import AutoTokenizer, LlamaForCausalLM, LlamaForSequenceClassification

from toy.builder import (
    EOS,
    PAD,
    SMALL_SHAPE,
    UNK,
    built_once,
    cache_folder,
    left_padded,
    llama_config,
    make_tokenizer,
    masked_sft_loss,
    parameter_count,
    train,
    untrained_policy,
)

TOY_DIR = cache_folder("", __file__)
SFT_POLICY = os.path.join(TOY_DIR, "sft_policy")
REWARD_MODEL = os.path.join(TOY_DIR, "reward_model")  # always of the small shape
DATASET = os.path.join(TOY_DIR, "dataset")
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
        raise ValueError(f"not a toy post (gold_score only judges the toy's TL;DR-like world): {query[:80]!r}")
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
def model_config(shape: dict, tokenizer, **extra):
    return llama_config(len(WORDS), shape, tokenizer, max_positions=128, **extra)


def last_token_scores(reward_model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Score head read at the last real token: the trainers' convention, not HF's pad-based pooling."""
    hidden = reward_model.model(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids).last_hidden_state
    last = (attention_mask * torch.arange(attention_mask.shape[1])).argmax(-1)
    return reward_model.score(hidden[torch.arange(len(hidden)), last]).squeeze(-1)


def sft_loss(policy, tokenizer, queries, rng, batch_size=32) -> torch.Tensor:
    """Next-token loss on the response tokens only."""
    batch = rng.sample(queries, batch_size)
    query_ids = tokenizer(batch)["input_ids"]
    response_ids = tokenizer([rambling_target(q, rng) for q in batch])["input_ids"]
    return masked_sft_loss(policy, [q + r for q, r in zip(query_ids, response_ids)],
                           [[0] * len(q) + [1] * len(r) for q, r in zip(query_ids, response_ids)],
                           tokenizer.pad_token_id)


def sft_policy(shape: dict, tokenizer, train_queries, rng, lr: float) -> tuple[LlamaForCausalLM, float]:
    """A policy of `shape` trained on the rambling SFT targets; returns it and its last batch's loss."""
    policy = untrained_policy(model_config(shape, tokenizer), tokenizer)
    return policy, train(policy, lambda: sft_loss(policy, tokenizer, train_queries, rng), steps=1200, lr=lr)


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
        "policy_parameters": parameter_count(policy),
        "reward_model_parameters": parameter_count(reward_model),
        "example": queries[0] + sft[0],
    }


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

    tokenizer = make_tokenizer(WORDS)
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
