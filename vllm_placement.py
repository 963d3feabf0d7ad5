"""Where the asynchronous scripts' vLLM engines run, and the engine itself: the flags of the engine
(EngineArgs), its placement on its own cores or GPU or on the trainer's device ("shared"), decided once with what
follows from it (the generator process's environment and cores, whether engine and trainer take turns, how the
weights travel), the start of the generator process there, and the start of the engine in it (start_vllm).
Nothing here imports vLLM until an engine starts."""

import contextlib
import math
import multiprocessing
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

import torch

import common


@dataclass
class EngineSettings(common.FlagGroup):
    """The vLLM engine's own settings: its memory and CUDA graphs"""

    vllm_cpu_kv_cache_gib: int = 1
    """CPU only: GiB of RAM reserved for the engine's KV cache"""
    vllm_gpu_memory_utilization: float | None = None
    """GPU only: share of the engine's GPU memory vLLM may take (weights, activations, KV cache); default: on a
    GPU of its own, all that stays free beside what the generator process holds there (the copy of the policy
    that checks async/logprob_diff, the K+1 weight versions it may receive before loading them, NCCL's
    buffers), rounded down; 0.3 on a GPU it shares, the rest left to the trainer (--vllm_device shared, where
    the engine frees its memory while the trainer trains) or to eval_checkpoints.py's HF models. Checked
    against the GPU's free memory before the engine starts"""
    vllm_enforce_eager: bool = False
    """GPU only: run the engine without CUDA graphs (less memory and a shorter start, slower sampling); an
    engine on a CPU always runs eagerly"""

    def gpu_memory_utilization(self, shares_gpu: bool) -> float | None:
        """--vllm_gpu_memory_utilization, or its default: 0.3 on a GPU the engine shares with a trainer or HF
        models (they need the rest), else None (engine_memory_share: all that stays free)."""
        return self.vllm_gpu_memory_utilization or (0.3 if shares_gpu else None)

    def check(self):
        if self.vllm_gpu_memory_utilization is not None and not 0 < self.vllm_gpu_memory_utilization <= 1:
            common.fail(f"--vllm_gpu_memory_utilization is a share of the GPU's memory, in (0, 1], got "
                        f"{self.vllm_gpu_memory_utilization}")


@dataclass
class EngineArgs(EngineSettings):
    """The vLLM engine: where it runs, and its memory"""

    vllm_device: str | None = None
    """device of the vLLM engine: "cpu" (its own cores), "cuda:<i>", or "shared": the single training rank's
    own device (its GPU, or all its cores), engine and trainer taking turns; default: the GPU after this
    node's training GPUs, else cpu. <i> counts the GPUs the ranks see (through an inherited
    CUDA_VISIBLE_DEVICES: under SLURM's "4,5,6,7", cuda:3 is GPU 7); under deepspeed --num_gpus/--include,
    which shows each rank only the training GPUs, it is a physical GPU id"""
    vllm_engines_per_node: int = 1
    """engines on each node, each sampling for an equal share of the node's training ranks (e.g. 6 training GPUs
    and 2 engines: 3 ranks each) on the GPUs after the training ones (from --vllm_device's); on a CPU they share
    the --vllm_cpu_threads cores"""
    vllm_cpu_threads: int = 1
    """CPU only: cores given to the engine (the last ones); the trainer keeps the rest"""


IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in its process: no further processes, no polling


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


def ranks_per_engine(engines_per_node: int, world_size: int, environment: Mapping[str, str]) -> int:
    """The training ranks each engine samples for: --vllm_engines_per_node engines share a node's ranks."""
    node_ranks = ranks_per_node(world_size, environment)
    if engines_per_node < 1 or node_ranks % engines_per_node:
        common.fail(f"--vllm_engines_per_node {engines_per_node} does not divide the {node_ranks} training "
                    f"ranks of a node into equal shares")
    return node_ranks // engines_per_node


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


def shared_device_environment(kv_cache_gib: int) -> dict[str, str]:
    """The environment of an engine in this process, on this process's device (--vllm_device shared; an
    evaluation's engine): on a GPU the GPU it sees, on a CPU all its cores and `kv_cache_gib` GiB of KV cache."""
    cores = sorted(os.sched_getaffinity(0))
    return {**IN_PROCESS, **({} if torch.cuda.is_available() else cpu_engine_environment(cores, kv_cache_gib))}


