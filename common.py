"""What two or more of the kit's scripts do identically; the algorithms and their loops live in the scripts.

In the order a reader meets it (ALGORITHMS.md has the formulas):
- The flag groups read here: ranks and precision (DistributedArgs), the optimizer and batch
  (OptimizerArgs), generation (GenerationArgs).
- Preemption and distributed setup: ranks through DeepSpeed, seeds, dropout off, DeepSpeed engines,
  ZeRO-3 gathers, metric averaging over ranks, the batch arithmetic.
- The Task a run loads (data.py loads it).
- Rollout details: left padding, truncation after the stop token, temperature-scaled log-probs at the
  positions that predicted each token, the reward at the last real token, HF sampling, the Rollout of a
  batch, DAPO's dynamic sampling rule, the reward checks and the objective/* metrics. The scripts call
  these as named steps in their loops.

Elsewhere (README, "Map of the code"): outputs.py is what a run writes (its directory and args.json,
checkpoints and resume, the trained policy, metrics.jsonl, wandb, curves.png); cli.py parses the command line
(flags, --config files, the presets in configs/); data.py loads models, rewards and prompts; lora.py puts a
LoRA adapter on the policy; evaluation.py is the paper's evaluation; corrections.py the off-policy
corrections; environments.py the multi-turn scripts' environments; the asynchronous scripts' vLLM engine is
async_generator.py (the trainer's side), vllm_generator.py (the generator process), vllm_placement.py,
weight_transport.py and inflight.py (the synchronous scripts import none of them); math_reward.py is the GSM8k
reward.
"""

import atexit
import contextlib
import datetime
import functools
import gc
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

INVALID_LOGPROB = 1.0  # sentinel written at padded positions; masked out of every sum and mean


STOP_BEFORE_FAILING = []  # what must stop before an error ends the run: the generator process, whose
# shutdown would otherwise print after the error's line


def fail(message: str):
    """Stop with a one-line error (on every rank) and a non-zero exit; the last line the run prints."""
    for stop in STOP_BEFORE_FAILING:
        stop()
    raise SystemExit(f"error: {message}")


# ----------------------------------------------------------------------------------------------
# Flag groups read here (cli.py: each script's Args holds those it uses; flat names on the command line)
# ----------------------------------------------------------------------------------------------
class FlagGroup:
    """A group of flags several scripts share, declared once in the module that reads them; cli.parse calls
    each group's check() once the command line is parsed."""

    def check(self):
        """Stop with a one-line error for a bad value of this group's flags (none by default)."""


