"""GRPO and its 2025 variants: k completions per prompt, advantages from the group's rewards, a clipped
surrogate on per-token (or sequence) ratios, no value model (Shao et al., 2024, DeepSeekMath). --loss_type picks
the variant with TRL's GRPOConfig names: grpo, dr_grpo (Liu et al., 2025), dapo (Yu et al., 2025; the default,
as TRL's), bnpo, cispo (MiniMax-M1, 2025); --importance_sampling_level sequence is GSPO (Zheng et al., 2025).
A copy of rloo.py with the algorithm changed (`diff rloo.py grpo.py`); ALGORITHMS.md has every formula.

    python grpo.py                                         # toy task, one CPU process
    python grpo.py --loss_type dr_grpo --scale_rewards none   # Dr. GRPO
    python grpo.py --preset toy-math                       # the arithmetic task as DAPO: clip-higher, dynamic sampling
    deepspeed --num_gpus 2 grpo.py                         # two ranks (CPU: add --bind_cores_to_rank)
"""

import dataclasses
import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import cli
import common
import corrections
import data
import evaluation
import lora
import toy


@dataclass
class Args:
    # Configuration
    preset: str | None = None
    """start from configs/grpo/NAME.yaml, a named configuration (the README lists them); flags override it"""
    config: str | None = None
    """a YAML file of these flags' values (`learning_rate: 3.0e-6` per line), or a run's args.json to repeat
    that run; applied after --preset, and the flags given override it"""

    # Model and data
    model_name_or_path: str = toy.SFT_POLICY
    """SFT policy to start from; also the frozen reference policy of evaluation and of --beta (a local
    directory or hub id)"""
    reward_model_path: str = toy.REWARD_MODEL
    """proxy reward model that RL optimises: any one-label AutoModelForSequenceClassification, decoder (read
    at the last real token) or encoder (BERT, RoBERTa, DeBERTa), with its own tokenizer if need be"""
    reward_fn: str | None = None
    """a Python function as the reward instead of a reward model: path/to/file.py:name or module:name, called
    as fn(prompts, completions, **columns) -> one float per completion, where columns are the prompts' other
    dataset columns (e.g. a gold answer)"""
    gold_model_path: str | None = None
    """gold reward model for evaluation, or "toy" (the embedded task's programmatic scorer); default: toy
    on the toy task's data, else none (evaluation then reports the proxy reward and KL)"""
    dataset_name: str = toy.DATASET
    """prompts: a hub id (owner/name, or owner/name:configuration), a `save_to_disk` directory, a data
    directory, or a .json/.jsonl/.parquet file"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "validation"
    """split to evaluate on; if the dataset has none, the last --eval_num_prompts train prompts (at most a
    fifth of them) are held out of training for evaluation (with --eval_every 0 too)"""
    prompt_column: str = "query"
    """column holding the prompt text"""
    prompt_template: str | None = None
    """a format string over the dataset's columns that makes the prompt, e.g. "Problem: {question} Solution:"
    (default: the --prompt_column text as it is)"""
    answer_column: str | None = None
    """column of solutions ending in `#### N` (GSM8k's format): evaluation reports eval/accuracy, the share of
    greedy completions with the same final answer"""
    reference_column: str = "reference_response"
    """column of reference completions: with a gold scorer, evaluation reports the gold win-rate against
    them (no win-rate when the column is absent)"""
    chat_template: bool = False
    """wrap each prompt as a user message in the tokenizer's chat template"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens are dropped (the count is printed)"""

    # Generation
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

    # Algorithm
    num_samples: int = 4
    """k: completions per prompt, the group whose rewards make each one's advantage"""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] = "dapo"
    """how the per-token losses are averaged (TRL's names): grpo, per sequence then over sequences; dr_grpo,
    summed and divided by rows x --response_length; dapo, over every completion token of the optimizer step,
    all ranks; bnpo, over the tokens of each micro-batch; cispo, dapo's average of the REINFORCE loss
    -sg(min(ratio, --epsilon_high)) A logp (the ratio clipped, not the update)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage = reward - its group's mean, divided by the group's std (group), the whole batch's (batch),
    or nothing (none: Dr. GRPO); each std plus 1e-4"""
    epsilon: float = 0.2
    """the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """upper clip of the ratio, 1 + epsilon_high (default: --epsilon; DAPO's clip-higher: 0.28); with cispo
    the cap of the ratio itself (e.g. 5.0)"""
    delta: float | None = None
    """two-sided clipping: the unclipped ratio is also capped at delta (> 1 + epsilon_high), bounding the loss
    of negative advantages"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio per token; sequence (GSPO): one per completion, exp of the mean per-token log-ratio"""
    mask_truncated_completions: bool = False
    """completions with no stop token leave the loss (their rewards still count in their group's baseline)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the groups whose k rewards are all equal (advantage 0: they teach nothing)
    and sample more prompts, with the same weights, until the batch is full of groups with unequal rewards
    (dynamic_sampling/* metrics; the prompts drawn and dropped are used up, as in DAPO)"""
    max_sampling_rounds: int = 8
    """with --dynamic_sampling, the most batches of prompts sampled for one update; when they hold too few
    groups with unequal rewards, groups with equal ones fill the rest of the batch (dynamic_sampling/unfilled)"""
    soft_punish_cache: int = 0
    """DAPO's soft overlong punishment: completions longer than --response_length - this many tokens lose up
    to 1 reward, linearly (0: off)"""
    beta: float = 0.0
    """weight of a per-token KL penalty to the reference policy in the loss; 0 loads no reference policy at
    all (then no KL is logged, in training or evaluation)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator of --beta, r = ref_logp - logp: k1 -r, k2 r^2 / 2, k3 exp(r) - r - 1"""
    off_policy_correction: Literal["none", "decoupled", "tis", "mask"] = "none"
    """how the loss treats samples drawn with other weights than those it trains (ALGORITHMS.md, "Off-policy
    corrections"): none, the ratio against the sampling weights' log-probs; decoupled (AReaL's decoupled PPO, the
    kit's variant), against the weights just before each optimizer step, each term weighted by
    min(pi_those / pi_sampling, --is_cap); tis (truncated importance sampling), against the weights at the
    start of the update, weighted by min(pi_start / pi_sampling, --is_cap); mask (IcePop), the same ratio and
    weight, but terms whose weight lies outside [--is_mask_low, --is_cap] are dropped"""
    is_level: Literal["token", "sequence"] = "token"
    """importance weights per token, or per completion (sequence: exp of its summed log-ratio, on every token)"""
    is_cap: float | None = None
    """upper bound of the importance weight: default 5 with decoupled (AReaL's), 2 with tis (verl's, slime's), 5
    with mask (IcePop's); with none, the bound that async/is_truncated_frac counts against (2)"""
    is_mask_low: float = 0.5
    """with --off_policy_correction mask, the smallest weight kept (IcePop's 0.5)"""
    entropy_coef: float = 0.0
    """weight of an entropy bonus: the loss minus entropy_coef times the policy's mean token entropy"""

    # Optimisation
    total_episodes: int = 2240
    """prompts to train on, over all ranks"""
    per_device_train_batch_size: int = 8
    """prompts per micro-batch on each rank (each with its k completions)"""
    gradient_accumulation_steps: int = 4
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over a generated batch; the i-th of the first epoch is i-1 updates off-policy"""
    num_epochs: int = 1
    """passes over each generated batch, prompt order shuffled each time (TRL's num_iterations)"""
    learning_rate: float = 3e-5
    """peak learning rate, decayed linearly to 0"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / scoring forward pass"""

    # Evaluation, logging, checkpoints
    eval_every: int = 10
    """evaluate every this many updates (and before the first and after the last); 0: never"""
    eval_num_prompts: int = 256
    """validation prompts used by each evaluation"""
    eval_temperature: float = 0.01
    """near-greedy temperature of evaluation completions (the paper's protocol)"""
    save_every: int = 0
    """every this many updates, write a resumable checkpoint (only the latest is kept) and a policy snapshot,
    policies/update-N, for eval_checkpoints.py (0: neither; a checkpoint on preemption only)"""
    keep_snapshots: int | None = None
    """keep only the newest this many policy snapshots (default: all)"""
    output_dir: str | None = None
    """run directory (metrics.jsonl, checkpoints, policy); default runs/<exp_name>__<seed>__<time>"""
    resume: bool = False
    """continue the run in --output_dir from its latest complete checkpoint, with the same arguments and ranks
    (only logging, evaluation and checkpoint frequency, timeouts and the engine's placement may change)"""
    exp_name: str = os.path.splitext(os.path.basename(__file__))[0]
    """experiment name, used for the run directory and wandb"""
    seed: int = 1
    """seed of sampling, data order and initialisation"""
    torch_deterministic: bool = True
    """torch.use_deterministic_algorithms"""
    track: bool = False
    """log to wandb (set WANDB_MODE=offline to log without a network)"""
    wandb_project_name: str = "async-rlhf"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team)"""

    # LoRA
    use_peft: bool = False
    """train a LoRA adapter (peft) instead of every weight: the reference policy is the same model with the
    adapter switched off (no second copy in memory); checkpoints hold the adapter and its optimizer state;
    policy/ is the adapter"""
    lora_r: int = 16
    """LoRA rank r of each adapted layer's update B A"""
    lora_alpha: int = 32
    """LoRA scale: the update is (lora_alpha / lora_r) B A"""
    lora_dropout: float = 0.0
    """dropout on each adapted layer's input to A while the model is in training mode; 0 keeps the policy's
    log-probs the same in every forward (as the kit's dropout-free models do), which the importance ratio assumes"""
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    """layer names to adapt (as in the model's named_modules, e.g. q_proj v_proj), or all-linear: every linear
    layer but the output layer (attention and MLP projections of Llama, Qwen2, GPT-NeoX/Pythia, GPT-2)"""
    save_merged: bool = False
    """also write the policy with the adapter merged in, a plain model (what vLLM and from_pretrained load), to
    policy_merged/ (with --use_peft)"""

    # Distributed
    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage of the policy (3 also partitions the reference and reward models;
    2 on a single rank runs as stage 0: nothing to partition)"""
    bf16: bool = False
    """train and generate in bfloat16 (GPU runs)"""
    local_rank: int = -1
    """set by the deepspeed launcher"""


def check_args(args: Args, world_size: int) -> tuple[int, int]:
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2: a group's advantages need another sample, "
                    f"got {args.num_samples}")
    if not 0 < args.epsilon < 1:
        common.fail(f"--epsilon must be in (0, 1): the ratio is clipped below at 1 - epsilon, "
                    f"got {args.epsilon}")
    common.check_signs(args, (), ("beta", "entropy_coef", "soft_punish_cache"))
    if args.max_sampling_rounds < 1:
        common.fail(f"--max_sampling_rounds must be at least 1 (the batch itself), got {args.max_sampling_rounds}")
    if args.loss_type == "cispo" and (args.epsilon_high is None or args.epsilon_high <= 1):
        common.fail(f"--loss_type cispo caps the ratio itself at --epsilon_high, which must be above 1 (e.g. 5.0), "
                    f"got {args.epsilon_high}")
    if args.epsilon_high is not None and args.epsilon_high <= 0:
        common.fail(f"--epsilon_high must be positive (the ratio's upper clip is 1 + epsilon_high), "
                    f"got {args.epsilon_high}")
    if args.delta is not None and args.delta <= 1 + upper_clip(args):
        common.fail(f"--delta caps the unclipped ratio above its clip, so it must exceed 1 + epsilon_high = "
                    f"{1 + upper_clip(args):g}, got {args.delta}")
    if args.soft_punish_cache and args.soft_punish_cache >= args.response_length:
        common.fail(f"--soft_punish_cache {args.soft_punish_cache} must be below --response_length "
                    f"{args.response_length}")
    return common.batch_sizes(args, world_size)


def upper_clip(args) -> float:
    """--epsilon_high, or --epsilon when it is not given."""
    return args.epsilon if args.epsilon_high is None else args.epsilon_high


def group_advantages(rewards: torch.Tensor, k: int, scale_rewards: str) -> torch.Tensor:
    """A_i = r_i - mean of its group's k rewards, divided by the group's std (group), by the std of every
    reward of the global batch, all ranks (batch), or not at all (none); each std (n - 1) plus 1e-4.
    rewards: (prompts * k,) -> (prompts * k,)"""
    per_prompt = rewards.view(-1, k)  # (prompts, k)
    advantages = per_prompt - per_prompt.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (per_prompt.std(dim=1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        sums = torch.stack([torch.tensor(float(len(rewards))), rewards.sum().cpu(), (rewards ** 2).sum().cpu()])
        sums = sums.to(common.local_device(), torch.float64)
        torch.distributed.all_reduce(sums)
        count, total, squares = sums.tolist()
        advantages = advantages / (math.sqrt(max(squares - total ** 2 / count, 0.0) / (count - 1)) + 1e-4)
    return advantages.flatten()


def final_scores(reward_model, rollout: common.Rollout, prompt_rows: dict, task: common.Task, args,
                 update: int) -> torch.Tensor:
    """(N,) the rewards that make the advantages: the reward model's score or --reward_fn's value, then the
    missing-EOS penalty, then DAPO's soft overlong punishment."""
    scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task, args, update)
    if args.missing_eos_penalty:  # no stop token: the penalty instead of the score
        scores = torch.where(rollout.contains_eos, scores, args.penalty_reward_value)
    if args.soft_punish_cache:
        scores = scores + soft_overlong_punishment(rollout.lengths, args.response_length, args.soft_punish_cache)
    return scores


