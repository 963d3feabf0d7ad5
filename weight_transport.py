"""How the policy's weights reach a vLLM engine, announced by version number: in one memory copy into a
buffer the trainer and its generator process both map (SharedWeights), or over NCCL between two GPUs, bucket by
bucket (the trainer's side is async_generator.AsyncGenerator.publish_weights); the generator process receives
them (WeightReceiver), loads them into the engine (load_engine_weights) and checks that the engine holds them
(check_engine_holds)."""

import datetime
import multiprocessing
import os
import time

import torch

import common

WEIGHT_BUCKET_BYTES = 256 * 2**20  # one send: the most a ZeRO-3 rank gathers at once, and the size of a message


def weight_buckets(sizes: list[int], element_bytes: int) -> list[range]:
    """Consecutive parameter indices grouped into buckets of at most WEIGHT_BUCKET_BYTES (a larger
    parameter alone): sender and receiver agree on them from the parameter sizes alone."""
    buckets, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and (total + size) * element_bytes > WEIGHT_BUCKET_BYTES:
            buckets.append(range(start, index))
            start, total = index, 0
        total += size
    return [*buckets, range(start, len(sizes))]


def weight_channel(store, rank: int, timeout_seconds: float):
    """The NCCL group of two that carries the weights between two GPUs: the leader (rank 0, whose TCP store
    `store` is) and its generator process (rank 1). Each end watches its operations for `timeout_seconds`
    (AsyncGenerator._send, broadcast_bucket) and stops with the kit's error; the group's own timeout, a minute
    later, never comes first (NCCL's watchdog would abort the process). Connected here, which blocks until the
    other end connects: left to itself NCCL connects inside the first send, where a dead peer hangs it."""
    options = torch.distributed.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=timeout_seconds + 60)
    channel = torch.distributed.ProcessGroupNCCL(store, rank, 2, options)
    channel.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    return channel


def connect_weight_channel(store, process, timeout_seconds: float):
    """The leader's end of the weight channel (weight_channel), connected in a thread while this one watches
    the generator `process`: one that died, or has not connected within `timeout_seconds`, is a one-line error,
    not a hang (the thread, blocked in NCCL, ends with the process)."""
    import threading

    connected = {}

    def connect():
        try:
            connected["channel"] = weight_channel(store, 0, timeout_seconds)
        except Exception as error:
            connected["error"] = " ".join(str(error).split())[:300]

    thread = threading.Thread(target=connect, daemon=True, name="weight channel")
    thread.start()
    deadline = time.time() + timeout_seconds
    while thread.is_alive() and process.is_alive() and time.time() < deadline:
        thread.join(timeout=0.1)
    if "channel" in connected:
        return connected["channel"]
    why = connected.get("error") or ("the vLLM engine process died" if not process.is_alive() else
                                     f"it did not connect within --generator_timeout {timeout_seconds:g} s")
    common.fail(f"connecting the weight channel to the vLLM engine process failed: {why}")


class SharedWeights:
    """A buffer of the policy's flat weights that the trainer and its generator process both map, in
    anonymous memory (memfd: not /dev/shm, which containers often cap at 64 MB). The trainer copies a
    version in (one memory copy: all it waits for), the generator copies it out into its policy and hands
    the buffer back. `handle` opens it in the other process."""

    def __init__(self, numel: int, dtype: torch.dtype, handle: tuple | None = None):
        import mmap

        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        trainer = handle is None
        if trainer:
            fd = os.memfd_create("async-rlhf-weights")
            os.ftruncate(fd, nbytes)
            handle = (os.getpid(), fd, numel, dtype)
        else:  # the generator opens the trainer's, through /proc
            pid, trainer_fd, _, _ = handle
            fd = os.open(f"/proc/{pid}/fd/{trainer_fd}", os.O_RDWR)
        self.handle, self.memory = handle, mmap.mmap(fd, nbytes)
        if not trainer:  # the mapping keeps the memory; the trainer's descriptor must stay open
            os.close(fd)
        self.flat = torch.frombuffer(self.memory, dtype=dtype, count=numel)  # (numel,)
        if trainer and torch.cuda.is_available():  # pinned: the copy from the trainer's GPU runs at full speed
            torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), nbytes, 0)