@dataclass
class DistributedArgs(FlagGroup):
    """Ranks and precision"""

    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage of the trained models (3 also partitions the frozen ones: reference, reward; 2 on a
    single rank runs as stage 0: nothing to partition)"""
    bf16: bool = False
    """train and generate in bfloat16 (GPU runs)"""
    local_rank: int = -1
    """set by the deepspeed launcher"""


@dataclass
class OptimizerArgs(FlagGroup):
    """Optimisation: micro-batches, optimizer steps, AdamW with a learning rate decaying linearly to 0"""

    per_device_train_batch_size: int = 16
    """prompts per micro-batch on each rank, each with its completions (PPO: one each); sft.py: examples,
    reward_model.py: pairs"""
    gradient_accumulation_steps: int = 4
    """micro-batches per optimizer step"""
    num_epochs: int = 1
    """passes over each generated batch, prompt order shuffled each time (the reference's num_ppo_epochs, TRL's
    num_iterations); sft.py and reward_model.py: over the train split"""
    learning_rate: float = 1e-4
    """peak learning rate, decayed linearly to 0 (the paper's 3e-6 is for 1B-parameter models)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (PPO: over policy and value model together)"""

    def check(self):
        check_signs(self, ("per_device_train_batch_size", "gradient_accumulation_steps", "num_epochs", "learning_rate"))


@dataclass
class RLOptimizerArgs(OptimizerArgs):
    """Optimisation: micro-batches, optimizer steps, AdamW with a learning rate decaying linearly to 0 (or constant)"""

    total_episodes: int = 4480
    """prompts to train on, over all ranks"""
    lr_scheduler_type: Literal["linear", "constant"] = "linear"
    """the learning rate over the run's optimizer steps: linear, from --learning_rate down to 0 at the last one;
    constant, --learning_rate throughout (a horizon's length then changes nothing before its end)"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over a generated batch; the i-th of the first epoch is i-1 updates off-policy"""

    def check(self):
        super().check()
        check_signs(self, ("total_episodes", "num_mini_batches"))


@dataclass
class GenerationArgs(FlagGroup):
    """Generation: how completions are sampled, and the reward of one that does not stop"""

    response_length: int = 12
    """new tokens sampled per completion"""
    temperature: float = 0.7
    """sampling temperature; log-probs everywhere use logits / (temperature + 1e-7)"""
    top_p: float = 1.0
    """nucleus sampling: sample from the most likely tokens whose probabilities sum to top_p; the policy's
    log-probs are those of that truncated distribution (the reference's are of its whole distribution)"""
    missing_eos_penalty: bool = True
    """give --penalty_reward_value instead of the score to a completion with no stop token"""
    penalty_reward_value: float = -1.0
    """reward given instead of the score to a completion with no stop token (with --missing_eos_penalty)"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / scoring forward pass"""

    def check(self):
        check_signs(self, ("response_length", "local_rollout_forward_batch_size"))
        if not 0 < self.top_p <= 1:
            fail(f"--top_p must be in (0, 1] (1: no nucleus truncation), got {self.top_p}")



# ----------------------------------------------------------------------------------------------
# Preemption
# ----------------------------------------------------------------------------------------------
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL, "try again": what a requeueing job script can check for
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what schedulers send before they kill a job
PREEMPTION_HELP = ("Preemption: on SIGTERM or SIGUSR1 a run finishes the update in progress (and its evaluation, "
                   "if due), writes a checkpoint (in the vLLM scripts with the batches the engine sampled ahead) "
                   f"and exits with code {PREEMPTED_EXIT_CODE}; run the same command with --resume to continue "
                   "exactly. The deepspeed launcher passes SIGTERM on to the ranks and kills them 30 s later: when "
                   "an update takes longer, signal the ranks themselves (SIGUSR1).")
RECEIVED = {}  # the first preemption signal this process received: its name and time


def record_preemption(signum, _frame):
    """Signal handler: only note the signal (the loop checkpoints at the end of its update); a second one,
    say during the checkpoint's writing, changes nothing."""
    RECEIVED.setdefault("signal", signal.Signals(signum).name)
    RECEIVED.setdefault("time", time.time())


def preemption_requested() -> bool:
    """Whether a preemption signal has reached any rank (every rank calls it at the same point)."""
    received = torch.tensor([float(bool(RECEIVED))], device=local_device())
    torch.distributed.all_reduce(received, op=torch.distributed.ReduceOp.MAX)
    return bool(received.item())


def exit_preempted(update: int, logger):
    """End a preempted run, its checkpoint of `update` written, with PREEMPTED_EXIT_CODE (`logger`: the run's
    outputs.MetricsLogger, closed first)."""
    logger.close()
    if torch.distributed.get_rank() == 0:
        since = f" {time.time() - RECEIVED['time']:.1f} s after {RECEIVED['signal']}" if RECEIVED else ""
        print(f"preempted: update {update} finished and checkpointed{since}; exiting with code "
              f"{PREEMPTED_EXIT_CODE}, --resume continues", flush=True)
    raise SystemExit(PREEMPTED_EXIT_CODE)


# ----------------------------------------------------------------------------------------------
# Distributed setup
# ----------------------------------------------------------------------------------------------
def init_distributed(timeout_seconds: float = 1800):
    """Start torch.distributed through DeepSpeed (a plain `python script.py` becomes a 1-rank world), and
    catch the preemption signals. A collective fails after `timeout_seconds` (DeepSpeed's default, 10
    minutes, is shorter than rank 0 may take to save an 8B policy while the others wait)."""
    for preemption_signal in PREEMPTION_SIGNALS:
        signal.signal(preemption_signal, record_preemption)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    world_of_one = None
    if "RANK" not in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
        os.environ.update(srun_ranks(os.environ))
    elif os.environ.get("WORLD_SIZE", "1") == "1":  # no launcher, or a launcher's one rank
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # what DeepSpeed asks of every rank
        if not torch.distributed.is_initialized():  # (a process's next run, or vLLM in it, keeps the group it has)
            # a rendezvous on the port the system gives it as it binds; a free port picked first, then bound after
            # DeepSpeed's seconds of import, can be taken meanwhile by a parallel job (EADDRINUSE)
            world_of_one = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world_of_one.port))
    deepspeed = load_deepspeed()
    if torch.cuda.is_available():  # before any CUDA work, so that each rank's tensors and NCCL use its own GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if world_of_one is not None:  # DeepSpeed takes the group as it is (gloo on a CPU, NCCL on a GPU)
        from deepspeed.accelerator import get_accelerator

        torch.distributed.init_process_group(get_accelerator().communication_backend_name(), store=world_of_one,
                                             rank=0, world_size=1, timeout=timeout)
    deepspeed.init_distributed(timeout=timeout)
    atexit.unregister(end_distributed)  # once, however many runs one process makes (the tests do)
    atexit.register(end_distributed)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def load_deepspeed():
    """DeepSpeed, with its all-reduce through shared memory on a CPU switched off: it serves DeepSpeed's
    inference kernels only (the kit's collectives are torch.distributed's), and off, DeepSpeed neither compiles
    it on a machine's first run nor maps a 66 MB buffer a rank in /dev/shm (never unlinked)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def srun_ranks(environment) -> dict[str, str]:
    """The ranks of a job step in which SLURM's srun started every rank itself, one per task (it sets no RANK):
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from its SLURM_* variables; MASTER_ADDR and MASTER_PORT as
    exported, else on one node this node and a port from the job id."""
    tasks, nodes = int(environment["SLURM_STEP_NUM_TASKS"]), int(environment.get("SLURM_STEP_NUM_NODES", 1))
    per_node = set(re.findall(r"(\d+)(?:\(x\d+\))?", environment.get("SLURM_STEP_TASKS_PER_NODE", str(tasks))))
    if len(per_node) != 1:
        fail(f"srun started {environment.get('SLURM_STEP_TASKS_PER_NODE')} tasks on its nodes: start the same "
             "number on every node (--ntasks-per-node)")
    if nodes > 1 and "MASTER_ADDR" not in environment:
        fail(f"srun started {tasks} tasks on {nodes} nodes, and MASTER_ADDR is not set: export MASTER_ADDR=$(scontrol "
             "show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) before srun")
    return {"RANK": environment["SLURM_PROCID"], "LOCAL_RANK": environment["SLURM_LOCALID"], "WORLD_SIZE": str(tasks),
            "LOCAL_WORLD_SIZE": per_node.pop(), "MASTER_ADDR": environment.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": environment.get("MASTER_PORT", str(20000 + int(environment["SLURM_JOB_ID"]) % 20000))}


def end_distributed():
    """At exit, while the interpreter is whole: free what holds gloo's work (the DeepSpeed engines of a run,
    unreachable now but kept by their reference cycles, with ZeRO-3's pending gathers), then end the
    process group. Either left to the interpreter's teardown can abort the rank ("terminate called without
    an active exception", exit code 250)."""
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def local_device() -> torch.device:
    """This rank's device: the GPU that init_distributed gave it on a GPU node, else the CPU.
    DeepSpeed places the models there, so every tensor they see must be created there too."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def seed_everything(seed: int, torch_deterministic: bool):
    if torch_deterministic:  # cuBLAS is deterministic only with a fixed workspace; set before its first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(torch_deterministic)
    # deterministic mode also NaN-fills every torch.empty: seconds per step on DeepSpeed's GB-sized buffers
    torch.utils.deterministic.fill_uninitialized_memory = False


def disable_dropout(model: torch.nn.Module):
    """RL on a model with dropout gives log-probs that differ between rollout and training."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def deepspeed_config(distributed: DistributedArgs, stage: int, training: OptimizerArgs | None) -> dict:
    """DeepSpeed's configuration of a trained model (its micro-batches and clipping from `training`) or, with
    `training` None, a frozen one."""
    return {
        "train_micro_batch_size_per_gpu": training.per_device_train_batch_size if training else 1,
        "gradient_accumulation_steps": training.gradient_accumulation_steps if training else 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": distributed.bf16},
        "steps_per_print": 10**9,
        **({"gradient_clipping": training.max_grad_norm} if training else {}),
    }


