"""In-flight weight updates (--inflight_updates in the _vllm scripts), as PipelineRL, open-instruct's
inflight_updates and AReaL do: the generator process runs its engine step by step, kept full of prompt
groups (continuous batching), and takes each new weight version between two decode steps without dropping
the KV of the requests in flight. Every sampled token records the version that sampled it; a batch is the
next groups (all k samples of a prompt) to finish, so the staleness of a batch is a distribution over its
tokens, logged every update (inflight_metrics).

When versions load (both modes keep the bound of --async_steps K: once it has finished the batch of update
t, the engine samples on only with the weights after update t-K, waiting for them if need be):
- free (the default): each version as soon as it arrives, at the next step; the swap moments depend on
  the clock, so a run is not repeatable, and a resumed run loses and repeats no prompt, but differs.
- deterministic (--inflight_deterministic): the version after update t-K exactly when the batch of update t
  is finished, waiting if the trainer is behind: every swap falls on the same token of the same request in
  every run. A checkpoint's engine state is taken at such a swap, and the requests in flight continue from
  their tokens so far, prefilled anew with the new weights, in the uninterrupted run too: a run killed and
  resumed from a --save_every checkpoint trains exactly as the uninterrupted one.

--max_lag L: a group with a token more than L versions behind the weights that will train on it is dropped
(async/dropped_groups) and the next finished group takes its place in the batch: the engine never waits for
the trainer because of it, and the batch keeps its size.

grpo_multiturn_vllm.py's groups are k episodes of an environment (InflightEpisodes, played through
environments.EpisodeLoop): an episode's turns are requests of their own, its environment steps between them, and
it goes on across weight loads.
"""

import collections
import contextlib
import copy
import dataclasses
import multiprocessing
import queue
import random
import time
from dataclasses import dataclass, field

import numpy
import torch

import common
import environments
import vllm_generator
import weight_transport
from vllm_generator import Batch, GeneratorJob


def sample_seed(seed: int, engine: int, serial: int, sample: int, tokens_done: int = 0) -> int:
    """The sampling seed of sample `sample` of the `serial`-th prompt group engine `engine` admits, from its
    `tokens_done`-th token on (a request prefilled anew at a checkpoint draws anew)."""
    return random.Random(f"{seed}/{engine}/{serial}/{sample}/{tokens_done}").getrandbits(63)


@dataclass
class InflightSample:
    """One sample of a group in flight: the tokens its request sampled so far (with episodes, of the turn running),
    their engine log-probs and versions, whether the sample is done, the engine's id of its request while one runs,
    and with episodes its Episode."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    request: str | None = None
    episode: environments.Episode | None = None


@dataclass
class InflightGroup:
    """A prompt group in flight: the `serial`-th an engine admitted, of the train row `prompt_index`, its k samples;
    with episodes, the reset seed its episodes share."""

    serial: int
    prompt_index: int
    samples: list[InflightSample] = field(default_factory=list)
    reset_seed: int | None = None


@dataclass
class EngineWindow:
    """The engine's time and drops since its last batch (window_metrics)."""

    start: float = field(default_factory=time.time)
    idle: float = 0.0  # seconds waiting for weights
    weight_load: float = 0.0
    dropped: int = 0  # groups dropped by --max_lag


