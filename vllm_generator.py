"""The generator process of the asynchronous scripts (online_dpo_vllm.py, rloo_vllm.py, ppo_vllm.py,
grpo_vllm.py, grpo_multiturn_vllm.py): the vLLM engine that samples their batches, K updates ahead of the trainer.
Its flags (AsyncArgs), the staleness rule (sampling_version, staleness), the messages it sends the trainer (Batch,
Evaluation, ...), what it samples: a RolloutSource, one of two kinds, SamplePrompts (completions) or SampleEpisodes
(episodes of an environment, played through environments.EpisodeLoop), each owning its engine side (sampling a
batch, evaluating, checking the engine's log-probs, playing in flight); what a generator process is given
(GeneratorJob), and the process itself (generate_ahead: whole batches; inflight.generate_inflight takes new weights
between two decode steps). The
trainer's side of it is async_generator.AsyncGenerator; where it runs is vllm_placement's, how the weights reach
it weight_transport's. Nothing here imports vLLM until an engine starts.
"""

import contextlib
import dataclasses
import multiprocessing
import queue
import random
import time
from dataclasses import dataclass, field

import numpy
import torch

import common
import data
import evaluation
import vllm_placement
import weight_transport


@dataclass
class AsyncArgs(common.FlagGroup):
    """Asynchronous generation: how far the engine samples ahead, in-flight weight updates, the engine's
    checks and timeouts"""

    async_steps: int = 1
    """K: how many updates the sampling weights may lag behind the trained weights (0: synchronous)"""
    inflight_updates: bool = False
    """the engine takes each new weight version between two decode steps, keeping the KV of its requests in
    flight, instead of sampling whole batches K updates ahead: a batch is the next prompt groups to finish (with
    grpo_multiturn_vllm.py, groups of episodes, which go on across loads), each token records the version that
    sampled it (async/token_staleness_*); --async_steps K still bounds how far ahead the engine runs (README:
    In-flight weight updates)"""
    inflight_batches: int = 1
    """with --inflight_updates: how many batches' worth of prompt groups the engine keeps in flight. More than 1:
    a batch, the first groups to finish, waits less for the slowest ones (long-tailed episodes), at the cost of
    staler tokens in the groups that finish late (async/token_staleness_*, async/groups_in_flight)"""
    inflight_deterministic: bool = False
    """with --inflight_updates: swap versions at fixed points (the version after update t-K once the batch of
    update t is finished, waiting for it if need be) instead of as soon as each arrives: repeatable, and a run
    killed and resumed from a --save_every checkpoint trains exactly as the uninterrupted one"""
    max_lag: int | None = None
    """with --inflight_updates: drop (and count, async/dropped_groups) each group with a token sampled more than
    this many versions before the weights that would train on it; another group takes its place (default: none
    dropped)"""
    logprob_check_every: int = 10
    """check async/logprob_diff on the batch of update 1 and of every this many updates after (1: every batch);
    a check costs the generator about as much as sampling its rows (time/logprob_check)"""
    logprob_check_rows: int = 16
    """rows of each checked batch (the first ones) that async/logprob_diff covers: the generator process
    recomputes their log-probs with the trainer's model code, on the engine's device"""
    max_logprob_diff: float | None = None
    """the most async/logprob_diff (per token) a checked batch right after a weight load may show, or the
    engine did not take the new weights and the run stops; default 1e-3, 0.1 with --bf16 (vLLM's and the
    trainer's bf16 kernels differ more)"""
    engine_start_timeout: float = 1800.0
    """seconds the trainer waits for the vLLM engine to start (it loads the model and warms up) before it
    stops with an error"""
    generator_timeout: float = 600.0
    """seconds the trainer waits for each batch, once the engine has started, before it stops with an error"""
    eval_in_trainer: bool = False
    """evaluate (--eval_every) in the trainer with HF generate, the trainer stopping for it, instead of in the
    engine between its batches (the weights of exactly the update evaluated, its numbers logged with that update
    some updates later: ALGORITHMS.md, "5. Evaluation"); always so with --inflight_updates and --vllm_device
    shared"""

    def check(self):
        if self.async_steps < 0:
            common.fail(f"--async_steps must be 0 (synchronous) or more, got {self.async_steps}")
        for name in ("engine_start_timeout", "generator_timeout"):
            if getattr(self, name) <= 0:
                common.fail(f"--{name} must be positive (seconds), got {getattr(self, name)}")
        if self.max_logprob_diff is not None and self.max_logprob_diff <= 0:
            common.fail(f"--max_logprob_diff must be positive, got {self.max_logprob_diff}")
        if self.logprob_check_every < 1:
            common.fail(f"--logprob_check_every must be at least 1 (1: every batch), got {self.logprob_check_every}")
        if self.logprob_check_rows < 1:
            common.fail(f"--logprob_check_rows must be at least 1 (async/logprob_diff needs a row), "
                        f"got {self.logprob_check_rows}")
        if self.inflight_batches < 1:
            common.fail(f"--inflight_batches must be at least 1 (a batch's worth of groups), got "
                        f"{self.inflight_batches}")
        if not self.inflight_updates:
            for name, off in (("inflight_deterministic", False), ("max_lag", None), ("inflight_batches", 1)):
                if getattr(self, name) != off:
                    common.fail(f"--{name} applies to --inflight_updates, which is off")
        elif self.max_lag is not None and self.max_lag < self.async_steps:
            common.fail(f"--max_lag must be at least --async_steps {self.async_steps} (the newest groups of a batch "
                        f"are that many versions behind), got {self.max_lag}")