def prepare_deepspeed(model, distributed: DistributedArgs, training: OptimizerArgs | None = None, optimizer=None,
                      lr_scheduler=None):
    """Wrap `model` in a DeepSpeed engine: trained with `optimizer` (micro-batches and clipping of `training`),
    or frozen for inference.

    Frozen models (reference, reward) are partitioned under ZeRO-3 like the policy, and simply
    replicated (stage 0) under ZeRO-2, where partitioning would only save optimizer state they
    do not have. On a single rank ZeRO-2 has nothing to partition, so the policy takes stage 0 too,
    without the all-reduce of its gradients (a copy of every gradient, with no other rank to average
    with): the same AdamW step without ZeRO's bookkeeping.
    """
    import deepspeed

    train = optimizer is not None
    single_rank = torch.distributed.get_world_size() == 1
    stage = 0 if distributed.zero_stage == 2 and (not train or single_rank) else distributed.zero_stage
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                      config=deepspeed_config(distributed, stage, training if train else None))
    if not train:
        engine.eval()
    elif stage == 0:
        engine.enable_backward_allreduce = False
    return engine


@contextlib.contextmanager
def gathered(ds_engine, parameters: list):
    """ZeRO-3: the partitioned `parameters` of the DeepSpeed engine's model whole on every rank inside; without
    ZeRO-3 they already are."""
    if ds_engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters):
            yield
    else:
        yield


@contextlib.contextmanager
def full_parameters(ds_engine, part: str | None = None):
    """The DeepSpeed engine's model (or its attribute `part`, e.g. PPO's "policy") with ZeRO-3 partitioned
    parameters gathered: one gather for a whole generation, not one per step. `ds_engine` may also be a plain
    model (eval_checkpoints.py's), whole already."""
    import deepspeed

    if not isinstance(ds_engine, deepspeed.DeepSpeedEngine):
        yield ds_engine if part is None else getattr(ds_engine, part)
        return
    model = ds_engine.module if part is None else getattr(ds_engine.module, part)
    with gathered(ds_engine, list(model.parameters())):
        yield model


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """Average logged numbers over ranks, so metrics describe the whole batch, not rank 0's share."""
    if not values or torch.distributed.get_world_size() == 1:
        return values
    stacked = torch.tensor(list(values.values()), dtype=torch.float64, device=local_device())  # NCCL: GPU only
    torch.distributed.all_reduce(stacked)
    stacked /= torch.distributed.get_world_size()
    return dict(zip(values, stacked.tolist()))