class InflightCompletions:
    """What one generator process's engine does in flight, driven step by step: this engine's share of a batch
    of prompt groups in flight at all times, each sample's tokens with their engine log-probs and versions."""

    def __init__(self, job: GeneratorJob, llm, receiver, sampling_policy, one_to_one):
        self.job, self.source, self.asynchronous, self.llm = job, job.source, job.asynchronous, llm
        self.llm_engine, self.receiver, self.sampling_policy, self.one_to_one = llm.llm_engine, receiver, \
            sampling_policy, one_to_one
        self.capacity = len(vllm_generator.engine_share(range(self.source.sampler.global_batch_size), job.share))
        self.loaded = 0  # the engine starts with the SFT weights, version 0
        self.groups: dict[int, InflightGroup] = {}  # in flight, by serial
        self.finished = collections.deque()  # groups whose k samples are done, in the order they finished
        self.accepted = []  # finished groups of the batch being put together
        self.prompts = collections.deque()  # this engine's share of the global batches drawn, not admitted yet
        self.serial = 0  # groups admitted
        self.requests_added = 0  # the engine's request ids: unique, a request prefilled anew included
        self.window = EngineWindow()

    def admit(self):
        """Fill the engine up to --inflight_batches batches' worth of groups in flight, prompts salted with the
        loaded version: a prompt's cached KV serves only prompts of the same weights."""
        while len(self.groups) < self.capacity * self.asynchronous.inflight_batches:
            if not self.prompts:
                self.prompts.extend(vllm_generator.engine_share(self.source.sampler.next_indices(), self.job.share))
            self.serial += 1
            group = InflightGroup(self.serial, self.prompts.popleft())
            group.samples = self.new_samples(group)
            self.groups[self.serial] = group
            for sample in range(self.source.num_samples):
                self.add_request(self.serial, sample)

    def new_samples(self, group: InflightGroup) -> list[InflightSample]:
        """The k samples of a new group."""
        return [InflightSample() for _ in range(self.source.num_samples)]

    def context(self, group: InflightGroup, state: InflightSample) -> tuple[list[int], int, int]:
        """A sample's request: (the ids it continues, the tokens it sampled so far that seed its draws, the
        tokens it may still sample)."""
        done = len(state.tokens)
        return (self.source.prompts[group.prompt_index] + state.tokens, done,
                self.source.generation.response_length - done)

    def add_request(self, serial: int, sample: int):
        """Sample `sample` of group `serial` into the engine, from its tokens so far."""
        from vllm.inputs import TokensPrompt

        group = self.groups[serial]
        state = group.samples[sample]
        ids, done, max_tokens = self.context(group, state)
        self.requests_added += 1
        state.request = f"{serial}/{sample}/{self.requests_added}"
        seed = sample_seed(self.job.seed, self.job.share[0], serial, sample, done)
        prompt = TokensPrompt(prompt_token_ids=ids, cache_salt=f"version {self.loaded}")
        params = vllm_generator.sampling_params(self.source.generation, self.source.eos_ids, seed, max_tokens,
                                                delta=True)
        self.llm_engine.add_request(state.request, prompt, params)

    def step(self):
        """One engine step: every running request's next token, tagged with the loaded version."""
        for output in self.llm_engine.step():
            serial, sample, _ = map(int, output.request_id.split("/"))
            group = self.groups.get(serial)
            if group is None or group.samples[sample].request != output.request_id:
                continue  # a request aborted to be prefilled anew
            state, completion = group.samples[sample], output.outputs[0]
            state.tokens += completion.token_ids
            state.logprobs += completion.logprobs.logprobs if completion.token_ids else []
            state.versions += [self.loaded] * len(completion.token_ids)
            if output.finished:
                state.request = None
                self.request_finished(group, sample)

    def request_finished(self, group: InflightGroup, sample: int):
        """Sample `sample`'s request is done: so is the sample, and the group once its k samples are."""
        group.samples[sample].done = True
        self.group_done(group)

    def group_done(self, group: InflightGroup):
        if all(s.done for s in group.samples):
            self.finished.append(self.groups.pop(group.serial))

    def load(self, version: int):
        """Load the arrived `version` between two steps, the requests in flight keeping their KV."""
        t0 = time.time()
        self.receiver.load(version, self.llm, in_flight=True)
        weight_transport.check_engine_holds(self.llm, self.sampling_policy, self.one_to_one, version)
        self.loaded = version
        self.window.weight_load += time.time() - t0

    def wait_and_load(self, version: int, poll) -> bool:
        """Load `version`, waiting for it (engine idle time); False when the trainer is gone."""
        t0 = time.time()
        arrived = self.receiver.wait_for(version, poll)
        self.window.idle += time.time() - t0
        if arrived:
            self.load(version)
        return arrived

    def next_batch(self, update: int, poll) -> Batch | None:
        """The batch of `update`: the next groups to finish, but those with a token more than --max_lag
        versions behind the weights that train on it (update - 1); None when the trainer is gone."""
        while len(self.accepted) < self.capacity:
            while not self.finished:
                if not multiprocessing.parent_process().is_alive():
                    return None
                poll()
                if not self.asynchronous.inflight_deterministic:
                    newest = self.receiver.newest()
                    if newest is not None and newest > self.loaded:
                        self.load(newest)
                self.admit()
                self.step()
            group = self.finished.popleft()
            oldest = self.oldest_version(group)
            max_lag = self.asynchronous.max_lag
            if max_lag is not None and vllm_generator.staleness(update, oldest) > max_lag:
                self.window.dropped += 1
            else:
                self.accepted.append(group)
        batch = self.batch(update)
        self.accepted, self.window = [], EngineWindow()
        return batch

    @staticmethod
    def oldest_version(group: InflightGroup) -> int:
        """The oldest version that sampled a token of the group."""
        return min(v for sample in group.samples for v in sample.versions)

    def window_metrics(self) -> dict:
        """The engine's time and drops since the last batch."""
        return {"time/generate": time.time() - self.window.start - self.window.idle,
                "time/engine_idle": self.window.idle, "time/weight_load": self.window.weight_load,
                "async/dropped_groups": self.window.dropped, "async/groups_in_flight": len(self.groups)}

    def batch(self, update: int) -> Batch:
        """The accepted groups as a batch (rows: each group's k samples, adjacent), with each token's version
        (token_versions, -1 at pads) and the engine's metrics."""
        k = self.source.num_samples
        samples = [sample for group in self.accepted for sample in group.samples]
        shape = (len(samples), self.source.generation.response_length)
        responses = numpy.full(shape, self.source.pad_token_id, dtype=numpy.int64)
        logprobs = numpy.full(shape, common.INVALID_LOGPROB, dtype=numpy.float32)
        versions = numpy.full(shape, -1, dtype=numpy.int64)
        for row, sample in enumerate(samples):
            length = len(sample.tokens)
            responses[row, :length], logprobs[row, :length] = sample.tokens, sample.logprobs
            versions[row, :length] = sample.versions
        prompt_indices = [group.prompt_index for group in self.accepted]
        queries = [self.source.prompts[index] for index in prompt_indices for _ in range(k)]
        batch = Batch(update=update, prompt_indices=prompt_indices, queries=queries, responses=responses,
                      logprobs=logprobs, token_versions=versions, metrics=self.window_metrics(),
                      version=int(versions[versions >= 0].min()), engine=self.job.share,
                      data_position=self.source.sampler.position)
        # the rows sampled wholly with the loaded weights, which the sampling policy holds
        self.check_logprobs(batch, update, [row for row, sample in enumerate(samples)
                                            if set(sample.versions) == {self.loaded}])
        return batch

    def check_logprobs(self, batch: Batch, update: int, current: list[int]):
        """async/logprob_diff on the batch's rows sampled wholly with the loaded weights (`current`): the engine must
        have taken them."""
        logprob_diff = vllm_generator.check_logprobs(self.job, self.sampling_policy, batch, update, current)
        if logprob_diff is not None:
            vllm_generator.check_engine_took_weights(logprob_diff, self.loaded, self.job)

    def snapshot(self, update: int, next_update: int) -> vllm_generator.Snapshot:
        """What a checkpoint after `update` needs to continue this engine: the groups in flight with their
        tokens so far, those finished but not yet in a batch, the prompts drawn but not admitted, the batch
        being put together (`next_update`'s)."""
        portable = lambda groups: [self.portable(group) for group in groups]  # noqa: E731
        return vllm_generator.Snapshot(update, copy.deepcopy({
            "update": next_update, "engine": self.job.share, "loaded": self.loaded,
            "groups": portable(self.groups.values()), "finished": portable(self.finished),
            "accepted": portable(self.accepted),
            "dropped": self.window.dropped, "prompts": list(self.prompts), "serial": self.serial,
            "requests_added": self.requests_added, "data_position": self.source.sampler.position}))

    def portable(self, group: InflightGroup) -> dict:
        """A group as a snapshot holds it: plain data a checkpoint can keep."""
        return dataclasses.asdict(group)

    def restored(self, group: dict) -> InflightGroup:
        """A group of a snapshot, as this engine continues it."""
        return InflightGroup(**group | {"samples": [InflightSample(**state) for state in group["samples"]]})

    def running_requests(self) -> list[str]:
        """The engine's ids of the requests in flight."""
        return [sample.request for group in self.groups.values() for sample in group.samples
                if sample.request is not None]

    def prefill_anew(self):
        """Every request in flight continues from its tokens so far, prefilled with the loaded weights."""
        running = self.running_requests()
        self.llm_engine.abort_request(running)
        for serial, group in self.groups.items():
            for sample, state in enumerate(group.samples):
                if state.request in running:
                    self.add_request(serial, sample)

    def restore(self, snapshot: dict):
        """Continue from a checkpoint's snapshot, with its weights loaded."""
        self.groups = {group["serial"]: self.restored(group) for group in snapshot["groups"]}
        self.finished = collections.deque(map(self.restored, snapshot["finished"]))
        self.accepted = [self.restored(group) for group in snapshot["accepted"]]
        self.window.dropped = snapshot["dropped"]
        self.prompts, self.serial = collections.deque(snapshot["prompts"]), snapshot["serial"]
        self.requests_added = snapshot["requests_added"]
        self.source.sampler.position = snapshot["data_position"]
        self.prefill_anew()


