"""Multi-turn environments (grpo_multiturn.py, grpo_multiturn_vllm.py): the contract, --env's loading, an
episode's tokens, and the calls into an environment.

The contract (README, "Multi-turn environments"): a class built with no arguments, one object per episode,

    reset(row: dict, seed: int) -> str                            the first user message
    step(action: str) -> tuple[str | None, float, bool]          the next message, a reward, done

Token in, token out: the ids the policy sampled are the ids it is trained on; each message the environment
sends, and the chat template's tokens around it, are appended as tokens, and the history is never
re-tokenized. The environment's tokens are masked out of everything the policy is trained or judged on
(Episodes.mask). Every mode plays its episodes through one loop (EpisodeLoop), the only caller of `reset` and
`step`. Resets and steps of different episodes run concurrently, each in a thread of its own, under
--env_timeout; an environment that raises, hangs or answers with the wrong types stops the run with one line
naming it, the episode and what was wrong.
"""

import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

import common
import data
import env_calls
import lora
import tool_calls
import toy


@dataclass
class EnvArgs(common.FlagGroup):
    """The environment: which one, and how long its episodes may run"""

    env: str = "toy:guess_number"
    """the environment class: path/to/file.py:Class, module:Class, or toy:NAME for an embedded one (toy:guess_number;
    toy:guess_number_slow, whose steps take 25-75 ms; toy:probe_answer, toy:probe_answer_shaped, toy:lake,
    toy:lake_slippery, toy:hops: ENVIRONMENTS.md); one object per episode, built with no arguments. A TRL-style
    class (reset(**row), no step, its public methods its tools, get_reward()) runs as it is written"""
    max_turns: int = toy.GUESS_TURNS
    """the policy's turns an episode may take; one that is not done after them is truncated
    (rollout/truncated_episodes)"""
    max_episode_tokens: int = 48
    """the context limit: every token of an episode, the first message's, the policy's and the environment's; an
    episode that would outgrow it is truncated (rollout/truncated_episodes), a first message that leaves no room
    for a turn stops the run. Also dr_grpo's constant denominator, and the vLLM engine's context length"""
    env_timeout: float = 60.0
    """seconds a reset, a step or a turn's tool calls may take (past it: --env_failure)"""
    env_failure: Literal["stop", "error_message", "drop_group"] = "stop"
    """what an exception or a timeout in a step, or a timeout in a turn of tool calls, does: stop, the run stops with
    one line naming the episode; error_message, the error goes to the policy as the environment's reply (as each
    call's tool message for tool calls) and the episode goes on; drop_group, the episode ends there and its group
    leaves the loss (rollout/dropped_groups). A reset's failure, or a reply that breaks the contract, always stops the
    run; an exception in a tool the policy called, or a call that does not fit the tool, is always a tool message"""
    chat_template_path: str | None = None
    """a chat template (a .jinja file) that replaces the tokenizer's for the episodes (implies --chat_template): e.g.
    a training template that keeps earlier turns as they were sampled, where the model's own rewrites history
    (Qwen3's drops an earlier turn's <think> block once a user message follows), which the run refuses"""
    chat_template_kwargs: str | None = None
    """a JSON object of arguments every rendering of the chat template gets, e.g. '{"enable_thinking": false}' for
    Qwen3's"""
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral", "qwen3_xml"] = "auto"
    """how the policy's tool calls are read from the ids it sampled: auto, the tokenizer's own response parser where
    it has one (transformers' response_template), else the format of the calls the chat template renders (else
    whose markers it or the vocabulary holds); hermes, <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    (Qwen2.5, Qwen3, Hermes); llama3_json, {"name": ..., "parameters": {...}} (Llama 3.x); mistral, [TOOL_CALLS]...;
    qwen3_xml, <tool_call><function=NAME><parameter=KEY>... (Qwen3-Coder, Qwen3.5)"""

    env_latency: float = 0.0
    """seconds every step (or turn of tool calls) takes on top of the environment's own: the median of a log-normal
    with --env_latency_spread, else fixed; to study slow tools (code execution, search: seconds) on any
    environment (ENVIRONMENTS.md, "Slow environments")"""
    env_latency_spread: float = 0.0
    """the sigma of the log of --env_latency's log-normal (0: every step the same; 1: a heavy tail, the slowest
    in 20 about 5x the median)"""
    env_latency_timeouts: float = 0.0
    """the share of steps that hang past --env_timeout instead of reaching the environment (--env_failure then
    decides)"""

    def check(self):
        common.check_signs(self, ("max_turns", "max_episode_tokens", "env_timeout"),
                           ("env_latency", "env_latency_spread"))
        if not 0 <= self.env_latency_timeouts < 1:
            common.fail(f"--env_latency_timeouts is a share of the steps, from 0 up to (not) 1, got "
                        f"{self.env_latency_timeouts}")
        try:
            kwargs = json.loads(self.chat_template_kwargs or "{}")
        except json.JSONDecodeError as error:
            common.fail(f"--chat_template_kwargs {self.chat_template_kwargs!r} is not JSON ({error.msg})")
        if not isinstance(kwargs, dict):
            common.fail(f"--chat_template_kwargs {self.chat_template_kwargs!r} is not a JSON object of arguments, "
                        """e.g. '{"enable_thinking": false}'""")

    @property
    def template_kwargs(self) -> dict:
        """--chat_template_kwargs as a dict (check() has refused anything else)."""
        return json.loads(self.chat_template_kwargs or "{}")

    @property
    def adds_latency(self) -> bool:
        """Whether --env_latency or --env_latency_timeouts wrap the steps (EpisodeLoop.with_latency)."""
        return self.env_latency > 0 or self.env_latency_timeouts > 0


