"""Tool environments: an environment's `tools` called in the policy's own format, messages both ways, the chat
template's delta around them, --env_failure and --chat_template_path; on a byte-level BPE chat model's tokenizer
(tests/envs.py:Calculator, tests/templates/tools.jinja), through the one episode loop, without a model."""

import json

import pytest

import environments
import tool_calls
from data import DatasetArgs
from environments import EnvArgs, Turn

TOOLS_TEMPLATE = "tests/templates/tools.jinja"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from own_inputs import chat_policy_and_prompts

    return chat_policy_and_prompts(tmp_path_factory.mktemp("chat"))


def loaded(chat_model, env="tests/envs.py:Calculator", template=TOOLS_TEMPLATE, **flags):
    policy, prompts = chat_model
    env_args = EnvArgs(env=env, chat_template_path=template, max_episode_tokens=2000, **flags)
    task = environments.load_env_task(DatasetArgs(model_name_or_path=policy, dataset_name=prompts), env_args, 4, None,
                                      0, evaluate=False)
    return task, environments.EpisodeLoop(task, env_args)


def started(task, loop, k=2):
    return loop.start(task.train_rows[[0]], [7], k)


def turn(task, text: str) -> Turn:
    return Turn(task.tokenizer(text, add_special_tokens=False)["input_ids"] + [task.eos_ids[0]], True)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_a_turn_that_calls_a_tool_gets_its_result_as_a_tool_message_rendered_by_the_template(chat_model):
    """The first messages (a system prompt, then the user's) and the tools' names through the template; a turn with a
    tool call runs the tool, not step, and its result comes back as the template's tool message, masked; a turn
    without one goes to step."""
    task, loop = loaded(chat_model)
    episode = started(task, loop)[0]
    first = task.tokenizer.decode(episode.prompt_ids)
    assert first.startswith("system : you may call add divide as <tool_call>") and "system : answer with a" in first
    assert first.endswith("assistant : ")
    loop.take_turn(episode, turn(task, call("add", a=2, b=3)))
    assert loop.replies(every_step=True) == [episode]
    assert (episode.counts.tool_calls, episode.counts.tool_errors, episode.env.steps, episode.ended) == (1, 0, 0, False)
    action = len(episode.actions[0].ids)
    assert task.tokenizer.decode(episode.ids[action:]) == " tool : 5 assistant : "  # after the sampled <eos>
    assert episode.is_action == [True] * action + [False] * (len(episode.ids) - action)
    loop.take_turn(episode, turn(task, "five"))
    loop.replies(every_step=True)
    assert episode.env.steps == 1 and episode.ended and episode.episode_return == 1.0 and episode.turns == 2


def test_malformed_calls_unknown_tools_and_bad_arguments_are_told_to_the_policy(chat_model):
    task, loop = loaded(chat_model)
    episode = started(task, loop)[0]
    text = "<tool_call>{add 2 3}</tool_call>" + call("multiply", a=2, b=3) + call("add", a=2, c=3) + "<tool_call>"
    loop.take_turn(episode, turn(task, text))
    loop.replies(every_step=True)
    assert (episode.counts.tool_calls, episode.counts.tool_errors, episode.ended) == (4, 4, False)
    reply = task.tokenizer.decode(episode.ids[len(episode.actions[0].ids):])
    assert reply.count("tool : error: ") == 4, reply
    assert "the tool call is not JSON" in reply and "there is no tool 'multiply'; the tools are add, divide" in reply
    assert "add: missing a required argument: 'b'" in reply and "<tool_call> is not closed" in reply