class InflightEpisodes(InflightCompletions):
    """--inflight_updates in grpo_multiturn_vllm.py: each group in flight is k episodes of a dataset row from one
    reset seed (job.source, a rollouts.SampleEpisodes), played through environments.EpisodeLoop, each turn of
    an episode a request. Once a turn is sampled, its environment steps on it (the loop's thread) while the engine
    samples the other episodes' turns; the reply's tokens are appended and the episode's next turn goes into the
    engine, its context prefilled with the weights loaded then. Every policy token records the version that sampled
    it, the environment's tokens -1. With --inflight_deterministic the steps that a decode step's turns started are
    waited for before the next decode step, so that the engine's batches do not depend on the steps' timing.

    A snapshot keeps each episode's tokens and the turns the policy sampled, not its environment object: a
    resumed run rebuilds the environment of each episode in flight from its row and reset seed and steps it on
    the same turns again, through the same loop (the contract's environments are deterministic given both), then
    checks that it answers with the same tokens."""

    def __init__(self, job: GeneratorJob, llm, receiver, sampling_policy, one_to_one):
        super().__init__(job, llm, receiver, sampling_policy, one_to_one)
        self.loop = self.source.loop()

    def new_samples(self, group: InflightGroup) -> list[InflightSample]:
        """The k episodes of a new group, reset from its row and seed, each beside its request's state (the turn
        sampled so far)."""
        group.reset_seed = environments.reset_seed(self.job.seed, f"engine {self.job.share[0]}", group.serial)
        return [InflightSample(episode=episode) for episode in self.start(group, self.source.num_samples)]

    def start(self, group: InflightGroup, count: int) -> list[environments.Episode]:
        """`count` episodes of the group's row, reset with its seed, numbered by (group, sample)."""
        rows = self.loop.task.train_rows[[group.prompt_index]]
        return self.loop.start(rows, [group.reset_seed], count, (group.serial - 1) * self.source.num_samples)

    def place(self, episode: environments.Episode) -> tuple[int, int]:
        """(the serial of the episode's group, its sample), from its number (start's)."""
        group, sample = divmod(episode.number, self.source.num_samples)
        return group + 1, sample

    def context(self, group: InflightGroup, state: InflightSample) -> tuple[list[int], int, int]:
        """The episode so far and its turn's tokens so far; what is left of the turn's budget."""
        episode, turn = state.episode, state.tokens
        budget = episode.budget(self.source.generation.response_length, self.loop.env_args.max_episode_tokens)
        return episode.prompt_ids + episode.ids + turn, len(episode.ids) + len(turn), budget - len(turn)

    def request_finished(self, group: InflightGroup, sample: int):
        """A turn sampled: its environment steps on it."""
        state = group.samples[sample]
        turn = environments.Turn.sampled(state.tokens, self.source.eos_ids, state.logprobs, state.versions)
        state.tokens, state.logprobs, state.versions = [], [], []
        self.loop.take_turn(state.episode, turn)

    def step(self):
        """The environments' replies that came (with --inflight_deterministic, once every step running has),
        each appended to its episode, whose next turn goes into the engine unless it ended; then one engine step,
        when a turn is running. The turns go in right before the step, so that no weights load between: the
        cache salt of their prefill names the weights that compute it."""
        busy = self.llm_engine.has_unfinished_requests()
        for episode in self.loop.replies(wait=0.0 if busy else 0.005,
                                         every_step=self.asynchronous.inflight_deterministic):
            serial, sample = self.place(episode)
            group = self.groups[serial]
            if episode.ended:
                group.samples[sample].done = True
                self.group_done(group)
            else:
                self.add_request(serial, sample)
        if self.llm_engine.has_unfinished_requests():
            super().step()

    @staticmethod
    def oldest_version(group: InflightGroup) -> int:
        return min(v for state in group.samples for v in state.episode.versions if v >= 0)

    def batch(self, update: int) -> Batch:
        """The accepted groups' episodes as a batch, with each policy token's version (token_versions; -1 at the
        environment's tokens and pads) and the engine's metrics."""
        episodes = environments.collate([state.episode for group in self.accepted for state in group.samples],
                                        self.source.pad_token_id, "cpu")
        versions = episodes.token_versions
        batch = Batch(update=update, prompt_indices=[group.prompt_index for group in self.accepted],
                      metrics=self.window_metrics(), version=int(versions[versions >= 0].min()),
                      engine=self.job.share, data_position=self.source.sampler.position, **episodes.as_arrays())
        # the episodes sampled wholly with the loaded weights, which the sampling policy holds
        self.check_logprobs(batch, update, [row for row, row_versions in enumerate(versions.tolist())
                                            if {v for v in row_versions if v >= 0} == {self.loaded}])
        return batch

    def portable(self, group: InflightGroup) -> dict:
        """The group with each episode's values but its environment object (Episode.portable)."""
        return {**dataclasses.asdict(dataclasses.replace(group, samples=[])),
                "samples": [{**dataclasses.asdict(dataclasses.replace(state, episode=None)),
                             "episode": state.episode.portable()} for state in group.samples]}

    def restored(self, group: dict) -> InflightGroup:
        """The group's episodes: those in flight with their environments rebuilt by replaying, through the loop,
        the turns they had replies to (restore starts again a step the snapshot caught running), the others as
        they were."""
        restored = InflightGroup(**group | {"samples": []})
        saved = [state["episode"] for state in group["samples"]]
        playing = [episode for episode in saved if not episode["ended"]]
        replayed = self.start(restored, len(playing))
        for episode, before in zip(replayed, playing):
            episode.number, episode.where = before["number"], before["where"]
            # its own place in the group draws its --env_latency (start numbered the replayed ones alone)
            episode.latency = environments.latency_generator(self.loop.env_args, group["reset_seed"],
                                                             self.place(episode)[1])

        def saved_turn(episodes: list[environments.Episode], turn: int) -> list:
            return [environments.Turn(*before["actions"][turn]) if turn < len(before["actions"]) else None
                    for before in playing]

        self.loop.play_turn_by_turn(replayed, saved_turn)
        by_number = {episode.number: episode for episode in replayed}
        for state, before in zip(group["samples"], saved):
            episode = by_number.get(before["number"]) or environments.Episode.from_portable(before)
            if (episode.prompt_ids, episode.ids, episode.episode_return) != (
                    before["prompt_ids"], before["ids"], before["episode_return"]):
                common.fail(f"--resume: {before['where']}, replayed from its row and reset seed, answers otherwise "
                            "than in the interrupted run; an environment must act the same given its row and seed for "
                            "a run to resume with --inflight_updates")
            episode.pending = before["pending"] and environments.Turn(*before["pending"])
            # the interrupted run's step times, not the replay's (its running step restarts: take_turn times it)
            episode.step_times, episode.step_started = before["step_times"], before["step_started"]
            restored.samples.append(InflightSample(**state | {"episode": episode}))
        return restored

    def restore(self, snapshot: dict):
        """As InflightCompletions's, and the steps the snapshot caught running start again."""
        super().restore(snapshot)
        for group in self.groups.values():
            for state in group.samples:
                if state.episode.pending is not None:
                    self.loop.take_turn(state.episode, state.episode.pending)