def sample_round(policy, reward_model, task: common.Task, sampler, args, update: int):
    """The sampler's next prompts, k samples each, truncated after the first stop token, and their rewards:
    (prompt_rows {column: values}, rollout, scores (N,))."""
    prompt_rows = task.train_prompts[sampler.next_indices()]
    # query_ids, query_mask: (N, P), left-padded; responses: (N, R)
    query_ids, query_mask, responses = common.sample_responses(policy, prompt_rows["input_ids"], args.num_samples,
                                                               args, task, sampler)
    rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
    return prompt_rows, rollout, final_scores(reward_model, rollout, prompt_rows, task, args, update)


def fill_with_signal(first_round, next_round, args, task: common.Task):
    """DAPO's dynamic sampling: to the round `first_round` (prompt_rows, rollout, scores), add rounds of
    next_round() until they hold as many groups with unequal rewards as the batch has prompts (on every rank:
    all ranks sample as many rounds, generate being collective under ZeRO-3), or --max_sampling_rounds; the
    batch is then common.groups_to_train of them. Returns the batch as a round, and dynamic_sampling/*."""
    rounds, k, size = [first_round], args.num_samples, len(first_round[0]["input_ids"])
    while True:
        has_signal = torch.cat([common.groups_with_signal(scores, k) for _, _, scores in rounds])  # (groups,)
        shortfall = torch.tensor(float(max(size - has_signal.sum().item(), 0)), device=common.local_device())
        torch.distributed.all_reduce(shortfall, torch.distributed.ReduceOp.MAX)
        if shortfall.item() == 0 or len(rounds) == args.max_sampling_rounds:
            break
        rounds.append(next_round())
    groups = common.groups_to_train(has_signal, size)  # (B,)
    rows = (groups[:, None] * k + torch.arange(k)).flatten()  # (N,)
    pad = task.tokenizer.pad_token_id
    prompt_width = max(rollout.query_ids.shape[1] for _, rollout, _ in rounds)
    response_width = max(rollout.responses.shape[1] for _, rollout, _ in rounds)
    query_ids = torch.cat([F.pad(r.query_ids, (prompt_width - r.query_ids.shape[1], 0), value=pad)
                           for _, r, _ in rounds])
    query_mask = torch.cat([F.pad(r.query_mask, (prompt_width - r.query_mask.shape[1], 0)) for _, r, _ in rounds])
    responses = torch.cat([F.pad(r.responses, (0, response_width - r.responses.shape[1]), value=pad)
                           for _, r, _ in rounds])
    scores = torch.cat([scores for _, _, scores in rounds])
    prompt_rows = {name: [value for rows_of_round, _, _ in rounds for value in rows_of_round[name]]
                   for name in first_round[0]}
    metrics = common.dynamic_sampling_metrics(len(rounds), has_signal, groups, scores)
    return ({name: [values[g] for g in groups.tolist()] for name, values in prompt_rows.items()},
            common.truncate_rollout(query_ids[rows], query_mask[rows], responses[rows], task), scores[rows], metrics)


