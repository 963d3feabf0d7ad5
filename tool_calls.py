"""Tool calling in multi-turn environments (environments.EpisodeLoop): an environment's `tools` (callables with type
hints and a Google-style docstring) and their JSON schemas for the chat template; the contract a chat template must
keep to play tool episodes (check_tool_template); the policy's calls read from the ids it sampled, in the model's own
format (the tokenizer's response parser where transformers has one, else --tool_call_format: hermes, llama3_json,
mistral, qwen3_xml); the calls made, their arguments checked against the schemas first, each result or error a `tool`
message the policy reads next; and TRL-style environment classes (their public methods are their tools) run as they
are written (trl_environment)."""

import asyncio
import inspect
import json
import os
import re
from typing import NamedTuple

import common


def tool_schemas(env_class: type, spec: str) -> list[dict]:
    """The JSON schemas of the tools an environment lists in its `tools` attribute (read off one built with no
    arguments), by transformers' get_json_schema: type hints and a Google-style docstring (one line otherwise)."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in getattr(env_class(), "tools", None) or []:
        if not callable(tool):
            common.fail(f"--env {spec!r}: its tools must be callables (functions or methods), got {tool!r:.80}")
        try:
            schemas.append(get_json_schema(tool))
        except Exception as error:
            common.fail(f"--env {spec!r}: tool {getattr(tool, '__name__', tool)!r} has no JSON schema ({error}); a "
                        "tool needs type hints and a Google-style docstring with an Args: section")
    return schemas


# ----------------------------------------------------------------------------------------------
# The chat template's contract: what a template must render for tool episodes to play
# ----------------------------------------------------------------------------------------------
PROBE_RESULT = "probe_result_4812"  # a tool's result, which the template must render
PROBE_CALL_ID = "call00000"  # nine alphanumerics: Mistral's templates refuse other tool call ids
PROBE_ARGUMENTS = {"probe_text": "alpha", "probe_number": 7}


def call_id(number: int) -> str:
    """The id of an episode's `number`-th tool call, which its tool message names (tool_call_id)."""
    return f"call{number:05d}"


def probe_call(name: str) -> dict:
    """An assistant turn calling tool `name` with PROBE_ARGUMENTS, as chat templates take it."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": PROBE_CALL_ID, "function": {"name": name, "arguments": PROBE_ARGUMENTS}}]}


def raised(error: BaseException) -> str:
    """An exception on one line (a template's message may hold several), at most about 200 characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split()):.200}"


def check_tool_template(tokenizer, tools: list[dict], template: str, template_kwargs: dict):
    """Refuse on one line a chat template (named by `template`) that cannot play tool episodes: rendering a user
    message, an assistant turn calling a tool and that tool's result must not raise, the tools' schemas must reach
    the rendering (each tool's name appears more often with the tools than without), and so must the result."""
    names = [schema["function"]["name"] for schema in tools]
    user = [{"role": "user", "content": "hello"}]
    result = {"role": "tool", "tool_call_id": PROBE_CALL_ID, "name": names[0], "content": PROBE_RESULT}
    render = lambda messages, tools: tokenizer.apply_chat_template(  # noqa: E731
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs)
    way_out = "give one that can, --chat_template_path FILE.jinja"
    try:
        without, with_tools = render(user, None), render(user, tools)
        rendered = render(user + [probe_call(names[0]), result], tools)
    except Exception as error:  # the template's own raise_exception, or any error of its code
        common.fail(f"the chat template {template} cannot render a tool call and its result (it raised "
                    f"{raised(error)}); {way_out}")
    unseen = [name for name in names if with_tools.count(name) <= without.count(name)]
    if unseen:
        common.fail(f"the chat template {template} does not render the tools' schemas (no sign of "
                    f"{', '.join(unseen)}): the policy would never see its tools; {way_out}")
    if PROBE_RESULT not in rendered:
        common.fail(f"the chat template {template} does not render a tool message's content: the policy would "
                    f"never see its tools' results; {way_out}")


# ----------------------------------------------------------------------------------------------
# The policy's calls, in the model's own format
# ----------------------------------------------------------------------------------------------
class ToolCall(NamedTuple):
    """A call the policy wrote: the tool's name and its arguments, or `error`, what was wrong with it."""

    name: str = ""
    arguments: dict | None = None
    error: str | None = None


def call_from(parsed, names: tuple[str, ...] = ("arguments",), block: str = "") -> ToolCall:
    """A call from a format's parsed JSON: {"name": str, <one of `names`>: an object or a JSON string of one}; a
    missing or null argument object is no arguments."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return ToolCall(error=f'a tool call is {{"name": ..., "{names[0]}": {{...}}}}, got {block or parsed!r:.80}')
    arguments = next((parsed[name] for name in names if name in parsed), None)
    if isinstance(arguments, str):  # some formats give the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else None
        except json.JSONDecodeError as error:
            return ToolCall(parsed["name"], error=f"the arguments of {parsed['name']} are not JSON ({error.msg}): "
                                                  f"{arguments!r:.80}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(parsed["name"], error=f"the arguments of {parsed['name']} are not an object: {arguments!r:.80}")
    return ToolCall(parsed["name"], arguments)


def json_values(text: str) -> tuple[list, str | None]:
    """The JSON values at the start of `text`, one after the other (separated by blanks or `;`), and what was wrong
    where the next one is not JSON (None when the rest is blank or not JSON-like text after the last)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
        if position == len(text) or text[position] not in "[{":
            return values, None
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            return values, f"the tool call is not JSON ({error.msg}): {text[position:].strip()!r:.80}"
        values.append(value)


def blocks(text: str, start: str, end: str) -> tuple[list[str], bool]:
    """The texts between `start` and `end` markers, and whether a `start` is left unclosed."""
    found = re.findall(re.escape(start) + "(.*?)" + re.escape(end), text, re.DOTALL)
    return found, text.count(start) > text.count(end)


def parse_hermes(text: str, schemas: dict) -> list[ToolCall]:
    """Hermes, Qwen2.5, Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, once per call."""
    calls = []
    found, unclosed = blocks(text, "<tool_call>", "</tool_call>")
    for block in found:
        try:
            calls.append(call_from(json.loads(block), block=block.strip()))
        except json.JSONDecodeError as error:
            calls.append(ToolCall(error=f"the tool call is not JSON ({error.msg}): {block.strip()!r:.80}"))
    if unclosed:
        calls.append(ToolCall(error="a <tool_call> is not closed by </tool_call>"))
    return calls


def parse_llama3_json(text: str, schemas: dict) -> list[ToolCall]:
    """Llama 3.1-3.3: a JSON object {"name": ..., "parameters": {...}} as the turn (several separated by `;`), after
    <|python_tag|> or not; an untagged turn that is not such an object is an answer."""
    tagged = "<|python_tag|>" in text
    body = text.split("<|python_tag|>", 1)[1] if tagged else text
    values, problem = json_values(body)
    if not tagged and not (values and isinstance(values[0], dict) and "name" in values[0]):
        looks_like_a_call = problem is not None and not values and '"name"' in body
        return [ToolCall(error=problem)] if looks_like_a_call else []
    calls = [call_from(value, ("parameters", "arguments")) for value in values]
    return calls + ([ToolCall(error=problem)] if problem else [])


MISTRAL_CALL = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*\S*?\s*)?\[ARGS\](.*)", re.DOTALL)