# What a resumed run may change besides outputs.RESUME_MAY_CHANGE: timeouts, the log-prob check, and where the
# engines run (the samples do not depend on the engines, and a checkpoint's sampled-ahead batches must fit the
# new ones: AsyncGenerator checks it)
RESUME_MAY_CHANGE = ("engine_start_timeout", "generator_timeout", "logprob_check_every", "logprob_check_rows",
                     "vllm_device", "vllm_engines_per_node", "vllm_cpu_threads", "vllm_cpu_kv_cache_gib",
                     "vllm_gpu_memory_utilization", "vllm_enforce_eager")


def process_group_timeout(asynchronous: AsyncArgs) -> float:
    """Seconds a training rank may wait in a collective: a node's other ranks wait for its leader, which waits
    for the engine to start and then for its first batch. The kit's own timeouts, with their one-line
    errors, then end a run before the process group's does."""
    return asynchronous.engine_start_timeout + asynchronous.generator_timeout + 60


def sampling_version(update: int, async_steps: int, first_version: int = 0) -> int:
    """The staleness rule of "Asynchronous RLHF": the batch of update t is sampled with the weights after
    update t-1-K (K = --async_steps; version 0 is the starting policy), or with `first_version`, the weights
    a resumed run starts from, when those are later. K=0 is synchronous; with K=1 every batch after the
    first is one update stale."""
    return max(update - 1 - async_steps, first_version)


def staleness(update: int, version):
    """How many updates the weights of `version` (an int, or a tensor of versions) lag behind those that train
    on them in `update`, the weights after update-1: sampling_version's K, measured."""
    return update - 1 - version


def max_logprob_diff(asynchronous: AsyncArgs, bf16: bool) -> float:
    """--max_logprob_diff, or its default for the dtype."""
    if asynchronous.max_logprob_diff is not None:
        return asynchronous.max_logprob_diff
    return 0.1 if bf16 else 1e-3


@dataclass
class Channels:
    """What a trainer and its generator process talk over."""

    published: object  # queue: the weight versions the trainer announces
    released: object  # queue: the shared buffers handed back once loaded
    messages: object  # queue: the process's messages (EngineStarted, Batch, Evaluation, Snapshot, Failure)
    # queue: the updates whose batch the trainer asks for (an engine on its device), or with --inflight_updates
    # whose checkpoint asks for the engine's snapshot
    requests: object | None
    weight_port: int  # the NCCL channel's rendezvous port (0: the weights come through shared memory)


# What a generator process sends its trainer on Channels.messages: EngineStarted first, then its batches and the
# evaluations between them, the snapshots a checkpoint asks for (--inflight_updates), or the Failure that stopped it.
@dataclass
class EngineStarted:
    """The engine has started: it loaded the model and warmed up."""