RESUME_MAY_CHANGE = ("env_timeout", "env_latency", "env_latency_spread")  # besides outputs.RESUME_MAY_CHANGE


@functools.cache  # once a process: the generator process asks for it every batch (SampleEpisodes.loop)
def load_env_class(spec: str):
    """The class --env names, `path/to/file.py:Class`, `module:Class` or `toy:NAME`; one built here with no
    arguments must have reset and step (one line otherwise, before the run writes anything). A TRL-style class
    (reset(**row) and no step: its public methods are its tools) runs through tool_calls.TRLEnvironment."""
    if spec.startswith("toy:"):
        if spec[4:] not in toy.ENVIRONMENTS:
            common.fail(f"--env {spec!r}: no embedded environment {spec[4:]!r}; there are "
                        f"{', '.join('toy:' + name for name in toy.ENVIRONMENTS)}")
        return toy.ENVIRONMENTS[spec[4:]]
    env_class = data.load_python_object(spec, "--env", "class")
    try:
        env = env_class()
    except Exception as error:
        common.fail(f"--env {spec!r}: building one with no arguments raised {type(error).__name__}: {error}")
    if callable(getattr(env, "reset", None)) and not callable(getattr(env, "step", None)):
        return tool_calls.trl_environment(env_class, spec)
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        common.fail(f"--env {spec!r}: an environment needs reset(row, seed) and step(action); it has no "
                    f"{' and no '.join(missing)}")
    return env_class