def generate_inflight(job: GeneratorJob):
    """The generator process with --inflight_updates (see the module's docstring): EngineStarted, then the
    batch of each update in `job.updates`, and the snapshots a checkpoint takes (the engine's own at each
    deterministic swap to a --save_every version, vllm_generator.proactive_snapshot, or as the trainer asks on
    the channel `requests`), go to the channel `messages`. After the last batch it answers snapshot requests
    until the trainer stops it. The engine plays in flight what its source's kind plays (RolloutSource.in_flight:
    InflightCompletions' completions, or InflightEpisodes' episodes)."""
    channels = job.channels
    try:
        llm, sampling_policy, one_to_one, receiver = vllm_generator.start_engine(job)
        in_flight = job.source.in_flight(job, llm, receiver, sampling_policy, one_to_one)
        channels.messages.put(vllm_generator.EngineStarted())
        next_update = job.updates.start

        def answer_snapshot_requests():
            with contextlib.suppress(queue.Empty):
                channels.messages.put(in_flight.snapshot(channels.requests.get_nowait(), next_update))

        if job.snapshot is not None and len(job.updates):  # a resumed run: its weights first
            if not in_flight.wait_and_load(job.first_version, answer_snapshot_requests):
                return
            in_flight.restore(job.snapshot)
        for update in job.updates:
            next_update = update
            batch = in_flight.next_batch(update, answer_snapshot_requests)
            if batch is None:
                return  # no trainer: free the engine's device
            channels.messages.put(batch)
            # once the batch of update t is finished, the engine samples on with the weights after update t-K
            next_update, version = update + 1, vllm_generator.sampling_version(update + 1, job.asynchronous.async_steps)
            if update == job.updates.stop - 1 or version <= in_flight.loaded:
                continue
            if not in_flight.wait_and_load(version, answer_snapshot_requests):
                return
            if vllm_generator.swaps_with_snapshot(job.asynchronous, job.save_every, version):
                channels.messages.put(in_flight.snapshot(version, next_update))
                in_flight.prefill_anew()
        in_flight.llm_engine.abort_request(in_flight.running_requests())
        while multiprocessing.parent_process().is_alive():
            answer_snapshot_requests()
            time.sleep(0.1)
    except BaseException as error:  # any failure must reach the trainer, which stops with it
        channels.messages.put(vllm_generator.Failure(vllm_generator.failure_text(error)))


def inflight_metrics(batch: Batch, mask: torch.Tensor, update: int) -> dict:
    """The staleness of this update's tokens, over every rank: async/token_staleness_mean and _max (versions
    between the weights that sampled a token and those that train on it, vllm_generator.staleness), and
    async/multi_version_share, the share of completions sampled by more than one version.
    mask: (N, R) the rollout's response tokens"""
    versions = batch.token_versions[:, :mask.shape[1]].to(mask.device)  # (N, R)
    staleness = vllm_generator.staleness(update, versions).float()
    metrics = common.all_reduce_masked_means({"async/token_staleness_mean": staleness}, mask)
    oldest = torch.where(mask.bool(), staleness, 0.0).max().to(common.local_device(), torch.float64)
    torch.distributed.all_reduce(oldest, torch.distributed.ReduceOp.MAX)  # NCCL: on the GPU
    newest = torch.where(mask.bool(), versions, -1).max(1).values  # (N,)
    first = torch.where(mask.bool(), versions, torch.iinfo(versions.dtype).max).min(1).values  # (N,)
    metrics |= common.all_reduce_mean({"async/multi_version_share": (newest > first).float().mean().item()})
    return metrics | {"async/token_staleness_max": oldest.item()}
