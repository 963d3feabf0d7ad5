"""--env_latency, --env_latency_spread and --env_latency_timeouts: any environment's steps made slow (fixed, or
log-normal), or hanging past --env_timeout, through the one episode loop, each episode's draws its own and the
same in every mode; steps still run concurrently."""

import random
import statistics
import time

import pytest

import environments
from data import DatasetArgs
from environments import EnvArgs, Turn


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from own_inputs import chat_policy_and_prompts

    return chat_policy_and_prompts(tmp_path_factory.mktemp("chat"))


def playing(chat_model, k: int, **flags):
    """k episodes of the chat prompts' first row, each after one turn whose step was started."""
    policy, prompts = chat_model
    env_args = EnvArgs(env="tests/envs.py:Calculator", chat_template_path="tests/templates/tools.jinja",
                       max_episode_tokens=2000, **flags)
    task = environments.load_env_task(DatasetArgs(model_name_or_path=policy, dataset_name=prompts), env_args, 4, None,
                                      0, evaluate=False)
    loop = environments.EpisodeLoop(task, env_args)
    episodes = loop.start(task.train_rows[[0]], [7], k)
    answer = Turn(task.tokenizer("five", add_special_tokens=False)["input_ids"] + [task.eos_ids[0]], True)
    for episode in episodes:
        loop.take_turn(episode, answer)
    return loop, episodes


def test_a_fixed_latency_delays_every_step_and_the_steps_still_run_together(chat_model):
    loop, episodes = playing(chat_model, 8, env_latency=0.5)
    started = time.monotonic()
    loop.replies(every_step=True)
    assert all(episode.step_times[0] >= 0.5 for episode in episodes)
    assert time.monotonic() - started < 3.0  # one after the other: 4 s at least
    assert all(len(episode.actions) == 1 and not episode.counts.failed_steps for episode in episodes)


def test_each_step_time_is_its_own_not_the_wait_for_the_slowest(chat_model):
    """Collected once every step of the turn has returned (as a synchronous turn is), each step's time is still its
    own latency (log-normal, each episode's own draw), not the slowest step's."""
    loop, episodes = playing(chat_model, 8, env_latency=0.3, env_latency_spread=1.0)
    loop.replies(every_step=True)
    args = EnvArgs(env_latency=0.3, env_latency_spread=1.0)
    drawn = [environments.draw_latency(environments.latency_generator(args, 7, i), args)[1] for i in range(8)]
    slowest = max(drawn)
    assert slowest > 2 * min(drawn)
    for episode, seconds in zip(episodes, drawn):
        assert episode.step_times[0] >= seconds, (episode.step_times, drawn)
    # the wrong measure reads every step as the slowest; a loaded machine (CI builds tasks beside the tests) adds
    # tenths of a second to a step's own time, so the steps far from the slowest are held nearer their own draw
    quick = [(episode.step_times[0], seconds) for episode, seconds in zip(episodes, drawn) if seconds < slowest / 2]
    assert len(quick) >= 4
    assert all(own < (seconds + slowest) / 2 for own, seconds in quick), (quick, slowest)


def test_a_share_of_the_steps_hang_past_the_timeout_and_env_failure_takes_them(chat_model):
    """Which steps hang comes from each episode's own generator (its reset seed and place in its group)."""
    loop, episodes = playing(chat_model, 8, env_latency_timeouts=0.5, env_timeout=0.3, env_failure="error_message")
    loop.replies(every_step=True)
    expected = [random.Random(f"7/{i}/latency").random() < 0.5 for i in range(8)]
    assert [episode.counts.timeouts for episode in episodes] == [int(hangs) for hangs in expected]
    assert 0 < sum(expected) < 8
    assert all(not episode.ended for episode, hangs in zip(episodes, expected) if hangs)  # told, and going on


def test_the_latency_is_log_normal_around_its_median():
    args = EnvArgs(env_latency=0.5, env_latency_spread=1.0, env_latency_timeouts=0.1)
    generator = random.Random(0)
    draws = [environments.draw_latency(generator, args) for _ in range(4000)]
    seconds = [s for _, s in draws]
    assert statistics.median(seconds) == pytest.approx(0.5, rel=0.08)
    # the slowest in 20 at about 5x the median: exp(1.645 sigma)
    assert sum(s > 0.5 * 5.18 for s in seconds) / len(seconds) == pytest.approx(0.05, abs=0.015)
    assert sum(hangs for hangs, _ in draws) / len(draws) == pytest.approx(0.1, abs=0.02)
    fixed = EnvArgs(env_latency=0.25)
    assert {environments.draw_latency(generator, fixed) for _ in range(10)} == {(False, 0.25)}


@pytest.mark.parametrize("flags, message", [
    ({"env_latency": -1.0}, "--env_latency must be 0 or positive, got -1.0"),
    ({"env_latency_timeouts": 1.0}, "--env_latency_timeouts is a share of the steps"),
])
def test_a_latency_out_of_range_is_refused_on_one_line(flags, message):
    with pytest.raises(SystemExit, match=message):
        EnvArgs(**flags).check()


def test_a_resumed_run_replays_each_episode_in_flight_with_its_own_latency(chat_model):
    """In flight, a snapshot's group whose first episode has ended and whose second has a tool call's turn replied
    and its next step running: restoring it replays the second alone, and its --env_latency draws go on from its own
    generator (its place in the group, not among the episodes replayed), as in the uninterrupted run."""
    import types

    import inflight

    policy, prompts = chat_model
    env_args = EnvArgs(env="tests/envs.py:Calculator", chat_template_path="tests/templates/tools.jinja",
                       max_episode_tokens=2000, env_latency=0.01, env_latency_spread=1.0)
    task = environments.load_env_task(DatasetArgs(model_name_or_path=policy, dataset_name=prompts), env_args, 4, None,
                                      0, evaluate=False)

    def engine_state() -> inflight.InflightEpisodes:  # what restoring reads, without an engine
        in_flight = object.__new__(inflight.InflightEpisodes)
        in_flight.job = types.SimpleNamespace(seed=1, share=(0, 1))
        in_flight.source = types.SimpleNamespace(num_samples=2)
        in_flight.loop = environments.EpisodeLoop(task, env_args)
        return in_flight

    in_flight = engine_state()
    group = inflight.InflightGroup(serial=1, prompt_index=0)
    group.samples = in_flight.new_samples(group)
    ended, running = (state.episode for state in group.samples)
    encode = lambda text: Turn(task.tokenizer(text)["input_ids"] + task.eos_ids, True)  # noqa: E731
    call = encode('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    in_flight.loop.take_turn(ended, encode("five"))
    in_flight.loop.take_turn(running, call)
    in_flight.loop.replies(every_step=True)
    in_flight.loop.take_turn(running, call)  # its second turn's step: running when the snapshot is taken
    assert ended.ended and not running.ended and running.counts.tool_calls == 1
    own = environments.latency_generator(env_args, group.reset_seed, 1)
    draws = [environments.draw_latency(own, env_args) for _ in range(3)]  # the second episode's steps' latencies
    replayed = engine_state().restored(in_flight.portable(group)).samples[1].episode
    assert replayed.turns == 1 and replayed.pending == call
    assert environments.draw_latency(replayed.latency, env_args) == draws[1]  # its running step starts again
    assert environments.draw_latency(running.latency, env_args) == draws[2]