def test_parse_tool_calls_reads_the_hermes_format():
    ToolCall = tool_calls.ToolCall
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> then '
            '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 4, \\"b\\": 2}"}</tool_call>')
    assert tool_calls.parse_hermes(text, {}) == [ToolCall("add", {"a": 1, "b": 2}),
                                                 ToolCall("divide", {"a": 4, "b": 2})]
    assert tool_calls.parse_hermes("no call here", {}) == []
    assert tool_calls.parse_hermes('<tool_call>{"arguments": {}}</tool_call>', {})[0].error
    assert tool_calls.parse_hermes("<tool_call>7</tool_call>", {})[0].error  # JSON, not a call
    # a missing or null argument object is no arguments (the call's check then names a missing argument)
    assert tool_calls.parse_hermes('<tool_call>{"name": "now", "arguments": null}</tool_call>', {}) == [
        ToolCall("now", {})]
    assert tool_calls.parse_hermes('<tool_call>{"name": "now"}</tool_call>', {}) == [ToolCall("now", {})]


@pytest.mark.parametrize("failure", ["stop", "error_message", "drop_group"])
def test_tool_errors_are_the_policys_to_learn_from_in_every_env_failure_mode(chat_model, one_rank_group, failure):
    """A tool that raises, a wrong-typed argument (checked against the schema before the call: "2" is not an
    integer, and is not added as text), a missing argument object, and results that are not JSON (a set, a numpy
    integer) come back as tool messages and the episode goes on, whatever --env_failure says; each failed call is a
    tool error, and no step failed."""
    task, loop = loaded(chat_model, env="tests/envs.py:OddCalculator", env_failure=failure)
    episodes = started(task, loop)
    text = (call("divide", a=1, b=0) + call("add", a="2", b="3") + '<tool_call>{"name": "add"}</tool_call>'
            + call("digits", n=112) + call("numpy_add", a=2, b=3))
    loop.take_turn(episodes[0], turn(task, text))
    assert loop.replies(every_step=True) == [episodes[0]]
    episode = episodes[0]
    reply = task.tokenizer.decode(episode.ids[len(episode.actions[0].ids):])
    assert reply == (" tool : error: divide raised ZeroDivisionError: division by zero"
                     " tool : error: add: argument 'a' is string '2', the tool takes integer"
                     " tool : error: add: missing a required argument: 'a'"
                     " tool : {1, 2} tool : 5 assistant : "), reply
    counts = episode.counts
    assert (counts.tool_calls, counts.tool_errors, counts.failed_steps, episode.ended) == (5, 3, 0, False)
    batch = environments.collate(episodes, task.tokenizer.pad_token_id, "cpu")
    metrics = environments.rollout_metrics(batch, 2)
    assert (metrics["rollout/tool_calls_mean"], metrics["rollout/tool_errors_mean"]) == (2.5, 1.5)
    assert (metrics["env/failed_steps"], metrics["rollout/dropped_groups"]) == (0.0, 0.0)


def test_a_dropped_group_leaves_the_loss_and_the_returns_and_is_reported_apart(chat_model, one_rank_group):
    """--env_failure drop_group: a step that raises ends its episode and drops its group from the loss, from
    rollout/* and objective/* (which are over the groups kept), and counts in rollout/dropped_groups and
    env/failed_steps (over every episode)."""
    import torch

    task, loop = loaded(chat_model, env="tests/envs.py:FlakyCalculator", env_failure="drop_group")
    rows = task.train_rows[[1, 2]]  # "what is two plus two ?", "what is three plus three ?" (its grader fails)
    episodes = loop.start(rows, [7, 8], 2)
    for episode, answer in zip(episodes, ("five", "one", "five", "five")):  # the chat rows answer "five"
        loop.take_turn(episode, turn(task, answer))
    loop.replies(every_step=True)
    assert [(e.failed, e.episode_return) for e in episodes] == [(False, 1.0), (False, 0.0), (True, 0.0), (True, 0.0)]
    batch = environments.collate(episodes, task.tokenizer.pad_token_id, "cpu")
    assert environments.kept_groups(batch, 2).tolist() == [1.0, 1.0, 0.0, 0.0]
    metrics = environments.rollout_metrics(batch, 2)
    assert (metrics["rollout/return_mean"], metrics["rollout/dropped_groups"]) == (0.5, 0.5)
    assert (metrics["env/failed_steps"], metrics["rollout/turns_mean"]) == (0.5, 1.0)
    logprobs = -torch.ones(batch.responses.shape) * batch.mask  # (N, R) 1 nat a policy token
    objective = environments.objective_metrics(batch, 2, logprobs, None, scores=torch.tensor([1.0, 0.0, 5.0, 5.0]))
    tokens = batch.mask.sum(1).float()
    assert objective["objective/scores"] == 0.5 and objective["val/num_eos_tokens"] == 2
    assert objective["objective/entropy"] == pytest.approx(tokens[:2].mean().item())