def broadcast_bucket(channel, flat: torch.Tensor, timeout: float):
    """The generator's end of a send: the leader's `flat` into this `flat` (the same size and dtype), waited
    for at most `timeout` seconds."""
    channel.broadcast([flat], torch.distributed.BroadcastOptions()).wait(datetime.timedelta(seconds=timeout))


def load_engine_weights(llm, model, in_flight: bool = False):
    """The engine takes the weights of `model` (the policy's HF model in this process) from memory.
    The worker's `reload_weights` re-runs the CPU backend's weight repacking, which per-parameter
    `load_weights` skips (it breaks on CPU); the state dict names tied weights twice, as a checkpoint does.
    The prefix cache goes with the old weights: vLLM keeps the KV of every full block of the prompts it
    has seen, and would continue a prompt seen before from KV computed with the old weights. `in_flight`:
    requests are running, whose KV stays; the caller salts later prompts with the version instead."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(model.state_dict().items())})
    if not in_flight and not llm.reset_prefix_cache():
        raise RuntimeError("the engine did not clear its prefix cache after a weight load (requests in flight)")


def engine_parameters(worker) -> dict[str, torch.Tensor]:
    """The engine's weights by name, as its model holds them (run in its worker, in this process, by
    LLM.collective_rpc)."""
    return dict(worker.model_runner.get_model().named_parameters())


def holds_as_is(engine_tensor: torch.Tensor, own_tensor: torch.Tensor) -> bool:
    """Whether the engine's tensor holds `own_tensor` bit for bit (in its first rows: vLLM may pad a
    vocabulary)."""
    return (engine_tensor.shape[1:] == own_tensor.shape[1:] and len(engine_tensor) >= len(own_tensor) > 0
            and torch.equal(engine_tensor[:len(own_tensor)].to(own_tensor.device), own_tensor.detach()))


def one_to_one_tensors(llm, model) -> list[tuple[str, str]]:
    """(engine name, `model` name) of the weights the engine holds exactly as `model` does: where vLLM keeps a
    tensor as the checkpoint has it (embeddings, whose rows it may pad, and norms, on every architecture;
    on a GPU most others too), not fused (q, k, v) nor repacked for its CPU kernels. Found by value, when
    both hold the same weights (at the start), so that no architecture's naming or layout can make the
    check of each load below fail when the load took."""
    engine, own = llm.collective_rpc(engine_parameters)[0], dict(model.named_parameters())
    pairs = []
    for engine_name, engine_tensor in engine.items():
        for own_name, own_tensor in own.items():
            same_name = engine_name == own_name or engine_name.endswith("." + own_name) or own_name.endswith(
                "." + engine_name)
            if same_name and holds_as_is(engine_tensor, own_tensor):
                pairs.append((engine_name, own_name))
    return pairs


def check_engine_holds(llm, model, pairs: list[tuple[str, str]], version: int):
    """The exact check that the engine took version `version`, which `model` holds: each of its one-to-one
    tensors (one_to_one_tensors) equals `model`'s, bit for bit. A reload that kept the old weights fails it
    whatever the dtype; what it cannot see (fused and repacked layers, so on a CPU every layer a LoRA adapter
    changes) async/logprob_diff checks."""
    engine, own = llm.collective_rpc(engine_parameters)[0], dict(model.named_parameters())
    differ = [own_name for engine_name, own_name in pairs if not holds_as_is(engine[engine_name], own[own_name])]
    if differ:
        raise RuntimeError(f"after loading the weights of update {version}, the engine's {differ[0]} (and "
                           f"{len(differ) - 1} more of the {len(pairs)} tensors checked) differ from the weights sent: "
                           "the engine did not take the new weights")


CONNECTING = "connecting"  # the trainer's first message on the queue of weight versions, over NCCL


class WeightReceiver:
    """The generator process's end of the weights: a thread takes each version the trainer announces,
    while the engine samples: a SharedWeights buffer it maps, or over NCCL into buffers of its own (one
    set per version not yet loaded: K at most); `load` puts one into the sampling policy, then into the
    engine, and hands a shared buffer back to the trainer (on the queue `released`)."""

    def __init__(self, timeout_seconds: float, port: int, sampling_policy, published, released):
        """`timeout_seconds`: --generator_timeout, how long a send over NCCL may take."""
        import threading

        self.timeout, self.sampling_policy, self.released = timeout_seconds, sampling_policy, released
        self.parameters = [p for _, p in sampling_policy.named_parameters()]  # the trainer sends in this order
        self.buckets = weight_buckets([p.numel() for p in self.parameters], self.parameters[0].element_size())
        self.received, self.error, self.condition = {}, None, threading.Condition()
        threading.Thread(target=self._receive, args=(port, published), daemon=True, name="weight receiver").start()

    def _receive(self, port: int, published):
        try:
            channel, shared = None, {}  # the NCCL group; the trainer's shared buffers by handle
            while True:
                message = published.get()
                if message == CONNECTING:
                    # The trainer connects once it has seen the engine start and has made its first
                    # evaluation, minutes later on a large policy: both ends then build the group at once.
                    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False,
                                                       timeout=datetime.timedelta(days=1))
                    channel = weight_channel(store, 1, self.timeout)
                    continue
                version, handle = message  # announced once the shared buffer is written, or before the buckets
                if handle is None:
                    flats = []
                    for bucket in self.buckets:
                        flat = torch.empty(sum(self.parameters[i].numel() for i in bucket),
                                           dtype=self.parameters[0].dtype, device="cuda")
                        broadcast_bucket(channel, flat, self.timeout)
                        flats.append(flat)
                else:
                    if handle not in shared:
                        shared[handle] = SharedWeights(handle[2], handle[3], handle)
                    sizes = [sum(self.parameters[i].numel() for i in bucket) for bucket in self.buckets]
                    flats = list(shared[handle].flat.split(sizes))
                with self.condition:
                    self.received[version] = (flats, handle)
                    self.condition.notify_all()
        except BaseException as error:
            with self.condition:
                self.error = error
                self.condition.notify_all()

    def wait_for(self, version: int, poll=None) -> bool:
        """Wait until `version` has arrived, calling `poll()` every 0.1 s meanwhile; False when the trainer is
        gone."""
        while True:
            with self.condition:
                if version in self.received:
                    return True
                if self.error is not None:
                    raise RuntimeError(f"receiving the weights of update {version} failed: {self.error}")
                if not multiprocessing.parent_process().is_alive():
                    return False
                self.condition.wait(timeout=0.1)
            if poll is not None:
                poll()

    def newest(self) -> int | None:
        """The newest version that has arrived and is not loaded yet, if any."""
        with self.condition:
            if self.error is not None:
                raise RuntimeError(f"receiving the weights failed: {self.error}")
            return max(self.received, default=None)

    @torch.no_grad()
    def load(self, version: int, llm, in_flight: bool = False):
        """Load the arrived `version` into the sampling policy, hand its shared buffer back (and those of older
        versions that arrived but are skipped), then load it into the engine (load_engine_weights)."""
        with self.condition:
            flats, handle = self.received.pop(version)
            skipped = [self.received.pop(older)[1] for older in sorted(self.received) if older < version]
        for bucket, flat in zip(self.buckets, flats):
            for index, values in zip(bucket, flat.split([self.parameters[i].numel() for i in bucket])):
                self.parameters[index].copy_(values.view_as(self.parameters[index]))
        for released in [handle, *skipped]:
            if released is not None:
                self.released.put(released)
        load_engine_weights(llm, self.sampling_policy, in_flight)
