"""The trainer's side of the asynchronous scripts' vLLM engine (AsyncGenerator): it starts the generator
process (vllm_generator.generate_ahead, or inflight.generate_inflight with --inflight_updates) where
vllm_placement says, hands each rank its share of each batch, sends the weights (weight_transport), and keeps
what a checkpoint needs so that a resumed run trains on exactly the same samples. A script builds what its engine
samples (rollouts.SamplePrompts or SampleEpisodes) and hands it over; its loop calls batch_for,
publish_weights, evaluations and checkpoint_state."""

import atexit
import collections
import contextlib
import datetime
import itertools
import multiprocessing
import os
import queue
import time

import torch

import common
import inflight
import lora
import outputs
import vllm_generator
import vllm_placement
import weight_transport
from vllm_generator import AsyncArgs, Batch, sampling_version
from vllm_placement import EngineArgs


def check_flags(asynchronous: AsyncArgs, engine_args: EngineArgs, world_size: int):
    """What the asynchronous flags' groups cannot check alone, before anything is written: in-flight updates
    need an engine that samples while the trainer trains, and the engines' places must exist."""
    if asynchronous.inflight_updates and engine_args.vllm_device == "shared":
        common.fail("--inflight_updates needs an engine that samples while the trainer trains: not --vllm_device "
                    "shared (engine and trainer take turns there)")
    vllm_placement.check_placement(engine_args, world_size)


def evaluated_updates(eval_every: int, start_update: int, num_updates: int) -> list[int]:
    """The updates whose weights a run evaluates from `start_update` on: the starting policy's (a new run's), every
    --eval_every-th and the last (none with --eval_every 0)."""
    return [update for update in range(start_update, num_updates + 1) if eval_every and (
        update == 0 or (update > start_update and (update % eval_every == 0 or update == num_updates)))]


ENGINE_DIED = ("the vLLM engine process died (killed, or out of memory); the last complete checkpoint is kept, "
               "--resume continues from it")