def test_a_step_and_a_turn_of_tool_calls_that_time_out_are_told_to_the_policy_with_error_message(chat_model,
                                                                                                  one_rank_group):
    """error_message: a step that hangs comes back as a user message, a turn of tool calls that hangs as each call's
    tool message; each is a failed step and a timeout, each call of the turn a tool error."""
    task, loop = loaded(chat_model, env="tests/envs.py:SlowCalculator", env_failure="error_message",
                        env_timeout=0.5)
    episodes = started(task, loop)
    loop.take_turn(episodes[0], turn(task, "five"))
    loop.take_turn(episodes[1], turn(task, call("wait", seconds=5) + call("add", a=2, b=3)))
    loop.replies(every_step=True)
    stepped, called = episodes
    reply = task.tokenizer.decode(stepped.ids[len(stepped.actions[0].ids):])
    assert reply == " user : error: step did not return within --env_timeout 0.5 s assistant : "
    counts = stepped.counts
    assert (counts.failed_steps, counts.timeouts, counts.tool_calls, counts.tool_errors) == (1, 1, 0, 0)
    reply = task.tokenizer.decode(called.ids[len(called.actions[0].ids):])
    assert reply == " tool : error: tool calls did not return within --env_timeout 0.5 s" * 2 + " assistant : "
    counts = called.counts
    assert (counts.failed_steps, counts.timeouts, counts.tool_calls, counts.tool_errors) == (1, 1, 2, 2)
    assert not stepped.ended and not called.ended
    batch = environments.collate(episodes, task.tokenizer.pad_token_id, "cpu")
    metrics = environments.rollout_metrics(batch, 2)
    assert (metrics["env/timeouts"], metrics["env/failed_steps"]) == (1.0, 1.0)
    assert (metrics["rollout/tool_calls_mean"], metrics["rollout/tool_errors_mean"]) == (1.0, 1.0)
    assert metrics["env/step_time_median"] >= 0.5


def test_a_template_that_rewrites_history_is_refused_with_the_flag_that_fixes_it(chat_model):
    """A template that drops an earlier turn's <think> block once a user message follows (as Qwen3's does) would
    train on tokens the policy never saw in that context: refused, on one line naming --chat_template_path."""
    with pytest.raises(SystemExit) as stop:
        loaded(chat_model, env="tests/envs.py:SaysAnswer", template="tests/templates/rewrites_history.jinja")
    assert str(stop.value.code) == (
        "error: the chat template 'tests/templates/rewrites_history.jinja' (--chat_template_path) renders the earlier "
        "turns differently once a user message follows (it drops or moves them, as Qwen3's drops a <think> block); "
        "the turns of an episode must be appended as they were sampled: give a template that keeps them, "
        "--chat_template_path FILE.jinja")
    with pytest.raises(SystemExit) as stop:
        loaded(chat_model, template="tests/templates/missing.jinja")
    assert "--chat_template_path 'tests/templates/missing.jinja': No such file or directory" in str(stop.value.code)


TOOL_EPISODES = ["--env", "tests/envs.py:Calculator", "--chat_template_path", TOOLS_TEMPLATE, "--response_length",
                 "72", "--max_episode_tokens", "400", "--max_turns", "3", "--eval_every", "0", "--learning_rate",
                 "1e-4"]