def soft_overlong_punishment(lengths: torch.Tensor, response_length: int, cache: int) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to response_length - cache tokens, then down linearly to -1 at
    response_length.  lengths: (N,) -> (N,)"""
    start = response_length - cache
    return torch.where(lengths <= start, 0.0, (start - lengths.float()) / cache)


def token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference, r = ref_logp - logp: k1 -r, k2 r^2 / 2, k3
    exp(r) - r - 1 (unbiased and never negative; Schulman, 2020)."""
    r = ref_logprobs - logprobs
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r ** 2
    return torch.exp(r) - r - 1


def token_average(values: torch.Tensor, mask: torch.Tensor, loss_type: str, response_length: int,
                  step_tokens: float) -> torch.Tensor:
    """The average that --loss_type names, of per-token `values` (n, R) over `mask`ed tokens of n rows:
    grpo, each row's mean, then their mean; bnpo, over these tokens; dr_grpo, the sum over rows x
    response_length; dapo and cispo, the sum over `step_tokens` (this rank's share of the completion tokens
    of the whole optimizer step, all micro-batches and ranks: see main)."""
    total = (values * mask).sum()
    if loss_type == "grpo":
        return ((values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return total / (values.shape[0] * response_length)
    return total / max(step_tokens, 1e-9)


def policy_loss(new_logprobs, old_logprobs, advantages, mask, args, step_tokens: float, ref_logprobs=None,
                entropy=None, weights=1.0):
    """The GRPO-family loss of n rows: new_logprobs (the training forward), old_logprobs (those the ratio is
    taken against), ref_logprobs (with --beta), entropy (with --entropy_coef) and mask, all (n, R); advantages
    (n,); weights, each policy term's importance weight (1, or those of --off_policy_correction:
    corrections.off_policy_terms), (n, R) or (n, 1). Returns (loss, share of masked tokens whose clip binds, the
    ratios (n, R) or (n, 1))."""
    log_ratio = new_logprobs - old_logprobs  # (n, R)
    if args.importance_sampling_level == "sequence":  # GSPO: exp of the mean per-token log-ratio
        log_ratio = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    a = advantages[:, None]
    if args.loss_type == "cispo":  # REINFORCE weighted by the clipped ratio, no gradient through it
        per_token = -torch.clamp(ratio, max=upper_clip(args)).detach() * a * new_logprobs
        clipped = (ratio > upper_clip(args)) & (a > 0)
    else:
        clipped_ratio = torch.clamp(ratio, 1 - args.epsilon, 1 + upper_clip(args))
        capped = ratio if args.delta is None else torch.clamp(ratio, max=args.delta)
        per_token = -torch.min(capped * a, clipped_ratio * a)
        clipped = capped * a > clipped_ratio * a
    per_token = weights * per_token  # the KL and entropy terms are not reweighted (as TRL's, slime's)
    if args.beta:
        per_token = per_token + args.beta * token_kl(new_logprobs, ref_logprobs, args.kl_estimator)
    loss = token_average(per_token, mask, args.loss_type, args.response_length, step_tokens)
    if args.entropy_coef:
        loss = loss - args.entropy_coef * token_average(entropy, mask, args.loss_type, args.response_length,
                                                        step_tokens)
    clipfrac = common.masked_mean(clipped.expand_as(mask).float(), mask.bool())
    return loss, clipfrac, ratio


# Shapes: B prompts per update on this rank (local_batch_size), k samples per prompt, N = B*k rollout
# rows (each prompt's k adjacent), P prompt tokens (left-padded), R response tokens (the batch's longest
# response, at most --response_length).
def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size, num_updates = check_args(args, world_size)
    batch_size = local_batch_size * world_size
    common.resolve_output_dir(args)
    common.seed_everything(args.seed + rank, args.torch_deterministic)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    task = data.load_task(args, rank, dtype, evaluation=args.eval_every > 0)
    sampler = data.PromptSampler(len(task.train_prompts), local_batch_size, rank, world_size, args.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        common.prepare_output_dir(args)
    torch.distributed.barrier()

    from transformers import get_scheduler

    # no reference policy at all with --beta 0 (but the free one of LoRA, the adapter off, for evaluation)
    policy, ref_policy = lora.load_policy(args, dtype, reference=args.beta > 0)
    reward_model = None if args.reward_fn else data.load_reward_model(args.reward_model_path, dtype)
    parameter_counts = lora.trainable_parameters(policy)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate)
    num_optimizer_steps = num_updates * args.num_epochs * args.num_mini_batches
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=num_optimizer_steps)
    policy = common.prepare_deepspeed(policy, args, optimizer, scheduler)
    ref_policy = lora.reference_policy(args, ref_policy, policy) if args.beta > 0 or args.use_peft else None
    if reward_model is not None:  # none with --reward_fn
        reward_model = common.prepare_deepspeed(reward_model, args).module

    state = common.OnlineTrainerState()
    if args.resume:
        state = common.load_checkpoint(args.output_dir, policy)
        sampler.position = state.data_position
    logger = common.MetricsLogger(args, os.path.basename(args.output_dir), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "objective/kl", "eval/gold_win_rate"))
    logger.log(state.update, parameter_counts)
    if state.update == 0 and args.eval_every:
        logger.log_evaluation(0, 0, evaluation.evaluate(args, task, policy, ref_policy, reward_model, 0))
    k = args.num_samples
    mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps  # prompts per optimizer step
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: k samples per prompt, truncated after the first stop token, and their rewards (with
        # --dynamic_sampling, more rounds until the groups with unequal rewards fill the batch); then
        # the reference log-probs (with --beta) and the sampling weights' log-probs.
        t0 = time.time()
        prompt_rows, rollout, scores = sample_round(policy, reward_model, task, sampler, args, update)
        sampling_metrics = {}
        if args.dynamic_sampling:
            prompt_rows, rollout, scores, sampling_metrics = fill_with_signal(
                (prompt_rows, rollout, scores),
                functools.partial(sample_round, policy, reward_model, task, sampler, args, update), args, task)
        t1 = time.time()
        common.check_rewards(scores, update)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args) if args.beta else None  # (N, R)
        orders = [torch.randperm(local_batch_size) for _ in range(args.num_epochs)]  # (B,) prompts, shuffled
        # (N, R) the sampling weights' log-probs, the ratios' denominator: the first optimizer step's forward
        # computes them for its rows (under the same weights); one forward here for every other row
        first_rows = (orders[0][:mini_batch_size, None] * k + torch.arange(k)).flatten()
        logprobs = common.logprobs_not_trained_first(policy, rollout, args, first_rows)
        start_logprobs = logprobs  # the sampler is the trainer, at the start of the update

        # Advantages: each reward against its group's; the tokens that count in the loss.
        advantages = group_advantages(scores, k, args.scale_rewards)  # (N,)
        mask = rollout.mask.float()  # (N, R)
        if args.mask_truncated_completions:
            mask = mask * rollout.contains_eos[:, None]
        t2 = time.time()

        # Learn: num_epochs passes over the batch, each num_mini_batches optimizer steps (the i-th
        # trains on data i-1 steps stale), each accumulated over gradient_accumulation_steps
        # micro-batches of per_device_train_batch_size prompts with all their k samples.
        stats = {name: [] for name in ("loss", "clipfrac", "entropy", "ratio", "off_policy")}
        for epoch, order in enumerate(orders):
            for step, mini_batch in enumerate(order.split(mini_batch_size)):
                # dapo and cispo average over every completion token of the step (all micro-batches, all ranks)
                step_rows = (mini_batch[:, None] * k + torch.arange(k)).flatten()
                step_tokens = common.step_share(mask[step_rows], args)
                for prompt_ids in mini_batch.split(args.per_device_train_batch_size):
                    rows = (prompt_ids[:, None] * k + torch.arange(k)).flatten()  # each prompt's k samples
                    # (n, R); the entropy (n, R) too with --entropy_coef: it costs a pass over the vocabulary
                    new_logprobs = common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.temperature, args.top_p, entropy=args.entropy_coef > 0)
                    new_logprobs, entropy = new_logprobs if args.entropy_coef else (new_logprobs, None)
                    if epoch == step == 0:  # still the sampling weights
                        logprobs[rows] = new_logprobs.detach()
                    old_logprobs, weights, diagnostics = corrections.off_policy_terms(
                        new_logprobs, logprobs[rows], start_logprobs[rows], mask[rows], args)
                    loss, clipfrac, ratio = policy_loss(
                        new_logprobs, old_logprobs, advantages[rows], mask[rows], args, step_tokens,
                        ref_logprobs[rows] if args.beta else None, entropy, weights)
                    stats["off_policy"].append(diagnostics)
                    policy.backward(loss)
                    policy.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["loss"].append(loss.item())
                    stats["clipfrac"].append(clipfrac)
                    if entropy is not None:
                        stats["entropy"].append(common.masked_mean(entropy.detach(), mask[rows]))
                    stats["ratio"].append(ratio.detach().expand_as(mask[rows])[mask[rows].bool()])
        t3 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items() if values}
        state.update, state.episode, state.data_position = update, state.episode + batch_size, sampler.position
        rollout_stats = common.rollout_metrics(args, rollout, logprobs, None, scores)
        if args.beta:
            rollout_stats["objective/kl"] = common.masked_sum(logprobs - ref_logprobs, rollout.mask).mean().item()
        metrics = common.all_reduce_mean({
            "loss/policy_avg": stats["loss"],
            "policy/clipfrac_avg": stats["clipfrac"],
            **({"policy/entropy_avg": stats["entropy"]} if args.entropy_coef else {}),
            "val/ratio": ratios.mean().item(),
            "val/ratio_var": ratios.var().item(),
            **off_policy,
            # groups whose k rewards are all equal: their advantages are 0, they teach nothing
            "objective/zero_std_groups": (scores.view(-1, k).std(dim=1) == 0).float().mean().item(),
            **rollout_stats,
            **sampling_metrics,
            "time/generate": t1 - t0,  # and the rewards
            "time/score": t2 - t1,
            "time/train": t3 - t2,
        })
        metrics.update({"lr": policy.get_lr()[0], "episode": state.episode,
                        "eps": (state.episode - start_episode) / (time.time() - start_time)})
        logger.log(update, metrics)
        if args.eval_every and (update % args.eval_every == 0 or update == num_updates):
            logger.log_evaluation(update, state.episode,
                                  evaluation.evaluate(args, task, policy, ref_policy, reward_model, update))
        # a preemption signal (SIGTERM, SIGUSR1) on any rank: checkpoint this update, then exit
        preempted = common.preemption_requested()
        if args.save_every and update % args.save_every == 0:
            common.save_snapshot(args, policy, task.tokenizer, state)
        if preempted or (args.save_every and update % args.save_every == 0):
            common.save_checkpoint(args.output_dir, policy, state)
        if preempted:
            common.exit_preempted(update, logger)

    common.save_policy(args, policy, task.tokenizer, state)
    logger.close()


if __name__ == "__main__":
    main(cli.parse(Args))