class AsyncGenerator:
    """The trainer's side of its engine's generator process (generate_ahead, placed by start_generator).

    One engine per node (or --vllm_engines_per_node), each for an equal share of the node's consecutive
    ranks: every rank makes an AsyncGenerator and makes each call; the first rank of each share (its
    leader) talks to its engine's process and hands each rank of the share its part. Weights reach the
    engine in memory (SharedWeights, or over NCCL between two GPUs), announced by version number; under
    ZeRO-3 every rank gathers each bucket, so no weights cross nodes for it. Batches
    an interrupted run had sampled ahead (the leader's `state.pending_batches`) come first; the process
    carries on drawing prompts from its source's sampler (whole global batches, of which it samples its share)
    after them. The process is stopped when the trainer exits, however it exits. What it sends is typed
    (vllm_generator's messages), each taken by its kind (_take).
    """

    def __init__(self, asynchronous: AsyncArgs, engine_args: EngineArgs, source: vllm_generator.RolloutSource,
                 run: outputs.RLRunArgs, state: outputs.OnlineTrainerState, num_updates: int):
        """What the engine samples, and how: `source` (SamplePrompts' completions of the train prompts, scored each
        round with --dynamic_sampling, or SampleEpisodes' episodes of an environment task). The first engine also
        evaluates the weights of each update the run evaluates (`evaluations`), unless --eval_in_trainer, or the
        engine cannot (in flight, or taking turns with the trainer)."""
        self.asynchronous, self.num_updates, self.save_every = asynchronous, num_updates, run.save_every
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        engine_ranks = vllm_placement.ranks_per_engine(engine_args.vllm_engines_per_node, world_size, os.environ)
        self.share = (rank // engine_ranks, world_size // engine_ranks)  # this rank's engine: (index, engines)
        self.leader = rank % engine_ranks == 0
        # each rank's batch comes from its leader
        self.engine_group, _ = torch.distributed.new_subgroups(
            engine_ranks, timeout=datetime.timedelta(seconds=vllm_generator.process_group_timeout(asynchronous)))
        self.num_samples, self.prompts_per_rank = source.num_samples, source.sampler.global_batch_size // world_size
        self.sampled_ahead = collections.deque(map(Batch.from_checkpoint, state.pending_batches))
        self._check_engines_of(state)
        source.sampler.position = self.sampled_ahead[-1].data_position if self.sampled_ahead else state.data_position
        self.channels = self.process = self.placement = None
        self.store = self.channel = None  # over NCCL
        self.shared, self.free_shared = {}, []  # SharedWeights by handle, and those the generator handed back
        self.engine_started = False
        self.snapshots = {}  # --inflight_updates: the engine's snapshots by the update whose checkpoint takes them
        self.requested = state.update + len(self.sampled_ahead)  # the last update whose batch was asked for
        self.due = evaluated_updates(run.eval_every, state.update, num_updates)  # in the engine or in the trainer
        self.in_engine = not (asynchronous.eval_in_trainer or asynchronous.inflight_updates
                              or engine_args.vllm_device == "shared")
        self.engine_versions = set(self.due) if self.in_engine else set()  # published past the last batch's
        self.arrived = {}  # the engine's evaluations by version, not yet handed to the ranks
        if self.leader:
            self._start_process(engine_args, source, run.seed, state)
            if self.placement.takes_turns:  # on the trainer's GPU, it measures its memory before the trainer's
                self.wait_for_engine()      # first evaluation takes some

    def _check_engines_of(self, state: outputs.OnlineTrainerState):
        """A resumed run's engines must be the interrupted run's: its sampled-ahead batches (and in-flight snapshot)
        are this rank's engine's share."""
        engines = [batch.engine for batch in self.sampled_ahead] + ([state.engine_snapshot["engine"]]
                                                                   if state.engine_snapshot else [])
        if any(tuple(engine) != self.share for engine in engines):
            sampled_for = engines[0]
            common.fail(f"--resume: the checkpoint's sampled-ahead batches are engine {sampled_for[0]} of "
                        f"{sampled_for[1]}'s, and this rank's engine would be {self.share[0]} of {self.share[1]}: "
                        "resume with the nodes, ranks per node and engines per node of the interrupted run")

    def _start_process(self, engine_args: EngineArgs, source: vllm_generator.RolloutSource, seed: int,
                       state: outputs.OnlineTrainerState):
        """The leader's generator process (vllm_generator.generate_ahead, or inflight.generate_inflight), where
        vllm_placement places it, with what crosses processes of `source`; stopped when the trainer exits, however
        it exits."""
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        engine_ranks = torch.distributed.get_world_size(self.engine_group)
        node_engine = (rank % vllm_placement.ranks_per_node(world_size, os.environ)) // engine_ranks  # in the node
        self.placement = vllm_placement.engine_placement(engine_args, world_size, node_engine)
        if self.placement.weights_over_nccl:  # the group's rendezvous, on a free port; the group itself once the
            self.store = torch.distributed.TCPStore(  # engine has started
                "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.asynchronous.generator_timeout))
        context = multiprocessing.get_context("spawn")
        # the engine samples a batch when the trainer asks for it; in flight, makes a snapshot
        requests = context.Queue() if self.placement.takes_turns or self.asynchronous.inflight_updates else None
        self.channels = vllm_generator.Channels(context.Queue(), context.Queue(), context.Queue(), requests,
                                                self.store.port if self.store else 0)
        evaluated = self.due if self.in_engine and self.share[0] == 0 else []
        job = vllm_generator.GeneratorJob(
            asynchronous=self.asynchronous, engine_args=engine_args, source=source.portable(bool(evaluated)),
            seed=seed, save_every=self.save_every, placement=self.placement, share=self.share,
            updates=range(state.update + len(self.sampled_ahead) + 1, self.num_updates + 1),
            first_version=state.update, channels=self.channels, snapshot=state.engine_snapshot, evaluated=evaluated)
        # looked up now: a test may have put a faulty one in its place
        target = inflight.generate_inflight if self.asynchronous.inflight_updates else vllm_generator.generate_ahead
        self.process = vllm_placement.start_generator(self.placement, target, (job,))
        atexit.register(self.stop)  # however the trainer exits
        common.STOP_BEFORE_FAILING.append(self.stop)

    def _receive(self, timeout: float, timeout_error: str):
        """The process's next message; stops within a second when it has failed or died, and with
        `timeout_error` after `timeout` seconds."""
        deadline = time.time() + timeout
        while True:
            alive = self.process.is_alive()  # before reading, so that what it sent before it ended is read first
            try:
                return self.channels.messages.get(timeout=0.5)
            except queue.Empty:
                if not alive:
                    common.fail(ENGINE_DIED)
                if time.time() > deadline:
                    common.fail(timeout_error)

    def _take(self, message) -> Batch | None:
        """A message from the process: a batch as tensors; an evaluation, a snapshot or the engine's start kept
        (None); a failure stops the run with the process's error."""
        return self.TAKES[type(message)](self, message)

    def _take_batch(self, batch: Batch) -> Batch:
        return batch.as_tensors()

    def _take_evaluation(self, arrived: vllm_generator.Evaluation):
        self.arrived[arrived.version] = arrived

    def _take_snapshot(self, snapshot: vllm_generator.Snapshot):
        self.snapshots[snapshot.checkpoint] = snapshot.state

    def _take_start(self, started: vllm_generator.EngineStarted):
        self.engine_started = True

    def _take_failure(self, failure: vllm_generator.Failure):
        common.fail(f"generation failed: {failure.text}")

    TAKES = {Batch: _take_batch, vllm_generator.Evaluation: _take_evaluation, vllm_generator.Snapshot: _take_snapshot,
             vllm_generator.EngineStarted: _take_start, vllm_generator.Failure: _take_failure}

    def _next_batch(self) -> Batch:
        """The next whole batch from the process (asked for first, when the engine shares the trainer's
        device), its arrays as tensors; the snapshots that come first are kept."""
        if self.placement.takes_turns:
            if torch.cuda.is_available():  # the engine wakes on this GPU: the memory the trainer's cache holds
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            self.requested += 1
            self.channels.requests.put(self.requested)
        while (batch := self._next_message()) is None:
            pass
        return batch

    def _next_message(self) -> Batch | None:
        """The process's next message taken (_take): a batch, its arrays as tensors, or None."""
        timeout = self.asynchronous.generator_timeout
        return self._take(self._receive(timeout, f"no batch from the generator within --generator_timeout "
                                                 f"{timeout:g} s"))

    def wait_for_engine(self):
        """Wait until the engine has started (it loads the model and warms up while the trainer sets up and
        makes its first evaluation; on the trainer's own device, before that evaluation: see __init__)."""
        if self.leader and not self.engine_started:
            timeout = self.asynchronous.engine_start_timeout
            self._take(self._receive(timeout, f"the vLLM engine did not start within --engine_start_timeout "
                                              f"{timeout:g} s"))
            if self.placement.weights_over_nccl:
                self.channels.published.put(weight_transport.CONNECTING)  # the generator process builds its end now
                self.channel = weight_transport.connect_weight_channel(self.store, self.process,
                                                                       self.asynchronous.generator_timeout)

    def batch_for(self, update: int) -> Batch:
        """This rank's share of the batch sampled for `update` (vllm_generator.Batch, its arrays tensors)."""
        shares = None
        if self.leader:
            batch = self.sampled_ahead.popleft() if self.sampled_ahead else self._next_batch()
            assert batch.update == update
            rows = self.prompts_per_rank * self.num_samples
            shares = [batch.rows(r * rows, (r + 1) * rows, self.num_samples)
                      for r in range(torch.distributed.get_world_size(self.engine_group))]
        received = [None]
        torch.distributed.scatter_object_list(received, shares, group=self.engine_group, group_src=0)
        return received[0]

    def evaluations(self, update: int, wait: bool) -> list[tuple[int, tuple | None]]:
        """The evaluations due by `update` (every rank calls it, once the weights of `update` are published), as
        (update evaluated, what the engine made of it): in the trainer, this update's if it is due, to be made by
        the trainer (None); in the engine, those it has handed over by now (all of those up to `update`, waited
        for, when `wait`: before a checkpoint, and at the end): each rank's rows of its completions, what
        evaluation.evaluate takes as `generated`, or for episodes the evaluation's metrics."""
        due = [version for version in self.due if version <= update]
        if not self.in_engine:
            self.due = self.due[len(due):]
            return [(version, None) for version in due]
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if rank == 0 and self.engine_started:  # the leader of engine 0, the one that evaluates
            with contextlib.suppress(queue.Empty):
                while True:  # what the process has sent by now, without waiting
                    if (batch := self._take(self.channels.messages.get_nowait())) is not None:
                        self.sampled_ahead.append(batch)
            while wait and any(version not in self.arrived for version in due):
                if (batch := self._next_message()) is not None:
                    self.sampled_ahead.append(batch)
        ready = [sorted(version for version in self.arrived if version <= update)]
        torch.distributed.broadcast_object_list(ready, src=0)
        evaluations = []
        for version in ready[0]:
            shares = None
            if rank == 0:
                arrived = self.arrived.pop(version)
                shares = [arrived.rows(r, world_size) for r in range(world_size)]
            received = [None]
            torch.distributed.scatter_object_list(received, shares, src=0)
            evaluations.append((version, received[0]))
        self.due = [version for version in self.due if version not in ready[0]]
        return evaluations

    def publish_weights(self, policy, version: int, part: str | None = None):
        """Hand the weights of `policy` (its DeepSpeed engine) after update `version` to the vLLM engine,
        announced by version number: one memory copy into a shared buffer, or over NCCL to an engine on a GPU of
        its own; bucket by bucket (every rank calls it: under ZeRO-3 a rank gathers one bucket at a time).
        `part`: the policy's attribute name when the DeepSpeed engine trains more than the policy (PPO)."""
        past_batches = version > sampling_version(self.num_updates, self.asynchronous.async_steps)
        if past_batches and version not in self.engine_versions:
            return  # no batch samples with these weights, nor does the engine evaluate them (it may have ended)
        # past its last batch only engine 0 takes weights, to evaluate them: another may have ended (under ZeRO-3
        # its ranks still gather each bucket with the others)
        sends = self.leader and not (past_batches and self.share[0] != 0)
        model = policy.module if part is None else getattr(policy.module, part)
        weights = lora.merged_weights(model)  # the order the receiver expects; a LoRA adapter merged in
        first = weights[0][1][0]
        sizes = [getattr(made_of[0], "ds_numel", made_of[0].numel()) for _, made_of, _ in weights]  # ZeRO-3: whole
        offsets = [0, *itertools.accumulate(sizes)]  # in the flat weights
        shared = None
        if sends and self.placement.weights_over_nccl:
            self.channels.published.put((version, None))  # the buckets follow
        elif sends:
            shared = self._free_shared_weights(offsets[-1], first.dtype, version)
        for bucket in weight_transport.weight_buckets(sizes, first.element_size()):
            with common.gathered(policy, [p for i in bucket for p in weights[i][1]]):
                if shared is not None:
                    for i in bucket:
                        shared.flat[offsets[i]:offsets[i + 1]].copy_(weights[i][2]().reshape(-1))
                elif sends:
                    self._send(torch.cat([weights[i][2]().reshape(-1) for i in bucket]), version)
        if shared is not None:
            self.channels.published.put((version, shared.handle))

    def _free_shared_weights(self, numel: int, dtype: torch.dtype, version: int) -> weight_transport.SharedWeights:
        """A shared buffer the generator is not reading: a new one while there are fewer than two (the trainer
        writes one while the generator reads the other), then the one it handed back, waited for."""
        deadline = time.time() + self.asynchronous.generator_timeout
        while not self.free_shared:
            if len(self.shared) < 2:
                weights = weight_transport.SharedWeights(numel, dtype)
                self.shared[weights.handle] = weights
                return weights
            if not self.process.is_alive() or time.time() > deadline:
                self._fail_sending(version)
            with contextlib.suppress(queue.Empty):
                self.free_shared.append(self.channels.released.get(timeout=0.1))
        return self.shared[self.free_shared.pop(0)]

    def _send(self, flat: torch.Tensor, version: int):
        """Broadcast one bucket, watching the process: a send to a process that died, failed or hangs stops the
        run with the kit's error, not with the channel's (NCCL's watchdog would abort the trainer)."""
        work = self.channel.broadcast([flat], torch.distributed.BroadcastOptions())
        deadline = time.time() + self.asynchronous.generator_timeout
        while not work.is_completed() and self.process.is_alive() and time.time() < deadline:
            time.sleep(0.001)
        if work.is_completed():
            try:
                work.wait()  # rethrows the send's error (NCCL's work objects have no is_success)
                return
            except RuntimeError:
                pass
        self.channel.abort()  # nothing more goes over it, and nothing waits for it at exit
        self._fail_sending(version)

    def _fail_sending(self, version: int):
        """Stop with the process's own error, or its death, which say more than a failed send."""
        message = (f"sending the weights of update {version} to the vLLM engine failed or took longer than "
                   f"--generator_timeout {self.asynchronous.generator_timeout:g} s")
        while True:  # past the batches it sampled ahead: _receive fails with its error, its death, or this
            self._receive(2.0, message)

    def checkpoint_state(self, update: int) -> tuple[list[Batch], dict | None]:
        """What a checkpoint after `update` saves (each leader's in its rank's state) so that a resumed run
        trains on exactly these samples: the batches for the updates after it that the process samples with
        weights older than update's (min(K, updates left)), waited for; with --inflight_updates, those it
        finished before its snapshot, and the snapshot (inflight.py). Its engine's share on a leader; empty
        on the other ranks."""
        if not self.leader:
            return [], None
        if not self.asynchronous.inflight_updates:
            older = [later for later in range(update + 1, self.num_updates + 1)
                     if sampling_version(later, self.asynchronous.async_steps) < update]
            while len(self.sampled_ahead) < len(older):
                self.sampled_ahead.append(self._next_batch())
            return list(self.sampled_ahead), None
        if update not in self.snapshots and not vllm_generator.proactive_snapshot(
                self.asynchronous, self.save_every, update, self.num_updates):
            self.channels.requests.put(update)
        while update not in self.snapshots:
            if (batch := self._next_message()) is not None:
                self.sampled_ahead.append(batch)
        snapshot = self.snapshots.pop(update)
        return [batch for batch in self.sampled_ahead if batch.update < snapshot["update"]], snapshot

    def stop(self):
        """Stop the process (SIGKILL: it ignores the preemption signals, and holds nothing that needs
        saving)."""
        if self.process is not None:
            self.process.kill()  # nothing happens if it has ended by itself, after the run's last batch
            self.process.join()
            self.process = None