def all_reduce_masked_means(values: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """The mean of each of `values` over the entries `mask` keeps on every rank together (0 where none): not
    the mean of the ranks' means, which would weigh an entry by how few its rank keeps."""
    sums = torch.stack([mask.sum(), *((value * mask).sum() for value in values.values())])
    sums = sums.to(local_device(), torch.float64)  # NCCL: GPU only
    torch.distributed.all_reduce(sums)
    return {name: (total / sums[0].clamp(min=1)).item() for name, total in zip(values, sums[1:])}


def check_signs(flags, positive: tuple[str, ...], non_negative: tuple[str, ...] = ()):
    """A one-line error for the first of the `positive` flags (attributes of `flags`, a script's Args or a
    group) that is not above 0, or of the `non_negative` ones that is below 0."""
    for name in positive:
        if getattr(flags, name) <= 0:
            fail(f"--{name} must be positive, got {getattr(flags, name)}")
    for name in non_negative:
        if getattr(flags, name) < 0:
            fail(f"--{name} must be 0 or positive, got {getattr(flags, name)}")


def batch_sizes(optimizer: RLOptimizerArgs, world_size: int) -> tuple[int, int]:
    """(local_batch_size, num_updates) from the batch arithmetic of ALGORITHMS.md; fails loudly when it does
    not divide."""
    local_batch_size = (optimizer.per_device_train_batch_size * optimizer.gradient_accumulation_steps
                        * optimizer.num_mini_batches)
    batch_size = local_batch_size * world_size
    if optimizer.total_episodes % batch_size:
        fail(f"--total_episodes {optimizer.total_episodes} is not a multiple of the batch size {batch_size} "
             "(per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x world_size)")
    return local_batch_size, optimizer.total_episodes // batch_size


# ----------------------------------------------------------------------------------------------
# What a run loads (data.py loads it)
# ----------------------------------------------------------------------------------------------
def is_decoder_classifier(model) -> bool:
    """Decoder classifiers (Llama, Qwen2, Mistral, GPT-NeoX, GPT-2, ...) apply a `score` head at every
    position and are read at the last real token; encoder classifiers (BERT, RoBERTa, DeBERTa) pool
    their first token inside their own forward."""
    return isinstance(getattr(model, "score", None), torch.nn.Module)


@dataclass
class Task:
    """What every script loads identically (data.load_task): tokenizers, stop tokens, the reward, prompts
    and the gold scorer."""

    tokenizer: object
    eos_ids: list[int]
    reward_tokenizer: object | None  # None: the reward model shares the policy's vocabulary (or --reward_fn)
    reward_fn: object | None  # --reward_fn: (prompts, completions, **columns) -> scores, instead of a reward model
    reward_fn_name: str | None  # --reward_fn as given, for its errors
    prompt_column: str  # the dataset column a reward function gets as the prompts
    train_prompts: object  # datasets.Dataset with "input_ids" and the dataset's columns
    eval_prompts: object | None  # the evaluation prompts (None: evaluation is off)
    gold_score: object | None  # (queries, responses as text) -> gold scores; None: no gold scorer
    has_references: bool  # whether eval_prompts has --reference_column (for the gold win-rate)


def left_pad(sequences: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, max_len) token ids and attention mask on `device`, padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        mask[row, width - len(sequence):] = 1
    return ids.to(device), mask.to(device)


# ----------------------------------------------------------------------------------------------
# Rollout details (ALGORITHMS.md, "3. The rollout: rules every script shares")
# ----------------------------------------------------------------------------------------------
def truncate_after_eos(responses: torch.Tensor, eos_ids: list[int], pad_token_id: int):
    """Pad every token after the first stop token.

    Returns the truncated responses, their lengths (counting the stop token) and whether each
    one contains a stop token. Lengths come from the stop token's position, never from comparing
    with the pad id, so EOS == pad works.  responses: (batch, response_len)
    """
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    contains_eos = is_eos.any(dim=1)
    first_eos = torch.where(contains_eos, is_eos.int().argmax(dim=1), responses.shape[1])
    lengths = torch.where(contains_eos, first_eos + 1, responses.shape[1])
    positions = torch.arange(responses.shape[1], device=responses.device)
    truncated = responses.masked_fill(positions[None, :] >= lengths[:, None], pad_token_id)
    return truncated, lengths, contains_eos


def response_mask(lengths: torch.Tensor, response_len: int) -> torch.Tensor:
    """(batch, response_len) bool mask of real response tokens."""
    return torch.arange(response_len, device=lengths.device)[None, :] < lengths[:, None]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` uses them, so scores match sampling."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0,
                         entropy: bool = False):
    """Per-token log-probs of `tokens` (batch, len) under `logits / (temperature + 1e-7)`, truncated to its
    nucleus when top_p < 1: the most likely tokens whose probabilities sum to top_p (exactly the set HF
    generate and vLLM sample from), renormalized. The token itself always stays in the set: under the
    weights that sampled it it is in the nucleus anyway, and under later weights its log-prob stays finite.
    With `entropy`, also each position's entropy of that same distribution: (log-probs, entropy)."""
    logits = logits.float() / (temperature + 1e-7)
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        outside = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # (batch, len, vocab), sorted order
        outside[..., -1] = False  # the most likely token always stays
        outside = outside.scatter(-1, order, outside)  # back to vocabulary order
        outside.scatter_(-1, tokens.unsqueeze(-1), False)
        logits = logits.masked_fill(outside, float("-inf"))
    log_probs = F.log_softmax(logits, dim=-1)  # (batch, len, vocab)
    chosen = torch.gather(log_probs, 2, tokens.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return chosen
    # outside the nucleus p log p is 0: log p = -inf must not enter the product, whose gradient would be NaN
    finite = log_probs.masked_fill(torch.isneginf(log_probs), 0.0)
    return chosen, -(log_probs.exp() * finite).sum(dim=-1)


def response_inputs(query_ids, query_mask, responses, lengths) -> tuple[dict, torch.Tensor]:
    """Model inputs for query + response (pads after the stop token masked out), and the response mask.

    The outputs at positions [query_len - 1, -1) are the ones that predicted each response token.
    query_ids, query_mask: (batch, query_len) left-padded; responses: (batch, response_len).
    """
    mask = response_mask(lengths, responses.shape[1])
    attention_mask = torch.cat([query_mask, mask.long()], dim=1)
    inputs = {"input_ids": torch.cat([query_ids, responses], dim=1), "attention_mask": attention_mask,
              "position_ids": position_ids(attention_mask)}
    return inputs, mask


def response_logprobs(model, query_ids, query_mask, responses, lengths, temperature, top_p=1.0, entropy=False):
    """Log-probs of each response token given its query (logprobs_from_logits); padded positions hold
    INVALID_LOGPROB. With `entropy`, also the entropy at each response position: (log-probs, entropy).

    query_ids, query_mask: (batch, query_len) left-padded; responses: (batch, response_len).
    """
    inputs, mask = response_inputs(query_ids, query_mask, responses, lengths)
    # logits only at the positions that predict a response token (the last response_len + 1, less the
    # last): over a long prompt the LM head's output would be the largest tensor of the pass
    response_logits = model(**inputs, logits_to_keep=responses.shape[1] + 1).logits[:, :-1]
    if entropy:
        logprobs, entropies = logprobs_from_logits(response_logits, responses, temperature, top_p, entropy=True)
        return logprobs.masked_fill(~mask, INVALID_LOGPROB), entropies.masked_fill(~mask, 0.0)
    return logprobs_from_logits(response_logits, responses, temperature, top_p).masked_fill(~mask, INVALID_LOGPROB)


def in_chunks(function, chunk_size: int, *tensors: torch.Tensor):
    """`function` on row chunks of `tensors` (to bound memory), its results concatenated along rows
    (each of them, when it returns a tuple)."""
    results = [function(*(t[i:i + chunk_size] for t in tensors)) for i in range(0, len(tensors[0]), chunk_size)]
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*results))
    return torch.cat(results)


def loss_denominator(mask: torch.Tensor, accumulation_steps: int) -> float:
    """What a micro-batch divides its summed loss by: the real tokens (or valid pairs) of its optimizer step,
    over every micro-batch and rank, divided by the micro-batches DeepSpeed averages the gradient over
    (`accumulation_steps` x ranks). Every token of the step then weighs the same, whatever micro-batch or rank
    it falls in: two ranks train as one. `mask`: this rank's, for the step's rows. Never 0 (a step of nothing
    to learn from has loss 0)."""
    count = mask.sum().to(torch.float64)
    torch.distributed.all_reduce(count)
    return max(count.item(), 1e-9) / (torch.distributed.get_world_size() * accumulation_steps)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over real tokens of each row.  values, mask: (batch, len) -> (batch,)"""
    return (values * mask).sum(dim=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the entries where mask is 1 (0 when there are none)."""
    return ((values * mask).sum() / mask.sum().clamp(min=1)).item()


def reward_scores(reward_model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head read at the last real token of each row.  input_ids: (batch, len) -> (batch,)

    Read by hand rather than through the model's pad-token pooling, which breaks with left
    padding and with EOS == pad.
    """
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids(attention_mask)).last_hidden_state
    last_real = attention_mask.shape[1] - 1 - attention_mask.flip(dims=[1]).int().argmax(dim=1)
    hidden_at_last = hidden[torch.arange(len(hidden)), last_real]
    return reward_model.score(hidden_at_last).squeeze(-1).float()


def decode_responses(tokenizer, query_ids, query_mask, responses, lengths, skip_special_tokens: bool):
    """Texts of queries and of their responses (up to and including the stop token).

    The response text is cut from the decoded whole, so the spacing between query and response
    is what the tokenizer gives the pair (word-level and BPE tokenizers differ there).
    """
    queries, texts = [], []
    for q, m, r, n in zip(query_ids, query_mask, responses, lengths):
        query = tokenizer.decode(q[m.bool()], skip_special_tokens=skip_special_tokens)
        whole = tokenizer.decode(torch.cat([q[m.bool()], r[:n]]), skip_special_tokens=skip_special_tokens)
        queries.append(query)
        texts.append(whole[len(query):] if whole.startswith(query) else whole)
    return queries, texts


def score_texts(reward_model, tokenizer, texts: list[str], stopped: list[bool]) -> torch.Tensor:
    """Scores of whole texts (prompt + completion) by a reward model through its own tokenizer.  (batch,)

    A decoder classifier gets the text plus its tokenizer's EOS text where the completion stopped (if
    the tokenizer has one), left-padded, read at the last real token. An encoder classifier (BERT,
    RoBERTa, DeBERTa) runs its own forward on the text encoded with its special tokens and padding
    side, and its score is logits[:, 0]; a text longer than it reads (its tokenizer's model_max_length, or
    else its position embeddings) loses its start, not the completion.
    """
    if is_decoder_classifier(reward_model):
        texts = [text + ((tokenizer.eos_token or "") if done else "") for text, done in zip(texts, stopped)]
        encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt",
                            padding_side="left").to(reward_model.device)
        return reward_scores(reward_model, encoded["input_ids"], encoded["attention_mask"])
    config = getattr(reward_model, "module", reward_model).config  # (a DeepSpeed engine's is its own)
    # a tokenizer saved without a limit says 1e30
    longest = min(tokenizer.model_max_length, getattr(config, "max_position_embeddings", None) or 10**9)
    encoded = tokenizer(texts, padding=True, truncation=longest < 10**9, max_length=min(longest, 10**9),
                        truncation_side="left", return_tensors="pt").to(reward_model.device)
    return reward_model(**encoded).logits[:, 0].float()


def score_responses(reward_model, query_ids, query_mask, responses, lengths, contains_eos, policy_tokenizer,
                    reward_tokenizer=None):
    """Reward-model score of each truncated response.  (batch,)

    `reward_tokenizer=None`: the reward model shares the policy's vocabulary, and a decoder classifier
    then reads the token ids as they are, at the last real token. Otherwise (or for an encoder
    classifier) the texts are decoded and scored through the reward model's tokenizer (score_texts).
    """
    if reward_tokenizer is None and is_decoder_classifier(reward_model):
        input_ids = torch.cat([query_ids, responses], dim=1)
        attention_mask = torch.cat([query_mask, response_mask(lengths, responses.shape[1]).long()], dim=1)
        return reward_scores(reward_model, input_ids, attention_mask)
    queries, texts = decode_responses(policy_tokenizer, query_ids, query_mask, responses, lengths, True)
    return score_texts(reward_model, reward_tokenizer or policy_tokenizer, [q + r for q, r in zip(queries, texts)],
                       contains_eos.tolist())


def function_rewards(task: "Task", rollout: "Rollout", prompt_rows: dict, where: str) -> torch.Tensor:
    """(N,) --reward_fn's scores: it gets the prompts (the dataset's --prompt_column text), the completions
    (decoded, without the stop token) and, as keyword arguments, the prompts' other dataset columns;
    each prompt's entries repeated for its samples. A failure stops the run with a one-line error
    naming `where` (the update). `prompt_rows`: {column: values}, the rollout's prompts."""
    samples = len(rollout.responses) // len(prompt_rows["input_ids"])
    _, completions = decode_responses(task.tokenizer, rollout.query_ids, rollout.query_mask, rollout.responses,
                                      rollout.lengths, True)
    columns = {name: [value for value in prompt_rows[name] for _ in range(samples)]
               for name in prompt_rows if name != "input_ids"}
    prompts = columns.pop(task.prompt_column)
    try:
        values = task.reward_fn(prompts, completions, **columns)
        scores = [float(value) for value in values]
    except Exception as error:  # the user's code: any error stops the run, on one line
        fail(f"{where}: --reward_fn {task.reward_fn_name} raised {type(error).__name__}: {error}")
    if len(scores) != len(completions):
        fail(f"{where}: --reward_fn {task.reward_fn_name} returned {len(scores)} scores for {len(completions)} "
             "completions")
    return torch.tensor(scores, device=rollout.responses.device)


def generate(model, query_ids, query_mask, response_length, temperature, eos_ids, pad_token_id, top_p=1.0):
    """Sample `response_length` new tokens with HF generate; rows that stop early are right-padded."""
    output = model.generate(input_ids=query_ids, attention_mask=query_mask, max_new_tokens=response_length,
                            do_sample=True, temperature=temperature + 1e-7, top_k=0, top_p=top_p,
                            eos_token_id=eos_ids, pad_token_id=pad_token_id)
    responses = output[:, query_ids.shape[1]:]
    return F.pad(responses, (0, response_length - responses.shape[1]), value=pad_token_id)


def sample_responses(policy, prompts: list[list[int]], num_samples: int, generation: GenerationArgs, seed: int,
                     task: Task, sampler, part: str | None = None):
    """`num_samples` completions per prompt with HF generate, each prompt's samples adjacent, for the prompts
    the sampler (a data.PromptSampler) has just drawn.

    Each chunk of --local_rollout_forward_batch_size rows is padded and seeded on its own, by (`seed`, the
    sampler's batch, the chunk's first row in the global batch): the samples do not depend on how many ranks
    share the batch, as long as the chunk size divides each rank's rows. Returns query_ids, query_mask (N, P)
    left-padded and raw responses (N, R), for N = prompts x num_samples rows. `part`: the policy's attribute
    name when the engine trains more than the policy (PPO).
    """
    pad, chunk_size = task.tokenizer.pad_token_id, generation.local_rollout_forward_batch_size
    rows = [prompt for prompt in prompts for _ in range(num_samples)]
    first_row = sampler.rank * sampler.local_batch_size * num_samples  # this rank's rows in the global batch
    device = local_device()
    responses = []
    with torch.no_grad(), full_parameters(policy, part) as model:
        for start in range(0, len(rows), chunk_size):
            chunk_ids, chunk_mask = left_pad(rows[start:start + chunk_size], pad, device)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(random.Random(f"{seed}/{sampler.position}/{first_row + start}").getrandbits(63))
                responses.append(generate(model, chunk_ids, chunk_mask, generation.response_length,
                                          generation.temperature, task.eos_ids, pad, generation.top_p))
    query_ids, query_mask = left_pad(rows, pad, device)
    return query_ids, query_mask, torch.cat(responses)


@dataclass
class Rollout:
    """A batch of sampled completions after truncation: N rows (prompts x samples per prompt, each
    prompt's samples adjacent), P prompt tokens, R response tokens (the batch's longest response)."""

    query_ids: torch.Tensor  # (N, P), left-padded
    query_mask: torch.Tensor  # (N, P)
    responses: torch.Tensor  # (N, R), pad after the first stop token
    lengths: torch.Tensor  # (N,) real response tokens, the stop token included
    contains_eos: torch.Tensor  # (N,) whether the response stopped

    @property
    def mask(self) -> torch.Tensor:
        """(N, R) real response tokens."""
        return response_mask(self.lengths, self.responses.shape[1])


def truncate_rollout(query_ids, query_mask, responses, task: Task) -> Rollout:
    """Pad every response token after the first stop token (any of the task's EOS ids), and drop the
    columns that are padding in every row: no forward pass runs over them."""
    responses, lengths, contains_eos = truncate_after_eos(responses, task.eos_ids, task.tokenizer.pad_token_id)
    return Rollout(query_ids, query_mask, responses[:, :max(1, lengths.max().item())], lengths, contains_eos)


@torch.no_grad()
def rollout_logprobs(model, rollout: Rollout, generation: GenerationArgs, top_p: float = 1.0,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """(N, R) log-probs of the rollout's tokens (of its `rows` only, if given) under `model` at the sampling
    temperature (and `top_p`: the policy's are those of the nucleus it samples from, the reference's of its
    whole distribution), INVALID_LOGPROB at pads."""
    tensors = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.lengths)
    return in_chunks(functools.partial(response_logprobs, model, temperature=generation.temperature, top_p=top_p),
                     generation.local_rollout_forward_batch_size,
                     *(tensors if rows is None else (tensor[rows] for tensor in tensors)))


@torch.no_grad()
def start_logprobs_but_first_step(policy, rollout: Rollout, generation: GenerationArgs,
                                     first_step_rows: torch.Tensor) -> torch.Tensor:
    """(N, R) the policy's log-probs under the weights that sampled the rollout (its weights now, before
    training), but for `first_step_rows`, the rows of the update's first optimizer step: its own forward
    computes theirs under the same weights, and the loop fills them in (reuse_first_step_logprobs);
    INVALID_LOGPROB there until then. One forward pass fewer than computing them all here."""
    logprobs = torch.full(rollout.responses.shape, INVALID_LOGPROB, device=rollout.responses.device)
    others = torch.ones(len(rollout.responses), dtype=torch.bool, device=rollout.responses.device)
    others[first_step_rows] = False
    if others.any():
        logprobs[others] = rollout_logprobs(policy, rollout, generation, generation.top_p, others)
    return logprobs


def reuse_first_step_logprobs(logprobs: torch.Tensor, rows: torch.Tensor, new_logprobs: torch.Tensor, epoch: int,
                              step: int):
    """In the update's first optimizer step (epoch 0, step 0: still the weights that sampled the batch), write
    its training forward's log-probs of `rows` into `logprobs` (start_logprobs_but_first_step's)."""
    if epoch == step == 0:
        logprobs[rows] = new_logprobs.detach()


@torch.no_grad()
def rollout_rewards(reward_model, rollout: Rollout, prompt_rows: dict, task: Task, chunk_size: int,
                    update: int) -> torch.Tensor:
    """(N,) the reward of each prompt + truncated completion, before the missing-EOS penalty: the reward
    model's score (a decoder classifier's read at the last real token), in chunks of `chunk_size` rows, or
    --reward_fn's value. `prompt_rows`: {column: values}, the rollout's prompts with their dataset columns,
    each standing for its samples."""
    if task.reward_fn is not None:
        return function_rewards(task, rollout, prompt_rows, f"update {update}")
    return in_chunks(functools.partial(score_responses, reward_model, policy_tokenizer=task.tokenizer,
                                       reward_tokenizer=task.reward_tokenizer),
                     chunk_size, rollout.query_ids, rollout.query_mask, rollout.responses, rollout.lengths,
                     rollout.contains_eos)


def groups_with_signal(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(prompts,) whether each group of k adjacent rewards (N,) holds two different ones: a group of equal
    rewards has advantage 0 everywhere and teaches a group-baseline method nothing."""
    per_prompt = scores.view(-1, k)
    return per_prompt.amax(dim=1) > per_prompt.amin(dim=1)


def groups_to_train(has_signal: torch.Tensor, size: int) -> torch.Tensor:
    """(size,) the groups that DAPO's dynamic sampling trains on, of those sampled (has_signal: (groups,)
    bools, in sampling order): the first `size` with unequal rewards; when there are fewer, the first groups
    of equal rewards fill the rest."""
    order = torch.cat([torch.nonzero(has_signal).flatten(), torch.nonzero(~has_signal).flatten()])
    return order[:size].sort().values


def fill_with_signal(first_round: tuple, next_round, k: int, size: int, max_rounds: int,
                     all_ranks: bool = False) -> tuple[list[tuple], torch.Tensor, dict]:
    """DAPO's dynamic sampling: to a first round of `size` groups of k samples, further rounds (next_round() samples
    one) until they hold `size` groups with unequal rewards or there are `max_rounds` rounds; with `all_ranks`,
    until every rank's rounds hold that many (each rank samples as many rounds: HF generate is collective under
    ZeRO-3). A round is a tuple whose last item is its rewards (N,). Returns every round, the groups to train on
    (groups_to_train; numbered over the rounds' groups in order), and dynamic_sampling/*."""
    rounds, has_signal = [first_round], groups_with_signal(first_round[-1], k)
    while True:
        shortfall = torch.tensor(float(max(size - has_signal.sum().item(), 0)), device=local_device())
        if all_ranks:
            torch.distributed.all_reduce(shortfall, torch.distributed.ReduceOp.MAX)
        if shortfall.item() == 0 or len(rounds) == max_rounds:
            break
        rounds.append(next_round())
        has_signal = torch.cat([has_signal, groups_with_signal(rounds[-1][-1], k).to(has_signal.device)])
    groups = groups_to_train(has_signal, size)
    scores = torch.cat([round_[-1] for round_ in rounds])
    return rounds, groups, dynamic_sampling_metrics(len(rounds), has_signal, groups, scores)


def dynamic_sampling_metrics(rounds: int, has_signal: torch.Tensor, groups, scores: torch.Tensor) -> dict:
    """dynamic_sampling/*: the rounds sampled, the equal-reward groups dropped and those that fill the batch
    (`groups`, of groups_to_train), and the mean reward of everything sampled (scores: every round's rows)."""
    unfilled = (~has_signal[groups]).sum().item()
    return {"dynamic_sampling/rounds": rounds, "dynamic_sampling/dropped_groups": (~has_signal).sum().item() - unfilled,
            "dynamic_sampling/unfilled": unfilled, "dynamic_sampling/sampled_scores": scores.mean().item()}


def check_rewards(scores: torch.Tensor, update: int):
    """Stop every rank, keeping the last complete checkpoint, when the reward is NaN or infinite."""
    bad = torch.tensor([float((~torch.isfinite(scores)).sum()), float(len(scores))], device=scores.device)
    torch.distributed.all_reduce(bad)
    if bad[0] > 0:
        fail(f"update {update}: the reward was NaN or infinite for {int(bad[0])} of "
             f"{int(bad[1])} completions; stopped, the last complete checkpoint is kept")


def rollout_metrics(rollout: Rollout, logprobs, ref_logprobs, scores, kl_coef: float = 0.0) -> dict[str, float]:
    """The objective/* numbers of a rollout (ALGORITHMS.md); `logprobs` (N, R) are the sampling policy's,
    `scores` (N,) the rewards after the missing-EOS penalty; `ref_logprobs` None: no reference policy (GRPO's
    beta 0), so no KL; objective/rlhf_reward weighs the KL by `kl_coef`."""
    metrics = {
        "objective/scores": scores.mean().item(),
        "objective/entropy": -masked_sum(logprobs, rollout.mask).mean().item(),
        # a count over the whole batch: all_reduce_mean of each rank's count times world_size is the sum
        "val/num_eos_tokens": rollout.contains_eos.sum().item() * torch.distributed.get_world_size(),
    }
    if ref_logprobs is not None:
        kl = masked_sum(logprobs - ref_logprobs, rollout.mask)  # (N,)
        metrics.update({"objective/kl": kl.mean().item(),
                        "objective/rlhf_reward": (scores - kl_coef * kl).mean().item()})
    return metrics