def parse_mistral(text: str, schemas: dict) -> list[ToolCall]:
    """Mistral's: [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}} (v3 tokenizers: Mistral 7B
    v0.3, Small 3.1), or NAME[ARGS]{...} (with [CALL_ID]ID before [ARGS] in Small 3.2) after each [TOOL_CALLS]."""
    calls = []
    for chunk in text.split("[TOOL_CALLS]")[1:]:
        if chunk.lstrip().startswith("["):
            values, problem = json_values(chunk)
            listed = values[0] if values else []
            calls += [call_from(value) for value in listed] if isinstance(listed, list) else [call_from(listed)]
        elif (match := MISTRAL_CALL.match(chunk)) is not None:
            values, problem = json_values(match.group(2))
            calls.append(call_from({"name": match.group(1), "arguments": values[0] if values else None}))
        else:
            problem = f"a tool call is [TOOL_CALLS]NAME[ARGS]{{...}}, got {chunk.strip()!r:.80}"
        if problem:
            calls.append(ToolCall(error=problem))
    return calls


FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_xml(text: str, schemas: dict) -> list[ToolCall]:
    """Qwen3-Coder, Qwen3.5: <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>. A
    value is text: as it is for a parameter of type string, else as JSON where it is JSON."""
    calls = []
    found, unclosed = blocks(text, "<tool_call>", "</tool_call>")
    for block in found:
        function = FUNCTION.search(block)
        if function is None:
            calls.append(ToolCall(error=f"a tool call is <function=NAME>...</function>, got {block.strip()!r:.80}"))
            continue
        name = function.group(1).strip()
        properties = schemas.get(name, {}).get("parameters", {}).get("properties", {})
        arguments = {}
        for key, value in PARAMETER.findall(function.group(2)):
            key, value = key.strip(), value.strip("\n")
            arguments[key] = value if properties.get(key, {}).get("type") == "string" else json_or_text(value)
        calls.append(ToolCall(name, arguments))
    if unclosed:
        calls.append(ToolCall(error="a <tool_call> is not closed by </tool_call>"))
    return calls


def json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral,
           "qwen3_xml": parse_qwen3_xml}