TOOL_RUN = [*TOOL_EPISODES, "--total_episodes", "32", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2"]  # 4 updates of 8 rows


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo_multiturn.py", "grpo_multiturn_vllm.py"])
def test_a_tool_environment_of_a_users_own_trains_a_chat_model_that_calls_tools(tmp_path, script):
    """tests/envs.py:Calculator, in a file of the user's own, on a byte-level BPE Qwen2 model taught to call its tool
    half the time, with the training template given by --chat_template_path: both scripts train on episodes with
    tool calls, every metric is finite, and the saved policy loads with the template it trained under."""
    import math

    from own_inputs import tool_policy_and_prompts
    from scripts import assert_trained_policy_saved, read_metrics, run_script

    policy, prompts = tool_policy_and_prompts(tmp_path)
    run_script(*TOOL_RUN, "--model_name_or_path", policy, "--dataset_name", prompts, "--output_dir", tmp_path / "run",
               script=script)
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert len(train) == 4 and all(math.isfinite(value) for m in train for value in m.values()
                                   if isinstance(value, float))
    assert sum(m["rollout/tool_calls_mean"] for m in train) > 0, [m["rollout/tool_calls_mean"] for m in train]
    assert all(m["rollout/tool_errors_mean"] <= m["rollout/tool_calls_mean"] for m in train)
    assert_trained_policy_saved(tmp_path / "run", policy)
    from transformers import AutoTokenizer

    with open(TOOLS_TEMPLATE) as file:
        assert AutoTokenizer.from_pretrained(tmp_path / "run" / "policy").chat_template == file.read()


def test_the_readmes_tool_environment_calls_its_tool_and_answers(chat_model, tmp_path):
    """The README's tool environment, saved as a researcher would: its tool's schema reaches the first message, a
    call of it comes back as its result, the answer ends the episode with its reward."""
    import dataclasses
    import os
    import re

    import datasets

    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Multi-turn environments"):readme.index("## Your own model and data")]
    code = [block for block in re.findall(r"```python\n(.*?)```", section, re.S) if "tools" in block][0]
    (tmp_path / "my_tools.py").write_text(code)
    task, loop = loaded(chat_model, env=f"{tmp_path}/my_tools.py:Calculator")
    assert [schema["function"]["name"] for schema in task.tools] == ["multiply"]
    rows = datasets.Dataset.from_dict({"question": ["what is two times three ?"], "answer": [6]})
    loop.task = task = dataclasses.replace(task, train_rows=rows)
    episode = loop.start(rows[[0]], [0], 1)[0]
    assert "you may call multiply" in task.tokenizer.decode(episode.prompt_ids)
    loop.take_turn(episode, turn(task, call("multiply", a=2, b=3)))
    loop.replies(every_step=True)
    assert task.tokenizer.decode(episode.ids[len(episode.actions[0].ids):]) == " tool : 6 assistant : "
    loop.take_turn(episode, turn(task, "6"))
    loop.replies(every_step=True)
    assert episode.ended and episode.episode_return == 1.0 and episode.counts.tool_calls == 1


# 6 updates of 4 rows, checkpointed every 2
TOOL_INFLIGHT = [*TOOL_EPISODES, "--total_episodes", "24", "--per_device_train_batch_size", "4",
                 "--gradient_accumulation_steps", "1", "--save_every", "2", "--inflight_updates",
                 "--inflight_deterministic"]


@pytest.fixture(scope="module")
def tool_policy(tmp_path_factory):
    from own_inputs import tool_policy_and_prompts

    policy, prompts = tool_policy_and_prompts(tmp_path_factory.mktemp("tools"))
    return ["--model_name_or_path", policy, "--dataset_name", prompts]


@pytest.mark.slow
def test_tool_episodes_in_flight_resume_exactly(tool_policy, tmp_path):
    """Episodes with tool calls in flight (deterministic swaps): killed while checkpoint 4 is written and resumed from
    checkpoint 2, the run replays its episodes in flight, tool calls as steps, and trains exactly as the
    uninterrupted one."""
    from scripts import (
        SHORT_INTERRUPTIONS,
        assert_same_weights_and_metrics,
        read_metrics,
        uninterrupted_and_resumed_runs,
    )

    args = [*TOOL_INFLIGHT, *tool_policy]
    whole, resumed = uninterrupted_and_resumed_runs(tmp_path, "grpo_multiturn_vllm.py", args, SHORT_INTERRUPTIONS)
    train = [m for m in read_metrics(whole) if "loss/policy_avg" in m]
    assert len(train) == 6 and sum(m["rollout/tool_calls_mean"] for m in train) > 0
    assert_same_weights_and_metrics(whole, resumed, ["loss/policy_avg", "rollout/return_mean",
                                                     "rollout/tool_calls_mean", "async/token_staleness_mean"])


@pytest.mark.slow
@pytest.mark.heavy  # in CI, two ranks with episodes in flight train as one (test_multiturn_vllm.py), and tool
# episodes in flight resume exactly (above): the tool layer is each rank's episode loop's, the same on every rank
def test_tool_episodes_in_flight_on_two_ranks_train_as_one(tool_policy, tmp_path):
    """Two ranks and one engine playing episodes with tool calls in flight train as one rank on the same rows."""
    from scripts import assert_two_ranks_train_as_one, free_port, run_script

    args = [*TOOL_INFLIGHT, *tool_policy]
    run_script(*args, "--output_dir", tmp_path / "one", script="grpo_multiturn_vllm.py")
    run_script(*args, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
               "--output_dir", tmp_path / "two", script="grpo_multiturn_vllm.py",
               launcher=("deepspeed", "--num_gpus", "2", "--master_port", str(free_port())),
               env={"OMP_NUM_THREADS": "1"})
    assert_two_ranks_train_as_one(tmp_path / "two", tmp_path / "one")


@pytest.mark.slow
def test_tool_episodes_k_updates_ahead_keep_k_exact(tool_policy, tmp_path):
    """K=1 on tool episodes: every batch after the first sampled exactly one update behind, the engine's log-probs of
    the policy's tokens the trainer's under the same weights (async/logprob_diff on every batch)."""
    from scripts import read_metrics, run_script

    run_script(*TOOL_RUN, *tool_policy, "--logprob_check_every", "1", "--output_dir", tmp_path / "run",
               script="grpo_multiturn_vllm.py")
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert [m["async/staleness"] for m in train] == [0, 1, 1, 1]
    assert max(m["async/logprob_diff"] for m in train) < 1e-4


# the embedded addition task with a tool: its SFT policy calls `add` in about a quarter of its episodes
TOY_TOOLS = ["--env", "toy:add_with_tool", "--model_name_or_path", "toy:tools_policy", "--dataset_name",
             "toy:tools_dataset", "--chat_template", "--response_length", "16"]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "mode"), [("grpo_multiturn.py", []),
                                              ("grpo_multiturn_vllm.py", ["--inflight_updates"])],
                         ids=["sync", "in flight"])