def engine_placement(engine_args: EngineArgs, world_size: int, engine: int = 0) -> Placement:
    """Where this node's `engine`-th engine runs. GPU: it sees only its own GPU (engine_gpu: by default the
    engine-th after the node's training GPUs). CPU: it runs on the last `--vllm_cpu_threads` cores (which a
    node's engines share) and the trainer keeps the others. "shared" (one training rank per node): the
    engine on the trainer's own device, its GPU or all its cores."""
    device = engine_args.vllm_device or ("cpu" if not torch.cuda.is_available() else "cuda")
    environment = dict(IN_PROCESS)  # the engine runs inside the generator process
    cores = engine_cores = trainer_cores = sorted(os.sched_getaffinity(0))
    if device == "shared":
        if ranks_per_node(world_size, os.environ) != 1:
            common.fail(f"--vllm_device shared puts the engine on the device of a single training rank per node, "
                        f"not {ranks_per_node(world_size, os.environ)}")
        # on a GPU it sees the trainer's GPUs, and takes the first, as the trainer
        environment = shared_device_environment(engine_args.vllm_cpu_kv_cache_gib)
    elif device == "cpu":
        if torch.cuda.is_available():  # the GPU build of vLLM has no CPU backend (its platform detection fails)
            common.fail("--vllm_device cpu needs vLLM's CPU build (vllm-cpu), and this is a GPU node with the GPU "
                        "build: use cuda:<index> or shared")
        if not 0 < engine_args.vllm_cpu_threads < len(cores):
            common.fail(f"--vllm_cpu_threads {engine_args.vllm_cpu_threads} must leave the trainer at least one of "
                        f"the {len(cores)} cores")
        engine_cores, trainer_cores = cores[-engine_args.vllm_cpu_threads:], cores[:-engine_args.vllm_cpu_threads]
        environment.update(cpu_engine_environment(engine_cores, engine_args.vllm_cpu_kv_cache_gib))
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
    utilization = engine_args.gpu_memory_utilization(shares_gpu=device == "shared")
    return Placement(device, environment, engine_cores, trainer_cores, utilization)


def check_placement(engine_args: EngineArgs, world_size: int):
    """Where the engines would run, checked before anything is written (a bad --vllm_device,
    --vllm_cpu_threads or --vllm_engines_per_node fails here)."""
    ranks_per_engine(engine_args.vllm_engines_per_node, world_size, os.environ)
    for engine in range(engine_args.vllm_engines_per_node):
        engine_placement(engine_args, world_size, engine)


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


def engine_options(enforce_eager: bool, stepwise: bool, on_gpu: bool) -> dict:
    """The vLLM engine's options that differ between a GPU and a CPU. `stepwise`: driven step by step, taking
    weights between two steps (--inflight_updates)."""
    if on_gpu:  # CUDA graphs unless --vllm_enforce_eager; vLLM's default chunked prefill
        # in flight, each step's tokens come from the weights loaded before it: no step scheduled ahead
        return {"enforce_eager": enforce_eager, **({"async_scheduling": False} if stepwise else {})}
    # whole prompts per engine step: a prompt split across steps rewinds its seeded generator, which vLLM 0.32
    # cannot do on a CPU ("CPU Generator does not use offset"); no CUDA graphs; the KV cache's size is
    # VLLM_CPU_KVCACHE_SPACE (set by the placement), which overrides gpu_memory_utilization
    return {"enforce_eager": True, "enable_chunked_prefill": False}


def start_vllm(model_path: str, bf16: bool, seed: int, max_model_len: int, enforce_eager: bool,
               gpu_memory_utilization: float | None, sleep_mode: bool = False, reserved_bytes: int = 0,
               stepwise: bool = False):
    """A vLLM engine for the policy at `model_path`, in this process (the generator process, placed on the
    engine's device by the environment of its Placement), which on a GPU may take `gpu_memory_utilization` of
    its memory (engine_memory_share; None: what stays free beside the `reserved_bytes` this process will still
    allocate); with `sleep_mode`, one that can free it (LLM.sleep, GPU only); `stepwise`: see engine_options."""
    from vllm import LLM

    options = engine_options(enforce_eager, stepwise, torch.cuda.is_available())
    if torch.cuda.is_available():  # checked here: vLLM's own error would not name the flag
        options["gpu_memory_utilization"] = engine_memory_share(gpu_memory_utilization, *torch.cuda.mem_get_info(),
                                                                reserved_bytes)
    return LLM(model=model_path, dtype="bfloat16" if bf16 else "float32", seed=seed, max_model_len=max_model_len,
               enable_sleep_mode=sleep_mode,
               logprobs_mode="processed_logprobs",  # after temperature and top_p, as the trainer computes them
               **options)