# the markers of each format, in a template's source or a tokenizer's vocabulary (choose_format)
MARKERS = (("[TOOL_CALLS]", "mistral"), ("<function=", "qwen3_xml"), ("<tool_call>", "hermes"),
           ("<|python_tag|>", "llama3_json"))
REASONING = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def outside_reasoning(text: str) -> str:
    """`text` without its reasoning blocks (<think>...</think>, [THINK]...[/THINK]): what comes before a closing
    marker with no opening one (the template's prompt opened the block), each block, and an unclosed block to the
    end. A call inside one is thought, not made."""
    for start, end in REASONING:
        if end in text and (start not in text or text.index(end) < text.index(start)):
            text = text.split(end, 1)[1]
        text = re.sub(re.escape(start) + ".*?" + re.escape(end), "", text, flags=re.DOTALL)
        text = text.split(start, 1)[0]
    return text


def choose_format(tokenizer, requested: str, tools: list[dict], template: str, template_kwargs: dict) -> str:
    """The format the policy's calls are read in: `requested` (--tool_call_format) unless auto; else the tokenizer's
    own response parser (response_template) where it has one; else the format whose parser reads back the call the
    template renders; else the one whose markers the template or the tokenizer's vocabulary holds; else one line."""
    if requested != "auto":
        return requested
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template"
    name = tools[0]["function"]["name"]
    user = [{"role": "user", "content": "hello"}]
    prompt = tokenizer.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True,
                                           **template_kwargs)
    rendered = tokenizer.apply_chat_template(user + [probe_call(name)], tools=tools, tokenize=False,
                                             **template_kwargs)
    turn = outside_reasoning(rendered[len(os.path.commonprefix([prompt, rendered])):])
    schemas = {schema["function"]["name"]: schema["function"] for schema in tools}
    for format_name, parse in PARSERS.items():
        if parse(turn, schemas) == [ToolCall(name, PROBE_ARGUMENTS)]:
            return format_name
    vocabulary = tokenizer.get_vocab()
    for marker, format_name in MARKERS:
        if marker in str(tokenizer.chat_template) or marker in vocabulary:  # (a dict: a tokenizer's named ones)
            return format_name
    common.fail(f"the chat template {template} renders no tool call in a format the kit reads ({', '.join(PARSERS)}) "
                "and names none: give --tool_call_format")


def parse_tool_calls(tokenizer, tools: list[dict], tool_format: str, ids: list[int], context: list[int],
                     eos_ids: list[int]) -> list[ToolCall]:
    """The tool calls in a turn the policy sampled (`ids`, after the episode's `context`): through the tokenizer's
    own response parser (tool_format "response_template"), or decoded with its special tokens (markers such as
    [TOOL_CALLS] and <|python_tag|> are special tokens) but its stop token, reasoning blocks left out, by the
    format's parser. No calls (an empty list) for a turn without one."""
    schemas = {schema["function"]["name"]: schema["function"] for schema in tools}
    if tool_format == "response_template":
        try:
            message = tokenizer.parse_response(ids, prefix=context, tools=tools)
        except Exception as error:  # the parser's own errors, whatever their type
            return [ToolCall(error=f"the turn could not be parsed ({raised(error)})")]
        return [call_from(call.get("function", call)) for call in message.get("tool_calls") or []]
    ids = ids[:-1] if ids and ids[-1] in eos_ids else ids
    text = outside_reasoning(tokenizer.decode(ids, skip_special_tokens=False))
    return PARSERS[tool_format](text, schemas)


# ----------------------------------------------------------------------------------------------
# The calls made
# ----------------------------------------------------------------------------------------------
def episode_tools(env) -> dict:
    """The tools of an episode's environment object, by name."""
    return {tool.__name__: tool for tool in getattr(env, "tools", None) or []}


JSON_TYPES = {"string": str, "integer": int, "number": int | float, "boolean": bool, "array": list, "object": dict,
              "null": type(None)}


def type_name(value) -> str:
    """A JSON value's type, as a schema names it."""
    if isinstance(value, bool):
        return "boolean"
    return next((name for name, kind in JSON_TYPES.items() if isinstance(value, kind)), type(value).__name__)


def schema_problem(value, schema: dict, where: str) -> str | None:
    """What is wrong with `value` against a JSON schema (type, nullable, enum, items, properties,
    additionalProperties, anyOf/oneOf), or None."""
    unions = schema.get("anyOf") or schema.get("oneOf")
    if unions and all(schema_problem(value, option, where) for option in unions):
        return f"{where} is {type_name(value)} {value!r:.40}, which fits none of its types"
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if schema.get("nullable"):
            types.append("null")
        actual = type_name(value)
        if not any(actual == kind or (kind == "number" and actual == "integer") for kind in types):
            return f"{where} is {actual} {value!r:.40}, the tool takes {' or '.join(types)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} is {value!r:.40}, the tool takes one of {schema['enum']}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            if problem := schema_problem(item, schema["items"], f"{where}[{i}]"):
                return problem
    if isinstance(value, dict):
        for key, item in value.items():
            inner = schema.get("properties", {}).get(key, schema.get("additionalProperties"))
            if isinstance(inner, dict) and (problem := schema_problem(item, inner, f"{where}[{key!r}]")):
                return problem
    return None


