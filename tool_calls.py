"""Tool calling in multi-turn environments (environments.EpisodeLoop): an environment's `tools` (callables with type
hints and a Google-style docstring), their JSON schemas for the chat template, the policy's calls read from its turn
(the tokenizer's own response parser where transformers has one, else the Hermes format), and the calls made, each
result or error a `tool` message the policy reads next."""

import inspect
import json
import re

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


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(tokenizer, tools: list[dict], text: str) -> list[dict]:
    """The tool calls in a turn's text, each {"name": str, "arguments": dict}, or {"error": what was wrong} for a
    malformed one: through the tokenizer's own response parsing where transformers has one for it (its
    response_template), else in the Hermes format, <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, tools=tools)
        except Exception as error:  # the parser's own errors, whatever their type
            return [{"error": f"the turn could not be parsed ({error})"}]
        calls = [call.get("function", call) for call in message.get("tool_calls") or []]
    else:
        calls = []
        for block in HERMES_CALL.findall(text):
            try:
                calls.append(json.loads(block))
            except json.JSONDecodeError as error:
                calls.append({"error": f"the tool call is not JSON ({error.msg}): {block.strip()!r:.80}"})
        if text.count("<tool_call>") > text.count("</tool_call>"):
            calls.append({"error": "a <tool_call> is not closed by </tool_call>"})
    checked = []
    for call in calls:
        if not (isinstance(call, dict) and "error" in call):  # JSON of any kind: a number, a list, a dict
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):  # some formats give the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
                call = {"error": f'a tool call is {{"name": ..., "arguments": {{...}}}}, got {call!r:.80}'}
            else:
                call = {"name": call["name"], "arguments": arguments}
        checked.append(call)
    return checked


def episode_tools(env) -> dict:
    """The tools of an episode's environment object, by name."""
    return {tool.__name__: tool for tool in getattr(env, "tools", None) or []}


def call_tools(tools: dict, calls: list[dict], errors_as_messages: bool) -> tuple[list[dict], int]:
    """The turn's tool calls, one after the other: their results as `tool` messages, and how many were errors. A
    malformed call, an unknown tool or arguments that do not fit it become a message saying so (the policy learns
    from it); an exception in a tool too with `errors_as_messages` (--env_failure error_message), else it stops
    the calls (--env_failure decides)."""
    messages, errors = [], 0
    for call in calls:
        name = call.get("name", "")
        problem = call.get("error") or (None if name in tools else
                                        f"there is no tool {name!r}; the tools are {', '.join(tools)}")
        if problem is None:
            try:
                inspect.signature(tools[name]).bind(**call["arguments"])
            except TypeError as error:
                problem = f"{name}: {error}"
        if problem is None:
            try:
                result = tools[name](**call["arguments"])
                content = result if isinstance(result, str) else json.dumps(result)
            except Exception as error:
                if not errors_as_messages:
                    raise
                problem = f"{name} raised {type(error).__name__}: {error}"
        if problem is not None:
            errors, content = errors + 1, f"error: {problem}"
        messages.append({"role": "tool", "name": name, "content": content})
    return messages, errors