@dataclass
class Failure:
    """What stopped the process: the line the trainer stops with (failure_text)."""

    text: str


@dataclass
class Snapshot:
    """--inflight_updates: the engine's state for the checkpoint after update `checkpoint` (inflight.py), plain data a
    checkpoint keeps."""

    checkpoint: int
    state: dict


Array = numpy.ndarray | torch.Tensor  # numpy while a batch crosses processes, a tensor once received
PER_ROW = {"per_row": True}  # the metadata of a Batch field with a value per row: Batch.rows takes a share of it


@dataclass
class Batch:
    """What an engine hands the trainer for one update (each rank takes its share: AsyncGenerator.batch_for): N
    rows, each group's k adjacent, and how they were sampled. Its arrays are numpy while they cross processes
    (torch tensors would be shared, and vanish with the process that made them), tensors once received."""

    update: int
    prompt_indices: list[int]  # the train split's rows the groups start from, one per group
    queries: list[list[int]] = field(metadata=PER_ROW)  # (N,) each row's prompt (an episode's first message) as ids
    # (N, R) right-padded: a completion, or every token of an episode after its first message
    responses: Array = field(metadata=PER_ROW)
    # (N, R) the engine's log-probs of the policy's tokens, INVALID_LOGPROB elsewhere
    logprobs: Array = field(metadata=PER_ROW)
    metrics: dict[str, float] = field(default_factory=dict)  # the engine's: time/*, async/logprob_diff, ...
    version: int = 0  # the weights that sampled it (in flight: those of its oldest token)
    engine: tuple[int, int] = (0, 1)  # the engine that sampled it: (index, engines)
    data_position: int = 0  # the global batches drawn up to it
    scores: Array | None = field(default=None, metadata=PER_ROW)  # (N,) --dynamic_sampling: the rewards it chose by
    # (N, R) --inflight_updates: the version of each policy token, -1 elsewhere
    token_versions: Array | None = field(default=None, metadata=PER_ROW)
    # grpo_multiturn_vllm.py's episodes: each of environments.Episodes' values per episode, by name (N, ...) each
    # (Episodes.as_arrays, Episodes.from_batch)
    episodes: dict[str, Array] | None = None
    step_times: list[float] | None = None  # seconds each step of the whole batch took (every rank's share holds all)

    def rows(self, start: int, stop: int, group_size: int) -> "Batch":
        """Rows start..stop (whole groups of `group_size`) as a batch of their own."""
        share = {item.name: getattr(self, item.name)[start:stop] for item in dataclasses.fields(self)
                 if item.metadata.get("per_row") and getattr(self, item.name) is not None}
        episodes = self.episodes and {name: values[start:stop] for name, values in self.episodes.items()}
        return dataclasses.replace(self, prompt_indices=self.prompt_indices[start // group_size:stop // group_size],
                                   episodes=episodes, **share)

    def as_tensors(self) -> "Batch":
        """The batch with its numpy arrays as tensors (sharing their memory)."""
        tensor = lambda value: torch.from_numpy(value) if isinstance(value, numpy.ndarray) else value  # noqa: E731
        episodes = self.episodes and {name: tensor(values) for name, values in self.episodes.items()}
        return dataclasses.replace(self, episodes=episodes, **{
            item.name: tensor(getattr(self, item.name)) for item in dataclasses.fields(self)
            if item.metadata.get("per_row")})

    @classmethod
    def from_checkpoint(cls, saved: dict) -> "Batch":
        """A batch a checkpoint saved (outputs.save_checkpoint keeps its fields as a dict)."""
        return cls(**saved)


@dataclass
class GeneratorJob:
    """What one generator process samples (generate_ahead, inflight.generate_inflight), and how."""

    asynchronous: AsyncArgs
    engine_args: vllm_placement.EngineArgs
    source: "RolloutSource"  # what a batch is, and how the engine samples it
    seed: int
    save_every: int  # --save_every: with --inflight_deterministic, the versions the engine takes a snapshot at
    placement: vllm_placement.Placement
    share: tuple[int, int]  # (index, engines): this engine samples the index-th of `engines` equal shares of each batch
    updates: range  # the updates whose batches it samples
    first_version: int  # the weights the run starts from: 0, or a resumed run's checkpoint's update
    channels: Channels
    snapshot: dict | None = None  # --inflight_updates: the engine state a resumed run continues from
    evaluated: list[int] = field(default_factory=list)  # the updates whose weights it evaluates between its batches


@dataclass
class Evaluation:
    """What the engine hands the trainer for one evaluation of the weights of `version`: the near-greedy and the
    sampled completions of every evaluation prompt and the sampled ones' log-probs under those weights (the
    trainer's model code), each (prompts, response_length), numpy (evaluation.evaluate's `generated`); or, for
    episodes, the evaluation's metrics (SampleEpisodes.evaluate)."""

    version: int
    completions: tuple | None = None  # (greedy, sampled, sampled_logprobs)
    metrics: dict | None = None

    def rows(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | dict:
        """What rank `rank` of `world_size` takes: the rows it evaluates (evaluation.evaluate's), as tensors; or
        the metrics, over every row."""
        if self.metrics is not None:
            return self.metrics
        return tuple(torch.from_numpy(array[rank::world_size]) for array in self.completions)


@dataclass
class RolloutSource:
    """What an engine samples, and how: the one protocol of the two kinds of rollout, SamplePrompts (the single-turn
    scripts' completions) and SampleEpisodes (grpo_multiturn_vllm.py's episodes). A script builds its source and
    hands it to async_generator.AsyncGenerator; nothing outside the two kinds asks which one it holds."""

    policy_path: str  # the starting policy the engine loads
    bf16: bool
    generation: common.GenerationArgs  # how it samples
    sampler: data.PromptSampler  # the global batches' rows, from the first one not sampled yet
    num_samples: int  # k: completions or episodes per row
    eos_ids: list[int]
    pad_token_id: int
    eval_temperature: float  # --eval_temperature: the near-greedy sampling of the engine's evaluations

    def portable(self, evaluates: bool) -> "RolloutSource":
        """What crosses to the generator process (with the evaluation rows when its engine evaluates)."""
        raise NotImplementedError

    def max_model_len(self) -> int:
        """The engine's context length."""
        raise NotImplementedError

    def prepare(self, job: GeneratorJob, device):
        """In the generator process, once its engine has started: what sampling needs made there, once."""

    def sample(self, llm, sampling_policy, indices: list[int], update: int, job: GeneratorJob) -> Batch:
        """generate_ahead's batch of `update` from this engine's rows `indices` of the global batch."""
        raise NotImplementedError

    def evaluate(self, llm, sampling_policy, version: int, job: GeneratorJob) -> Evaluation:
        """The engine's evaluation of the weights of `version`, which it holds now (as `sampling_policy` does)."""
        raise NotImplementedError

    def logprob_diff(self, sampling_policy, batch: Batch, rows: list[int]) -> float:
        """async/logprob_diff: the mean |engine log-prob - trainer log-prob| per policy token of `batch`'s `rows`, the
        trainer's recomputed with `sampling_policy`, which holds the weights that sampled them."""
        raise NotImplementedError

    def in_flight(self, job: GeneratorJob, llm, receiver, sampling_policy, one_to_one):
        """--inflight_updates: what plays this kind in flight (inflight.InflightCompletions or InflightEpisodes)."""
        raise NotImplementedError


def sampling_params(generation: common.GenerationArgs, eos_ids, seed: int, max_tokens: int, delta: bool = False):
    """One completion's sampling: the sampled tokens' ids and log-probs only (as plain lists, the least
    output work in the engine's client), every step's new ones with `delta`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=generation.temperature, top_k=0, top_p=generation.top_p, max_tokens=max_tokens,
                          stop_token_ids=eos_ids, logprobs=0, seed=seed, detokenize=False, flat_logprobs=True,
                          output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE)


def vllm_sample(llm, prompts: list[list[int]], seeds: list[int], generation: common.GenerationArgs, eos_ids,
                max_tokens: list[int]) -> list[tuple[list[int], list[float]]]:
    """One completion of each prompt, of at most its `max_tokens`, with a per-row seed (reproducible however vLLM
    batches): its token ids (the stop token included, where it stopped) and the engine's log-probs of them at the
    sampling temperature and top_p."""
    from vllm.inputs import TokensPrompt

    params = [sampling_params(generation, eos_ids, seed, most) for seed, most in zip(seeds, max_tokens)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    # one log-prob per token (logprobs=0)
    return [(list(output.outputs[0].token_ids), list(output.outputs[0].logprobs.logprobs)) for output in outputs]


def vllm_generate(llm, prompts: list[list[int]], seeds: list[int], generation: common.GenerationArgs, eos_ids,
                  pad_token_id):
    """Sample one completion per prompt with a per-row seed (reproducible however vLLM batches).

    Returns responses (rows, response_len) right-padded, and the engine's log-probs of the sampled
    tokens at the sampling temperature and top_p (common.INVALID_LOGPROB at pads).
    """
    length = generation.response_length
    responses = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    logprobs = torch.full((len(prompts), length), common.INVALID_LOGPROB)
    for row, (tokens, token_logprobs) in enumerate(vllm_sample(llm, prompts, seeds, generation, eos_ids,
                                                               [length] * len(prompts))):
        responses[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logprobs[row, :len(tokens)] = torch.tensor(token_logprobs)
    return responses, logprobs


def row_seeds(seed: int, update: int, rows: range, sampling_round: int = 0) -> list[int]:
    """The sampling seeds of rows `rows` of the global batch of `update` (and of its further rounds of prompts,
    with --dynamic_sampling). They depend on (seed, update, round, row) alone: the samples do not depend on
    how vLLM batches them, on a resume, nor on how many engines share the batch."""
    rng = random.Random(seed * 1_000_003 + update if sampling_round == 0 else f"{seed}/{update}/{sampling_round}")
    return [rng.getrandbits(63) for _ in range(rows.stop)][rows.start:]


def logprob_checked(update: int, asynchronous: AsyncArgs) -> bool:
    """Whether the batch of `update` is checked (async/logprob_diff): that of update 1, then every
    --logprob_check_every updates."""
    return (update - 1) % asynchronous.logprob_check_every == 0


@torch.no_grad()
def check_logprobs(job: GeneratorJob, sampling_policy, batch: Batch, update: int, rows: list[int]) -> float | None:
    """On a checked batch (logprob_checked) with rows to check: async/logprob_diff over the first --logprob_check_rows
    of `rows` (the source's logprob_diff, against `sampling_policy`, an HF model that holds the weights the engine
    sampled them with) and its cost, time/logprob_check, into the batch's metrics; the difference, or None."""
    rows = rows[:job.asynchronous.logprob_check_rows]
    if not (logprob_checked(update, job.asynchronous) and rows):
        return None
    t0 = time.time()
    logprob_diff = job.source.logprob_diff(sampling_policy, batch, rows)
    batch.metrics.update({"async/logprob_diff": logprob_diff, "time/logprob_check": time.time() - t0})
    return logprob_diff


def evaluation_completions(llm, prompts: list[list[int]], seed: int, update: int, generation: common.GenerationArgs,
                           eval_temperature: float, eos_ids, pad_token_id) -> tuple[torch.Tensor, torch.Tensor]:
    """The near-greedy (--eval_temperature) and the sampled (the training's sampling) completions of every
    evaluation prompt by the weights `llm` holds, each row seeded by evaluation.engine_seeds: the _vllm scripts'
    engine and eval_checkpoints.py --vllm sample the same ones.  -> (prompts, response_length) each"""
    seeds = evaluation.engine_seeds(seed, update, len(prompts))
    near_greedy = dataclasses.replace(generation, temperature=eval_temperature, top_p=1.0)
    return tuple(vllm_generate(llm, prompts, seeds, sampling, eos_ids, pad_token_id)[0]
                 for sampling in (near_greedy, generation))


@torch.no_grad()
def evaluate_version(job: GeneratorJob, llm, sampling_policy, version: int):
    """The engine's evaluation of `version` (the weights it holds now, as the sampling policy does), handed to the
    trainer when `version` is one the run evaluates (the source's evaluate)."""
    if version in job.evaluated:
        job.channels.messages.put(job.source.evaluate(llm, sampling_policy, version, job))


def check_engine_took_weights(logprob_diff: float, version: int, job: GeneratorJob):
    """vLLM has had bugs where a reload kept serving the old weights: a checked batch right after a load
    must have the trainer's log-probs (async/logprob_diff, from the sampling policy, which holds the
    weights just sent) within --max_logprob_diff."""
    most = max_logprob_diff(job.asynchronous, job.source.bf16)
    if logprob_diff > most:
        raise RuntimeError(
            f"after loading the weights of update {version}, the engine's log-probs differ from the trainer's "
            f"by {logprob_diff:.3g} per token (async/logprob_diff), more than --max_logprob_diff {most:g}: the "
            "engine did not take the new weights")


def engine_share(indices: list[int], share: tuple[int, int]) -> list[int]:
    """The share of a global batch's prompts that engine `share` = (index, engines) samples."""
    index, engines = share
    return indices[index * len(indices) // engines:(index + 1) * len(indices) // engines]


def start_engine(job: GeneratorJob):
    """The generator process's engine (vllm_placement.start_vllm), the HF model that holds its sampling weights
    (for async/logprob_diff and each load), the tensors check_engine_holds compares one to one, and the weight
    receiver; the source prepared (RolloutSource.prepare)."""
    import threading

    import tqdm
    from transformers import AutoModelForCausalLM

    # the engine's progress bars without tqdm's multiprocessing lock, which the resource tracker would
    # report as leaked, after the trainer's error, when the trainer kills this process
    tqdm.tqdm.set_lock(threading.RLock())

    # the trainer's model code holding the sampling weights, for async/logprob_diff, on the engine's GPU of
    # its own (this process sees only that one); on the CPU beside an engine that shares the trainer's GPU,
    # which holds the trainer's models, pinned, so that the engine loads each version from it at full speed
    source = job.source
    sampling_policy = AutoModelForCausalLM.from_pretrained(
        source.policy_path, dtype=torch.bfloat16 if source.bf16 else torch.float32).eval()
    reserved = 0  # GPU memory this process allocates once the engine has started
    if torch.cuda.is_available() and not job.placement.takes_turns:
        sampling_policy.to("cuda")
        version_bytes = sum(p.numel() * p.element_size() for p in sampling_policy.parameters())
        # versions received, not loaded
        reserved = (job.asynchronous.async_steps + 1) * version_bytes + vllm_placement.NCCL_RESERVE_BYTES
    elif torch.cuda.is_available():
        for parameter in sampling_policy.parameters():
            parameter.data = parameter.data.pin_memory()
    llm = vllm_placement.start_vllm(source.policy_path, source.bf16, job.seed, source.max_model_len(),
                                    job.engine_args.vllm_enforce_eager, job.placement.gpu_memory_utilization,
                                    job.placement.sleeps_between_turns, reserved, job.asynchronous.inflight_updates)
    # vLLM runs some architectures (GPT-NeoX, i.e. Pythia, in vLLM 0.32) through its Transformers
    # backend, which decorates their HF classes in this process for torch.compile: an HF model of
    # that class can then only be made before the engine (as above), and must opt out of it
    for module in sampling_policy.modules():
        module.do_not_compile = True
    one_to_one = weight_transport.one_to_one_tensors(llm, sampling_policy)  # both hold the starting weights now
    receiver = weight_transport.WeightReceiver(job.asynchronous.generator_timeout, job.channels.weight_port,
                                               sampling_policy, job.channels.published, job.channels.released)
    source.prepare(job, sampling_policy.device)
    return llm, sampling_policy, one_to_one, receiver


def generate_ahead(job: GeneratorJob):
    """The generator process of engine `job.share` = (index, engines), beside the first of its ranks, which
    holds the vLLM engine: for update t it samples its ranks' share of the global batch, with exactly the
    weights sampling_version(t) names: job.source's batch (SamplePrompts' completions, SampleEpisodes' episodes).

    The trainer announces each weight version on the queue `published`, written to a shared buffer (handed
    back on `released` once loaded) or sent over NCCL (weight_transport.WeightReceiver); EngineStarted, then
    the batches and the evaluations between them (or the Failure that stopped this process) go to the queue
    `messages`. With `requests`
    (an engine sharing the trainer's device), batch t is sampled only once the trainer has asked for it there,
    so that the two take turns. It ends after the last batch, when the trainer kills it, or once the trainer
    is gone.
    """
    channels, async_steps = job.channels, job.asynchronous.async_steps
    try:
        llm, sampling_policy, one_to_one, receiver = start_engine(job)
        loaded = 0  # the engine starts with the SFT weights, version 0
        if job.placement.sleeps_between_turns:  # the trainer's GPU memory until it asks for a batch
            sleep_until(job.updates.start, llm, loaded, async_steps, job.first_version)
        channels.messages.put(EngineStarted())
        requested, evaluated = 0, None
        for update in job.updates:
            version = sampling_version(update, async_steps, job.first_version)
            if version != loaded and not receiver.wait_for(version):
                return  # no trainer: free the engine's device
            while channels.requests is not None and requested < update:
                if not multiprocessing.parent_process().is_alive():
                    return
                with contextlib.suppress(queue.Empty):
                    requested = channels.requests.get(timeout=0.1)
            t0 = time.time()
            if job.placement.sleeps_between_turns:
                llm.wake_up(tags=["weights"])
            if version != loaded:
                receiver.load(version, llm)
                weight_transport.check_engine_holds(llm, sampling_policy, one_to_one, version)
            if job.placement.sleeps_between_turns:
                llm.wake_up(tags=["kv_cache"])
            weight_load = time.time() - t0
            indices = engine_share(job.source.sampler.next_indices(), job.share)  # of the global batch's prompts
            batch = job.source.sample(llm, sampling_policy, indices, update, job)
            if version != loaded and "async/logprob_diff" in batch.metrics:  # and the layers it cannot see
                check_engine_took_weights(batch.metrics["async/logprob_diff"], version, job)
            loaded = version
            if job.placement.sleeps_between_turns:
                sleep_until(update + 1, llm, loaded, async_steps, job.first_version)
            batch.metrics["time/weight_load"] = weight_load
            channels.messages.put(dataclasses.replace(batch, engine=job.share, version=version,
                                                      data_position=job.source.sampler.position))  # batches drawn
            if version != evaluated:  # once the trainer has its batch
                evaluate_version(job, llm, sampling_policy, version)
                evaluated = version
        # the versions evaluated that no batch samples with: the last K + 1 updates'
        for version in job.evaluated:
            if version > loaded:
                if not receiver.wait_for(version):
                    return
                receiver.load(version, llm)
                weight_transport.check_engine_holds(llm, sampling_policy, one_to_one, version)
                evaluate_version(job, llm, sampling_policy, version)
                loaded = version
    except BaseException as error:  # any failure must reach the trainer, which stops with it
        channels.messages.put(Failure(failure_text(error)))


def failure_text(error: BaseException) -> str:
    """What the trainer says a generator process stopped with: common.fail's line as it is, else the exception."""
    if isinstance(error, SystemExit):
        return str(error.code).removeprefix("error: ")
    return f"{type(error).__name__}: {error}"


def sleep_until(update: int, llm, loaded: int, async_steps: int, first_version: int):
    """Free the engine's share of the trainer's GPU until the trainer asks for the batch of `update`: the KV cache
    always; the weights too (level 2) when that batch samples with another version than the `loaded` one,
    which the load overwrites anyway, else they wait in CPU memory (level 1)."""
    llm.sleep(level=2 if sampling_version(update, async_steps, first_version) != loaded else 1)


def swaps_with_snapshot(asynchronous: AsyncArgs, save_every: int, version: int) -> bool:
    """With --inflight_deterministic, whether the engine's swap to `version` takes a snapshot of its requests in
    flight for the checkpoint after update `version` (a --save_every one), and prefills them anew
    (inflight.generate_inflight)."""
    return asynchronous.inflight_deterministic and save_every > 0 and version % save_every == 0


def proactive_snapshot(asynchronous: AsyncArgs, save_every: int, update: int, num_updates: int) -> bool:
    """Whether the engine sends the snapshot of a checkpoint after `update` unasked (AsyncGenerator.checkpoint_state
    waits for it): at its swap to that version (swaps_with_snapshot), which it makes when a later batch samples
    with it."""
    return (swaps_with_snapshot(asynchronous, save_every, update)
            and update <= sampling_version(num_updates, asynchronous.async_steps))
