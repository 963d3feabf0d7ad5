"""The addition task with a tool (--env toy:add_with_tool): a chat template, tool calls in the Hermes format. Two
numbers to add; the policy may call the tool `add` and then answers with a number. Its SFT policy can call the tool
and read its result off, but starts a call in only about an eighth of its episodes and answers from memory in the
others, often off by a little."""

import os
import random
import time

import torch
from datasets import Dataset, DatasetDict
from transformers.utils import get_json_schema

from toy.builder import (
    EOS,
    PAD,
    SMALL_SHAPE,
    UNK,
    built_once,
    cache_folder,
    llama_config,
    make_tokenizer,
    masked_sft_loss,
    parameter_count,
    train,
    untrained_policy,
)

TOOLS_DIR = cache_folder("tools", __file__)
TOOLS_POLICY = os.path.join(TOOLS_DIR, "sft_policy")
TOOLS_DATASET = os.path.join(TOOLS_DIR, "dataset")
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
    """Rows (the two numbers) and the SFT policy of the addition task with a tool into `folder`; returns the rates
    measured on it."""
    splits = DatasetDict({split: Dataset.from_dict({"a": [rng.choice(TOOLS_OPERANDS) for _ in range(size)],
                                                    "b": [rng.choice(TOOLS_OPERANDS) for _ in range(size)]})
                          for split, size in [("train", 4096), ("validation", 256)]})
    splits.save_to_disk(os.path.join(folder, "dataset"))
    tokenizer = make_tokenizer(TOOLS_WORDS)
    tokenizer.chat_template = TOOLS_TEMPLATE
    schemas = [get_json_schema(tool) for tool in AddWithTool().tools]
    policy = untrained_policy(llama_config(len(TOOLS_WORDS), SMALL_SHAPE, tokenizer, max_positions=64), tokenizer)
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
        return masked_sft_loss(policy, sequences, is_action, tokenizer.pad_token_id)

    loss = train(policy, loss_of_batch, steps=TOOLS_SFT_STEPS, lr=3e-3)
    print(f"toy: addition-with-a-tool SFT policy trained, final loss {loss:.3f} ({time.time() - start:.0f} s)")
    policy.save_pretrained(os.path.join(folder, "sft_policy"))
    tokenizer.save_pretrained(os.path.join(folder, "sft_policy"))
    validation = list(zip(splits["validation"]["a"], splits["validation"]["b"]))
    return {**tools_rates(policy, tokenizer, schemas, validation), "policy_parameters": parameter_count(policy)}


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