def arguments_problem(call: ToolCall, properties: dict) -> str | None:
    """What is wrong with a call's arguments against its tool's schema (`properties`: its parameters'), or None."""
    for key, value in call.arguments.items():
        if key in properties and (problem := schema_problem(value, properties[key], f"argument {key!r}")):
            return f"{call.name}: {problem}"
    return None


def result_text(result) -> str:
    """A tool's result as its message: a string as it is, else as JSON when it can be, else as text (a set, a numpy
    number)."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def call_tools(tools: dict, schemas: list[dict], calls: list[ToolCall], first_number: int) -> tuple[list[dict], int]:
    """The turn's tool calls, one after the other: their results as `tool` messages (each with a tool_call_id,
    call_id of its number in the episode, from `first_number`), and how many were errors. A malformed call, an
    unknown tool, arguments that do not fit its signature or its schema, and an exception in the tool become a
    message saying so (`error: ...`), which the policy learns from."""
    properties = {schema["function"]["name"]: schema["function"]["parameters"].get("properties", {})
                  for schema in schemas}
    messages, errors = [], 0
    for number, call in enumerate(calls, first_number):
        problem = call.error or (None if call.name in tools else
                                 f"there is no tool {call.name!r}; the tools are {', '.join(tools)}")
        if problem is None:
            try:
                inspect.signature(tools[call.name]).bind(**call.arguments)
            except TypeError as error:
                problem = f"{call.name}: {error}"
        if problem is None:
            problem = arguments_problem(call, properties.get(call.name, {}))
        if problem is None:
            try:
                result = tools[call.name](**call.arguments)
                content = result_text(asyncio.run(result) if inspect.isawaitable(result) else result)
            except Exception as error:  # the tool's own code: every error goes to the policy
                problem = f"{call.name} raised {type(error).__name__}: {error}"
        if problem is not None:
            errors, content = errors + 1, f"error: {problem}"
        messages.append(tool_message(call.name, number, content))
    return messages, errors


def tool_message(name: str, number: int, content: str) -> dict:
    """The `tool` message answering an episode's `number`-th call, of tool `name`."""
    return {"role": "tool", "name": name, "tool_call_id": call_id(number), "content": content}


def turn_reward(env) -> float:
    """The reward of a turn of tool calls: 0, but for a TRL-style environment the change in its get_reward()."""
    return env.reward_since_last() if isinstance(env, TRLEnvironment) else 0.0


# ----------------------------------------------------------------------------------------------
# TRL-style environments
# ----------------------------------------------------------------------------------------------
class TRLEnvironment:
    """A TRL-style environment class (`wrapped`, TRL's environment_factory) in the kit's contract: its public
    methods, but reset and get_reward, are the tools; reset(**row) gets the dataset row's columns and returns None
    or an observation, appended to the row's `prompt` (a str or a list of messages; TRL appends it to the last
    message); a turn without a tool call ends the episode, as in TRL. The return is get_reward() where the episode
    ends (each turn's reward is its change), so a truncated episode is scored as TRL scores it."""

    wrapped: type

    def __init__(self):
        self.env = self.wrapped()
        self.tools = [method for name, method in inspect.getmembers(self.env, inspect.ismethod)
                      if name not in ("reset", "get_reward") and not name.startswith("_")]
        self.reward = 0.0

    def reset(self, row: dict, seed: int) -> str | list[dict]:
        observation = self.env.reset(**row)
        self.reward = 0.0
        prompt = row.get("prompt", [{"role": "user", "content": ""}])
        if observation is None:
            return prompt
        if isinstance(prompt, str):
            return prompt + observation
        return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]

    def reward_since_last(self) -> float:
        reward = float(self.env.get_reward())
        change, self.reward = reward - self.reward, reward
        return change

    def step(self, action: str) -> tuple[None, float, bool]:
        """A turn without a tool call: the episode's end."""
        return None, self.reward_since_last(), True


def trl_environment(env_class: type, spec: str) -> type:
    """The kit's contract around a TRL-style environment class (TRLEnvironment), which must own its reward."""
    if not callable(getattr(env_class, "get_reward", None)):
        common.fail(f"--env {spec!r} has reset but no step: a TRL-style environment (reset(**row), its public methods "
                    "its tools) needs get_reward() -> float, the episode's return; or give it the kit's step(action)")
    return type(f"TRL{env_class.__name__}", (TRLEnvironment,), {"wrapped": env_class})