def test_the_embedded_tool_task_learns_to_call_its_tool(tmp_path, script, mode):
    """toy:add_with_tool, synchronous and in flight (K updates ahead: test_tool_episodes_k_updates_ahead_keep_k_exact
    on a user's own tool environment): the policy, which starts a call in about an
    eighth of its episodes and answers from memory (off by a little) in the others, learns to call the tool and read
    its result off: the return of its episodes rises by at least 0.3 (measured about 0.4 -> 0.85 synchronously), its
    tool calls by at least 0.5 an episode."""
    from scripts import read_metrics, run_script

    run_script(*TOY_TOOLS, *mode, "--total_episodes", "1280", "--learning_rate", "3e-4", "--eval_every", "0",
               "--output_dir", tmp_path / "run", script=script)
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    mean = lambda name, updates: sum(m[name] for m in updates) / len(updates)  # noqa: E731
    assert mean("rollout/return_mean", train[-5:]) >= mean("rollout/return_mean", train[:3]) + 0.3, train
    assert mean("rollout/tool_calls_mean", train[-5:]) >= mean("rollout/tool_calls_mean", train[:3]) + 0.5


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["error_message", "drop_group"])
def test_a_flaky_environment_in_a_run_is_told_to_the_policy_or_drops_its_group(tool_policy, tmp_path, failure):
    """An environment whose step fails on about half the rows, in a whole run: with error_message the failures come
    back to the policy as messages and the run trains; with drop_group the groups of the failed episodes leave the
    loss (rollout/dropped_groups). (A failing tool's three behaviours: the unit test above.)"""
    import math

    from scripts import read_metrics, run_script

    flaky = [flag.replace("Calculator", "FlakyCalculator") for flag in TOOL_RUN]
    run_script(*flaky, *tool_policy, "--env_failure", failure, "--output_dir", tmp_path / "run",
               script="grpo_multiturn.py")
    train = [m for m in read_metrics(tmp_path / "run") if "loss/policy_avg" in m]
    assert all(math.isfinite(m["loss/policy_avg"]) for m in train)
    assert sum(m["env/failed_steps"] for m in train) > 0
    dropped = [m["rollout/dropped_groups"] for m in train]
    assert (max(dropped) > 0) if failure == "drop_group" else (max(dropped) == 0), dropped


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo_multiturn.py", "grpo_multiturn_vllm.py"])
def test_drop_group_leaves_the_failed_groups_out_of_the_loss(tool_policy, tmp_path, script):
    """Every step fails: with drop_group every episode that does not run out of turns fails, and with
    --mask_truncated_completions the others leave too, so not one token is in the loss, whose entropy bonus is
    nonzero wherever a token is (error_message, the episodes kept)."""
    from scripts import read_metrics, run_script

    broken = [flag.replace("Calculator", "BrokenGrader") for flag in TOOL_RUN]
    losses = {}
    for failure, flags in (("drop_group", ["--mask_truncated_completions"]), ("error_message", [])):
        run_script(*broken, *tool_policy, "--env_failure", failure, *flags, "--entropy_coef", "0.01",
                   "--output_dir", tmp_path / failure, script=script)
        losses[failure] = [m["loss/policy_avg"] for m in read_metrics(tmp_path / failure) if "loss/policy_avg" in m]
    assert losses["drop_group"] == [0.0] * 4, losses
    assert all(loss != 0.0 for loss in losses["error_message"]), losses


def test_the_embedded_tool_tasks_template_keeps_the_contract_and_is_read_as_hermes():
    """toy:add_with_tool's template renders only the tools' names and a message's content: it passes the contract at
    load, and the format its policy writes is found by the markers of its vocabulary (the template renders no call)."""
    from transformers.utils import get_json_schema

    import toy

    tokenizer = toy.make_tokenizer(toy.TOOLS_WORDS)
    tokenizer.chat_template = toy.TOOLS_TEMPLATE
    tools = [get_json_schema(tool) for tool in toy.AddWithTool().tools]
    *_, tool_format = environments.chat_template_contract(tokenizer, [tokenizer.eos_token_id], tools, "toy",
                                                          EnvArgs(env="toy:add_with_tool"))
    assert tool_format == "hermes"
    ids = tokenizer(toy.tool_call_text(12, 34), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tool_calls.parse_tool_calls(tokenizer, tools, "hermes", ids, [], [tokenizer.eos_token_id]) == [
        tool_calls.ToolCall("add", {"a": 12, "b": 34})]