@dataclass
class EnvTask:
    """What a multi-turn run loads (load_env_task): the policy's tokenizer and stop tokens, the environment and its
    tools, the dataset rows episodes start from, and how the chat template renders a message after a turn."""

    tokenizer: object
    eos_ids: list[int]
    env_class: type
    env_name: str  # --env as given, for errors
    train_rows: object  # datasets.Dataset: each row, all its columns, starts k episodes
    eval_rows: object | None  # None: evaluation is off
    chat_template: bool
    end_of_turn_id: int  # the stop token appended to a turn that ran out of tokens before its own
    before_message: list[int]  # the template's tokens between the policy's stop token and a message
    after_message: list[int]  # and between the message and the policy's next turn
    tools: list[dict] = field(default_factory=list)  # the environment's tools' JSON schemas (the template renders them)
    end_of_action: str = ""  # the template's text after an assistant turn's stop token
    template: str = "of the policy"  # the chat template's name in errors: its --chat_template_path, or the model's
    template_kwargs: dict = field(default_factory=dict)  # --chat_template_kwargs, for every rendering
    tool_call_format: str = ""  # how the policy's calls are read (tool_calls.choose_format), with tools
    response_length: int = 0  # --response_length, for the sizes an error suggests

    def render(self, messages: list[dict], **kwargs):
        """The chat template's rendering of `messages` with the tools and --chat_template_kwargs (render)."""
        return render(self.tokenizer, messages, self.tools, self.template, self.template_kwargs, **kwargs)

    def first_message_ids(self, message: str | list[dict]) -> list[int]:
        """The first message (or messages: a system prompt, then the user's) as tokens: through the chat template,
        as a user message and with the tools' schemas, with --chat_template."""
        if self.chat_template:
            messages = [{"role": "user", "content": message}] if isinstance(message, str) else message
            return self.render(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return self.tokenizer(message, add_special_tokens=False)["input_ids"]

    def message_ids(self, message: str | list[dict]) -> list[int]:
        """A later message as the tokens appended after the policy's turn (its stop token included): a user
        message's text between the template's tokens around it, or a list of messages (tool results, user
        messages) as the template renders them after an assistant turn: the rendering's delta over a probe rendered
        with it (a date the template prints changes both)."""
        encode = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        if isinstance(message, str):
            return self.before_message + encode(message) + self.after_message
        for _ in range(2):  # twice: the clock may pass midnight between the two renderings
            probe = self.render(PROBE, tokenize=False)
            rendered = self.render(PROBE + message, tokenize=False, add_generation_prompt=True)
            if rendered.startswith(probe):
                return encode(self.end_of_action + rendered[len(probe):])
        common.fail(f"the chat template {self.template} renders an episode differently once the messages "
                    f"{message!r:.120} are added; the turns of an episode must be appended as they were sampled: "
                    "give a template that keeps them, --chat_template_path FILE.jinja")


def render(tokenizer, messages: list[dict], tools: list[dict], template: str, template_kwargs: dict, **kwargs):
    """The chat template's rendering of `messages` with `tools` and `template_kwargs` (apply_chat_template's
    `kwargs`); one line naming the template (`template`), should it raise."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, **template_kwargs, **kwargs)
    except Exception as error:  # the template's own raise_exception, or any error of its code
        common.fail(f"the chat template {template} cannot render the messages {messages[-3:]!r:.160} (it raised "
                    f"{tool_calls.raised(error)}); give one that can, --chat_template_path FILE.jinja")


ACTION, THINKING = "\x00ACTION\x00", "\x00THINKING\x00"
# a conversation the template renders: an assistant turn with a reasoning block, which a template that rewrites
# history (Qwen3's) drops once a user message follows
PROBE = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": f"<think>{THINKING}</think>{ACTION}"}]


def template_around_message(tokenizer, eos_ids: list[int], template: str, tools: list[dict],
                            template_kwargs: dict | None = None):
    """(the stop token that ends an assistant turn, the template's tokens from there to a user message's text, and
    from its text to the next assistant turn, the template's text after the stop token), read off the template's
    rendering of a short conversation. A template (named `template` in errors) that renders the conversation
    otherwise once a user message, or with `tools` a tool message, is added is refused."""
    marker = "\x00MESSAGE\x00"
    rendering = functools.partial(render, tokenizer, tools=tools, template=template,
                                  template_kwargs=template_kwargs or {}, tokenize=False)
    before = rendering(PROBE)
    after = rendering(PROBE + [{"role": "user", "content": marker}], add_generation_prompt=True)
    followed = {"user": after}
    if tools:
        result = tool_calls.tool_message(tools[0]["function"]["name"], 0, tool_calls.PROBE_RESULT)
        followed["tool"] = rendering(PROBE + [result], add_generation_prompt=True)
    for role, rendered in followed.items():
        if not rendered.startswith(before) or role == "user" and marker not in rendered:
            common.fail(f"the chat template {template} renders the earlier turns differently once a {role} message "
                        "follows (it drops or moves them, as Qwen3's drops a <think> block); the turns of an episode "
                        "must be appended as they were sampled: give a template that keeps them, "
                        "--chat_template_path FILE.jinja")
    end_of_action = before[before.index(ACTION) + len(ACTION):]
    stop_id = eos_ids[0]
    for eos in eos_ids:  # the template's own end of an assistant turn, when it is a stop token
        if end_of_action.startswith(tokenizer.decode([eos])):
            stop_id, end_of_action = eos, end_of_action[len(tokenizer.decode([eos])):]
            break
    prefix, suffix = after[len(before):].split(marker)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] if text else []  # noqa: E731
    return stop_id, encode(end_of_action + prefix), encode(suffix), end_of_action


def chat_template_contract(tokenizer, eos_ids: list[int], tools: list[dict], template: str, env_args: EnvArgs):
    """The chat template's contract, checked at load (one line naming `template` and what it cannot render, before
    anything is written): with `tools`, it renders them and a tool call's result (tool_calls.check_tool_template);
    it appends a message without rewriting earlier turns (template_around_message). Returns template_around_message's
    tokens and text, and the format the policy's calls are read in (tool_calls.choose_format; "" without tools)."""
    template_kwargs = env_args.template_kwargs
    if tools:
        tool_calls.check_tool_template(tokenizer, tools, template, template_kwargs)
    around = template_around_message(tokenizer, eos_ids, template, tools, template_kwargs)
    tool_format = tool_calls.choose_format(tokenizer, env_args.tool_call_format, tools, template,
                                           template_kwargs) if tools else ""
    return *around, tool_format


def load_env_task(data_args: data.DatasetArgs, env_args: EnvArgs, eval_num_rows: int, lora_args, rank: int,
                  evaluate: bool, response_length: int = 0) -> EnvTask:
    """The task of a multi-turn run; the embedded environment's policy and rows are built first when asked for.
    Evaluation rows come from --eval_split, or are the last `eval_num_rows` train rows (at most a fifth), held
    out of training. The chat template is checked here, before anything is written: with tools, it must render
    them and a tool call's result (tool_calls.check_tool_template), and the format of the policy's calls is chosen
    (and printed); every template must append a message without rewriting earlier turns (template_around_message).
    `response_length` (--response_length) sizes the flags an error suggests."""
    folders = {os.path.dirname(path) for path in (data_args.model_name_or_path, data_args.dataset_name)}
    if toy.GUESS_DIR in folders:
        toy.build_guess()
    if toy.TOOLS_DIR in folders:
        toy.build_tools()
    if toy.PROBE_DIR in folders:
        toy.build_probe()
    if toy.LAKE_DIR in folders:
        toy.build_lake()
    if toy.HOPS_DIR in folders:
        toy.build_hops()
    tokenizer = data.load_tokenizer(data_args.model_name_or_path)
    eos_ids = data.eos_token_ids(data_args.model_name_or_path, tokenizer)
    if lora_args is not None:
        lora.check_targets(lora_args, data_args.model_name_or_path)
    env_class = load_env_class(env_args.env)
    chat_template = data_args.chat_template or env_args.chat_template_path is not None
    if env_args.chat_template_path is not None:
        try:
            with open(env_args.chat_template_path) as file:
                tokenizer.chat_template = file.read()
        except OSError as error:
            common.fail(f"--chat_template_path {env_args.chat_template_path!r}: {error.strerror}")
    if chat_template and tokenizer.chat_template is None:
        common.fail(f"--chat_template was given but the tokenizer of {data_args.model_name_or_path!r} has no chat "
                    "template")
    tools = tool_calls.tool_schemas(env_class, env_args.env)
    if tools and not chat_template:
        common.fail(f"--env {env_args.env!r} has tools, which reach the policy through a chat template: give "
                    "--chat_template (or --chat_template_path)")
    template = (f"{env_args.chat_template_path!r} (--chat_template_path)" if env_args.chat_template_path else
                f"of {data_args.model_name_or_path!r}")
    end_of_turn, before, after, end_of_action, tool_format = (
        chat_template_contract(tokenizer, eos_ids, tools, template, env_args) if chat_template else
        (eos_ids[0], [], [], "", ""))
    if tools and rank == 0:
        print(f"--env {env_args.env}: {len(tools)} tools, their calls read in the {tool_format} format "
              f"(--tool_call_format {env_args.tool_call_format})")
    train_rows = data.load_split(data_args.dataset_name, data_args.train_split)
    eval_rows = None
    if data_args.eval_split not in data.split_names(data_args.dataset_name):  # held out even without evaluation
        train_rows, eval_rows = data.held_out_for_evaluation(data_args, train_rows, eval_num_rows, rank, "rows")
    elif evaluate:
        eval_rows = data.load_split(data_args.dataset_name, data_args.eval_split)
    eval_rows = eval_rows.select(range(min(eval_num_rows, len(eval_rows)))) if evaluate else None
    for name, rows in (("train", train_rows), ("evaluation", eval_rows)):
        if rows is not None and len(rows) == 0:
            common.fail(f"dataset {data_args.dataset_name!r} has no {name} rows")
    return EnvTask(tokenizer=tokenizer, eos_ids=eos_ids, env_class=env_class, env_name=env_args.env,
                   train_rows=train_rows, eval_rows=eval_rows, chat_template=chat_template,
                   end_of_turn_id=end_of_turn, before_message=before, after_message=after, tools=tools,
                   end_of_action=end_of_action, template=template, template_kwargs=env_args.template_kwargs,
                   tool_call_format=tool_format, response_length=response_length)


# ----------------------------------------------------------------------------------------------
# An episode's tokens, and the loop that plays episodes
# ----------------------------------------------------------------------------------------------
class Turn(NamedTuple):
    """A turn the policy sampled: its ids up to its stop token, whether it reached it, and with the vLLM engine the
    engine's log-probs of the ids and, in flight, the weight version that sampled each."""

    ids: list[int]
    stopped: bool
    logprobs: list[float] | None = None
    versions: list[int] | None = None

    @classmethod
    def sampled(cls, ids: list[int], eos_ids: list[int], logprobs: list[float], versions: list[int] | None = None):
        """A turn the engine sampled, which stopped where its last token is a stop token."""
        return cls(ids, bool(ids) and ids[-1] in eos_ids, logprobs, versions)


@dataclass
class EpisodeCounts:
    """What an episode counts as it plays, a field each: an int per episode (Episode.counts), a (N,) column per batch
    of episodes (Episodes.counts; the engine's Batch carries them by name), each averaged per episode in
    rollout_metrics. A new count is three edits: its field here, where it counts, its metric."""

    tool_calls: int = 0  # the tool calls of its turns
    tool_errors: int = 0  # those that came back as an error
    failed_steps: int = 0  # steps and turns of tool calls that raised or timed out (--env_failure)
    timeouts: int = 0  # those that timed out

    @classmethod
    def names(cls) -> list[str]:
        return [count.name for count in dataclasses.fields(cls)]

    @classmethod
    def columns(cls, values) -> "EpisodeCounts":
        """The counts of a batch: values(name) -> its column, for each count."""
        return cls(**{name: values(name) for name in cls.names()})


@dataclass
class Episode:
    """One episode as tokens: the first message (`prompt_ids`), then every later token (`ids`), the policy's
    (`is_action` True) and the environment's, in the order they came."""

    env: object
    number: int  # among the episodes started together: the key of its step in EpisodeLoop
    where: str  # "--env NAME, episode I (seed S)", for errors
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    is_action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the vLLM engine's of the policy's ids, INVALID_LOGPROB after
    versions: list[int] = field(default_factory=list)  # in flight: the version that sampled each policy id, -1 after
    token_turns: list[int] = field(default_factory=list)  # each id's turn: the index of the turn that sampled it, or -1
    actions: list[Turn] = field(default_factory=list)  # every turn the environment has replied to (a replay's input)
    turn_rewards: list[float] = field(default_factory=list)  # the reward of each turn's reply
    # each turn's starting state, as the environment's state_key() names it (hashed: state_key_id), where it has one
    state_keys: list[int] = field(default_factory=list)
    pending: Turn | None = None  # the turn its environment is stepping on
    episode_return: float = 0.0
    ended: bool = False
    truncated: bool = False  # ended by --max_turns or --max_episode_tokens, not by the environment
    missed_stop: bool = False  # a turn ran out of tokens before its stop token
    counts: EpisodeCounts = field(default_factory=EpisodeCounts)
    failed: bool = False  # ended by a failure, with --env_failure drop_group
    step_times: list[float] = field(default_factory=list)  # seconds each step (or turn of tool calls) took
    step_started: float = 0.0  # time.monotonic() when its running step started
    latency: random.Random | None = None  # --env_latency: draws its steps' latencies, the same in every mode

    @property
    def turns(self) -> int:
        return len(self.actions)

    def portable(self) -> dict:
        """Its values but its environment object: plain data an in-flight snapshot keeps (from_portable)."""
        values = {name: value for name, value in vars(self).items() if name != "env"}
        return values | {"counts": dataclasses.asdict(self.counts)}

    @classmethod
    def from_portable(cls, values: dict) -> "Episode":
        """An episode a snapshot kept (portable), without an environment."""
        return cls(env=None, **values | {"counts": EpisodeCounts(**values["counts"])})

    def budget(self, max_new_tokens: int, max_episode_tokens: int) -> int:
        """Tokens the next turn may sample: a turn's, or what is left of the context."""
        return min(max_new_tokens, max_episode_tokens - len(self.prompt_ids) - len(self.ids))

    def add_turn(self, turn: Turn, reply: tuple[str | list[dict] | None, float, bool], task: EnvTask, max_turns: int,
                 max_episode_tokens: int):
        """The policy's `turn`, then the environment's `reply`: its reward counts; unless the episode ends, the message
        is appended as tokens (after the stop token the turn ran out of tokens before, if it did)."""
        message, reward, done = reply
        self.ids += turn.ids
        self.is_action += [True] * len(turn.ids)
        self.token_turns += [self.turns] * len(turn.ids)
        self.logprobs += turn.logprobs or []
        self.versions += turn.versions or []
        self.actions.append(turn)
        self.turn_rewards.append(reward)
        self.episode_return += reward
        self.missed_stop |= not turn.stopped
        if done:
            self.ended = True
            return
        message_ids = ([] if turn.stopped else [task.end_of_turn_id]) + task.message_ids(message)
        if self.turns == max_turns or len(self.prompt_ids) + len(self.ids) + len(message_ids) >= max_episode_tokens:
            self.ended = self.truncated = True  # the last message would teach nothing: it is not appended
            return
        self.ids += message_ids
        self.is_action += [False] * len(message_ids)
        self.token_turns += [-1] * len(message_ids)
        if turn.logprobs is not None:
            self.logprobs += [common.INVALID_LOGPROB] * len(message_ids)
        if turn.versions is not None:
            self.versions += [-1] * len(message_ids)


class EpisodeLoop:
    """Where every episode is played, whichever way its turns are sampled: with HF generate turn by turn
    (grpo_multiturn*.py's play_episodes), in the vLLM engine K updates ahead, turn by turn or each episode at its
    own pace (rollouts.SampleEpisodes), and in flight across weight loads (inflight.InflightEpisodes). The
    mode samples each turn within Episode.budget and hands it over (take_turn); the loop owns the rest: the
    environments' resets and steps (the only calls into an environment, each in a thread of its own under
    --env_timeout, each reply checked), and every turn and reply appended to its episode as tokens (token in, token
    out), with the rewards, --max_turns and the context limit."""

    def __init__(self, task: EnvTask, env_args: EnvArgs):
        self.task, self.env_args = task, env_args
        self.steps = env_calls.CallsInFlight(env_args.env_timeout)  # by episode number
        self.stepping = {}  # number -> the episode whose step runs

    def start(self, rows: dict, seeds: list[int], k: int, first_episode: int = 0) -> list[Episode]:
        """k episodes of each row ({column: values}) with its reset seed, each row's k adjacent: one environment
        each, built and reset concurrently. `first_episode`: the first one's number (unique among the episodes this
        loop plays at once)."""
        task, env_args = self.task, self.env_args
        columns = list(rows)
        starts = [({name: rows[name][i] for name in columns}, seed) for i, seed in enumerate(seeds) for _ in range(k)]
        where = [f"--env {task.env_name}, episode {first_episode + i} (seed {seed})"
                 for i, (_, seed) in enumerate(starts)]

        def start(i: int):
            env = task.env_class()
            return env, env.reset(*starts[i])

        started = env_calls.call_concurrently([lambda i=i: start(i) for i in range(len(starts))],
                                              env_args.env_timeout, lambda i: f"{where[i]}: reset")
        episodes = []
        for i, (env, message) in enumerate(started):
            if isinstance(message, list) and not task.chat_template:
                common.fail(f"{where[i]}: reset returned a list of messages, which reach the policy through a chat "
                            "template: give --chat_template (or --chat_template_path)")
            if not isinstance(message, str | list):
                common.fail(f"{where[i]}: reset returned {type(message).__name__} {message!r:.80}; it returns the "
                            "first message, a str (or a list of messages)")
            env_calls.check_message(message, f"{where[i]}: reset", "messages", ("system", "user"))
            prompt_ids = task.first_message_ids(message)
            if len(prompt_ids) >= env_args.max_episode_tokens:
                common.fail(f"{where[i]}: the first message is {len(prompt_ids)} tokens, which leaves no room for a "
                            f"turn in --max_episode_tokens {env_args.max_episode_tokens}: "
                            + sizes_that_fit(task, env_args, len(prompt_ids)))
            episodes.append(Episode(env=env, number=first_episode + i, where=where[i], prompt_ids=prompt_ids,
                                    latency=latency_generator(env_args, starts[i][1], i % k),
                                    state_keys=[state_key_id(env)]))
        return episodes

    def take_turn(self, episode: Episode, turn: Turn):
        """The policy's `turn` of `episode`: when the environment has tools and the turn calls them, the tools run on
        the calls (tool_calls.call_tools); else its environment steps on the turn's text."""
        task = self.task
        episode.pending, episode.step_started = turn, time.monotonic()
        tools = tool_calls.episode_tools(episode.env) if task.tools else {}
        calls = tool_calls.parse_tool_calls(task.tokenizer, task.tools, task.tool_call_format, turn.ids,
                                            episode.prompt_ids + episode.ids, task.eos_ids) if tools else []
        self.stepping[episode.number] = episode, calls
        if calls:
            first = episode.counts.tool_calls  # the number of the turn's first call in the episode

            def call():
                return *tool_calls.call_tools(tools, task.tools, calls, first), tool_calls.turn_reward(episode.env)

            self.steps.start(episode.number, self.with_latency(episode, call), f"{episode.where}: tool calls")
        else:
            text = action_text(task, turn.ids)
            self.steps.start(episode.number, self.with_latency(episode, lambda: episode.env.step(text)),
                             f"{episode.where}: step")

    def with_latency(self, episode: Episode, step):
        """`step` (no arguments) as --env_latency makes it: after the latency the episode's generator draws
        (draw_latency), or, for a --env_latency_timeouts share of the steps, hanging past --env_timeout without
        reaching the environment."""
        if episode.latency is None:
            return step
        hangs, seconds = draw_latency(episode.latency, self.env_args)

        def slow_step():
            if hangs:
                time.sleep(self.env_args.env_timeout + 1.0)
                # its result is dropped: it timed out already
                raise env_calls.CallTimeout("hung (--env_latency_timeouts)")
            time.sleep(seconds)
            return step()

        return slow_step

    @property
    def running(self) -> bool:
        """Whether a step runs."""
        return bool(self.stepping)

    def replies(self, wait: float = 0.0, every_step: bool = False) -> list[Episode]:
        """The episodes whose steps returned since the last call, waiting up to `wait` seconds for a first one (with
        `every_step`, until none runs), in the order of their numbers: each with its turn and the reply appended,
        ended or waiting for its next turn."""
        finished = self.steps.finished(wait)
        while every_step and self.steps.running:
            finished += self.steps.finished(wait=0.05)
        replied = []
        for number, where, result, error, ended in sorted(finished, key=lambda call: call[0]):
            episode, calls = self.stepping.pop(number)
            episode.step_times.append(ended - episode.step_started)
            episode.counts.tool_calls += len(calls)
            if error is not None:
                reply = self.reply_to_failure(episode, calls, where, error)
            elif calls:
                messages, errors, reward = result
                episode.counts.tool_errors += errors
                reply = messages, reward, False
            else:
                reply = env_calls.check_step(result, where, self.task.chat_template)
            turn, episode.pending = episode.pending, None
            episode.add_turn(turn, reply, self.task, self.env_args.max_turns, self.env_args.max_episode_tokens)
            if not episode.ended:  # the state its next turn starts from
                episode.state_keys.append(state_key_id(episode.env))
            replied.append(episode)
        return replied

    def reply_to_failure(self, episode: Episode, calls: list[tool_calls.ToolCall], where: str,
                         error: BaseException) -> tuple:
        """The reply to a turn whose step raised or timed out, or whose tool calls timed out (an error inside a tool
        is its message already), as --env_failure says: the run stops (stop), the error goes to the policy
        (error_message: the message, or each call's tool message), or the episode ends there, failed (drop_group).
        Counted the same in every mode: a failed step (failed_steps), a timeout, each call of the turn an error."""
        if self.env_args.env_failure == "stop":
            common.fail(env_calls.failure_line(where, error))
        episode.counts.failed_steps += 1
        episode.counts.timeouts += isinstance(error, env_calls.CallTimeout)
        episode.counts.tool_errors += len(calls)
        if self.env_args.env_failure == "drop_group":
            episode.failed = True
            return None, 0.0, True
        text = "error: " + env_calls.failure_line(where.rsplit(": ", 1)[-1], error)
        if calls:
            first = episode.counts.tool_calls - len(calls)
            messages = [tool_calls.tool_message(call.name, number, text) for number, call in enumerate(calls, first)]
            return messages, 0.0, False
        return text, 0.0, False

    def play_turn_by_turn(self, episodes: list[Episode], sample_turn) -> list[Episode]:
        """`episodes` played to their end (done, --max_turns, or the context limit), turn by turn: every turn, each
        episode still playing samples one, sample_turn(episodes, turn) -> a Turn per episode (None for one that has
        ended), and every environment's reply comes before the next turn."""
        for turn in range(self.env_args.max_turns):
            playing = [(episode, t) for episode, t in zip(episodes, sample_turn(episodes, turn)) if t is not None]
            if not playing:
                break
            for episode, t in playing:
                self.take_turn(episode, t)
            self.replies(every_step=True)
        return episodes


def sizes_that_fit(task: EnvTask, env_args: EnvArgs, first_message: int) -> str:
    """The --max_episode_tokens and --response_length that give an episode whose first message is `first_message`
    tokens room for --max_turns turns (a tool call takes tens of tokens, so at least TOOL_TURN_TOKENS a turn with
    tools), each answered by a message as long."""
    turn = max(task.response_length, TOOL_TURN_TOKENS if task.tools else 1)
    episode = first_message + 2 * env_args.max_turns * turn
    return (f"give --max_episode_tokens {-(-episode // 64) * 64} --response_length {turn} (the first message, then "
            f"--max_turns {env_args.max_turns} turns of up to {turn} tokens, each answered by a message as long)")


TOOL_TURN_TOKENS = 256


def latency_generator(env_args: EnvArgs, seed: int, position: int) -> random.Random | None:
    """The generator that draws the --env_latency of each step of the episode at `position` in the group of reset
    seed `seed` (None without --env_latency): the same for that episode in every mode, and in a resumed run's
    replay."""
    return random.Random(f"{seed}/{position}/latency") if env_args.adds_latency else None


def state_key_id(env) -> int:
    """The state the environment's next turn starts from, as its optional state_key() names it (any value; equal
    values, equal states: GiGPO's anchor states, grpo_multiturn*.py --turn_advantage gigpo), as a number that is the
    same in every process (a hash of its repr); -1 where the environment has no state_key."""
    state_key = getattr(env, "state_key", None)
    if state_key is None:
        return -1
    return int.from_bytes(hashlib.sha256(repr(state_key()).encode()).digest()[:7], "big")


def draw_latency(generator: random.Random, env_args: EnvArgs) -> tuple[bool, float]:
    """A step's --env_latency from an episode's generator: whether it hangs (a --env_latency_timeouts share), and
    its seconds, the median times exp(--env_latency_spread x a standard normal): a log-normal."""
    hangs = generator.random() < env_args.env_latency_timeouts
    return hangs, env_args.env_latency * math.exp(env_args.env_latency_spread * generator.gauss(0.0, 1.0))


def reset_seed(seed: int, position: int | str, index: int) -> int:
    """The reset seed of the `index`-th row of batch `position` (with --inflight_updates, of the `index`-th group
    an engine admits, position "engine E"): a group's k episodes share it, and it depends on neither the ranks nor
    the chunking (a resumed run replays the same episodes)."""
    return random.Random(f"{seed}/reset/{position}/{index}").getrandbits(31)


@torch.no_grad()
def sample_actions(model, episodes: list[Episode], task: EnvTask, max_new_tokens: int, max_episode_tokens: int,
                   temperature: float, top_p: float, chunk_size: int, seed_key: str, first_row: int) -> list:
    """One turn of every episode still playing, with HF generate: a Turn per episode (None for those that ended).
    Chunks of `chunk_size` episodes keep their members (ended ones sample too, and are discarded) and are seeded by
    (`seed_key`, the chunk's first row in the global batch, `first_row` + i): the turns depend on neither the ranks
    nor what else ended, as long as the chunk size divides each rank's episodes. A turn samples at most its
    episode's budget (Episode.budget)."""
    pad, device = task.tokenizer.pad_token_id, common.local_device()
    turns = [None] * len(episodes)
    for start in range(0, len(episodes), chunk_size):
        chunk = episodes[start:start + chunk_size]
        if all(episode.ended for episode in chunk):
            continue
        query_ids, query_mask = common.left_pad([e.prompt_ids + e.ids for e in chunk], pad, device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(random.Random(f"{seed_key}/{first_row + start}").getrandbits(63))
            responses = common.generate(model, query_ids, query_mask, max_new_tokens, temperature, task.eos_ids, pad,
                                        top_p)  # (chunk, max_new_tokens)
        for i, (episode, response) in enumerate(zip(chunk, responses.tolist())):
            if episode.ended:
                continue
            budget = episode.budget(max_new_tokens, max_episode_tokens)
            stop = next((t for t, token in enumerate(response[:budget]) if token in task.eos_ids), None)
            turns[start + i] = Turn(response[:budget] if stop is None else response[:stop + 1], stop is not None)
    return turns


def action_text(task: EnvTask, action: list[int]) -> str:
    """What the environment reads of an action: its text, special tokens (the stop token) left out."""
    return task.tokenizer.decode(action, skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# A batch of episodes
# ----------------------------------------------------------------------------------------------
@dataclass
class Episodes(common.Rollout):
    """A batch of episodes as a Rollout: the first messages as the queries (N, P), every later token as the
    responses (N, R); `mask`, what the loss, the ratios, the KL and every diagnostic are taken over, is the
    policy's tokens only. contains_eos: whether every turn of the episode ended at its stop token."""

    action_mask: torch.Tensor = None  # (N, R) the policy's tokens
    returns: torch.Tensor = None  # (N,) the sum of each episode's rewards
    turns: torch.Tensor = None  # (N,)
    truncated: torch.Tensor = None  # (N,) ended by --max_turns or the context limit
    failed: torch.Tensor = None  # (N,) bool: ended by a failure (--env_failure drop_group)
    token_turns: torch.Tensor = None  # (N, R) the turn each of the policy's tokens belongs to (its index), -1 elsewhere
    turn_rewards: torch.Tensor = None  # (N, T) each turn's reward, 0 past an episode's last turn (T: the most turns)
    state_keys: torch.Tensor = None  # (N, T) each turn's starting state (state_key_id), -1 past the last turn
    counts: EpisodeCounts = None  # (N,) each
    engine_logprobs: torch.Tensor | None = None  # (N, R) the vLLM engine's (INVALID_LOGPROB but at the policy's tokens)
    token_versions: torch.Tensor | None = None  # (N, R) in flight: the version of each policy token, -1 elsewhere
    step_times: list[float] = None  # seconds each step of the batch took

    # the values of each episode a vllm_generator.Batch carries by name (with the counts): Batch.episodes
    PER_EPISODE = ("lengths", "contains_eos", "action_mask", "returns", "turns", "truncated", "failed", "token_turns",
                   "turn_rewards", "state_keys")

    @property
    def mask(self) -> torch.Tensor:
        return self.action_mask

    def as_arrays(self) -> dict:
        """The batch as a generator process sends it, the fields of a vllm_generator.Batch: the first messages as
        token lists, the rest as numpy arrays (they cross processes by value), each episode's values by name."""
        queries = [ids[mask.bool()].tolist() for ids, mask in zip(self.query_ids, self.query_mask)]
        numpy = lambda tensor: None if tensor is None else tensor.cpu().numpy()  # noqa: E731
        per_episode = {name: numpy(getattr(self, name)) for name in self.PER_EPISODE}
        counts = {name: numpy(getattr(self.counts, name)) for name in EpisodeCounts.names()}
        return {"queries": queries, "responses": numpy(self.responses), "logprobs": numpy(self.engine_logprobs),
                "token_versions": numpy(self.token_versions), "episodes": per_episode | counts,
                "step_times": self.step_times}

    @classmethod
    def from_batch(cls, batch, pad_token_id: int, device) -> "Episodes":
        """This rank's share of a batch of episodes (a vllm_generator.Batch, its arrays tensors), on `device`."""
        query_ids, query_mask = common.left_pad(batch.queries, pad_token_id, device)
        on_device = lambda tensor: None if tensor is None else tensor.to(device)  # noqa: E731
        return cls(query_ids=query_ids, query_mask=query_mask, responses=on_device(batch.responses),
                   engine_logprobs=on_device(batch.logprobs), token_versions=on_device(batch.token_versions),
                   counts=EpisodeCounts.columns(lambda name: on_device(batch.episodes[name])),
                   step_times=batch.step_times, **{name: on_device(batch.episodes[name]) for name in cls.PER_EPISODE})


def collate(episodes: list[Episode], pad_token_id: int, device) -> Episodes:
    """The episodes as one Episodes batch (right-padded responses) on `device`."""
    query_ids, query_mask = common.left_pad([e.prompt_ids for e in episodes], pad_token_id, device)
    width, most_turns = max(1, max(len(e.ids) for e in episodes)), max(1, max(e.turns for e in episodes))

    def padded(rows: list[list], value, dtype=None, columns: int = width) -> torch.Tensor:  # (N, columns)
        return torch.tensor([row + [value] * (columns - len(row)) for row in rows], dtype=dtype, device=device)

    number = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
    return Episodes(query_ids=query_ids, query_mask=query_mask,
                    responses=padded([e.ids for e in episodes], pad_token_id),
                    lengths=number([len(e.ids) for e in episodes], torch.long),
                    contains_eos=number([not e.missed_stop for e in episodes], torch.bool),
                    action_mask=padded([e.is_action for e in episodes], False),
                    returns=number([e.episode_return for e in episodes]),
                    turns=number([e.turns for e in episodes]), truncated=number([e.truncated for e in episodes]),
                    failed=number([e.failed for e in episodes], torch.bool),
                    token_turns=padded([e.token_turns for e in episodes], -1, torch.long),
                    turn_rewards=padded([e.turn_rewards for e in episodes], 0.0, torch.float32, most_turns),
                    state_keys=padded([e.state_keys[:e.turns] for e in episodes], -1, torch.long, most_turns),
                    counts=EpisodeCounts.columns(lambda name: number([getattr(e.counts, name) for e in episodes])),
                    engine_logprobs=(padded([e.logprobs for e in episodes], common.INVALID_LOGPROB, torch.float32)
                                     if any(e.logprobs for e in episodes) else None),
                    token_versions=(padded([e.versions for e in episodes], -1, torch.long)
                                    if any(e.versions for e in episodes) else None),
                    step_times=[t for e in episodes for t in e.step_times])


def rollout_metrics(episodes: Episodes, k: int) -> dict[str, float]:
    """Over the episodes of the groups kept (kept_groups: a group dropped by --env_failure drop_group leaves them,
    as it leaves the loss), on every rank together: rollout/return_mean, turns_mean, truncated_episodes (their
    share), env_tokens_frac (the share of the tokens after the first message that the environment wrote),
    tool_calls_mean and tool_errors_mean (per episode: calls, and those that failed); rollout/dropped_groups (the
    share of groups dropped); over every episode: env/failed_steps and env/timeouts (per episode: steps that raised
    or timed out, and turns of tool calls that timed out), env/step_time_median and env/step_time_p95 (seconds, over
    the batch's steps and turns of tool calls; with several ranks of grpo_multiturn.py, each rank's averaged)."""
    real = common.response_mask(episodes.lengths, episodes.responses.shape[1])
    step_times = np.array(episodes.step_times or [0.0])
    kept = common.all_reduce_masked_means({
        "rollout/return_mean": episodes.returns, "rollout/turns_mean": episodes.turns,
        "rollout/truncated_episodes": episodes.truncated, "rollout/tool_calls_mean": episodes.counts.tool_calls,
        "rollout/tool_errors_mean": episodes.counts.tool_errors,
        "environment's tokens": (real & ~episodes.action_mask).sum(1), "tokens": real.sum(1)}, kept_groups(episodes, k))
    environment_tokens, tokens = kept.pop("environment's tokens"), kept.pop("tokens")
    return {**kept, "rollout/env_tokens_frac": environment_tokens / tokens if tokens else 0.0,
            "rollout/dropped_groups": episodes.failed.view(-1, k).any(dim=1).float().mean().item(),
            "env/failed_steps": episodes.counts.failed_steps.mean().item(),
            "env/timeouts": episodes.counts.timeouts.mean().item(),
            "env/step_time_median": float(np.median(step_times)),
            "env/step_time_p95": float(np.percentile(step_times, 95))}


def objective_metrics(episodes: Episodes, k: int, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                      scores: torch.Tensor) -> dict[str, float]:
    """common.rollout_metrics's numbers over the episodes of the groups kept (kept_groups), on every rank together:
    objective/scores, objective/entropy, objective/kl (with `ref_logprobs`) and val/num_eos_tokens (a count).
    logprobs, ref_logprobs: (N, R) the sampling policy's and the reference's; scores: (N,)"""
    kept = kept_groups(episodes, k)
    per_episode = {"objective/scores": scores, "objective/entropy": -common.masked_sum(logprobs, episodes.mask)}
    if ref_logprobs is not None:
        per_episode["objective/kl"] = common.masked_sum(logprobs - ref_logprobs, episodes.mask)
    # a count over the whole batch: all_reduce_mean of each rank's count times world_size is the sum
    count = (episodes.contains_eos.float() * kept).sum().item() * torch.distributed.get_world_size()
    return common.all_reduce_masked_means(per_episode, kept) | {"val/num_eos_tokens": count}


def kept_groups(episodes: Episodes, k: int) -> torch.Tensor:
    """(N,) 1 for each episode of a group none of whose episodes failed (--env_failure drop_group), else 0."""
    return (~episodes.failed.view(-1, k).any(dim=1)).float().repeat_interleave(k)
