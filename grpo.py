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

import functools
import math
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
import outputs
from cli import ConfigFiles
from common import DistributedArgs, GenerationArgs, RLOptimizerArgs
from corrections import TokenCorrectionArgs
from data import DataArgs, RewardArgs
from evaluation import EvalArgs
from lora import LoraArgs
from outputs import RLRunArgs


@dataclass
class Args:
    """GRPO's own flags; the groups below hold the flags every RL script shares, each declared in the
    module that reads it"""

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
    entropy_coef: float = 0.0
    """weight of an entropy bonus: the loss minus entropy_coef times the policy's mean token entropy"""

    # the flags every RL script shares, by kind (flat names on the command line: --learning_rate)
    data: DataArgs = cli.group(DataArgs())
    reward: RewardArgs = cli.group(RewardArgs())
    generation: GenerationArgs = cli.group(GenerationArgs())
    optimizer: RLOptimizerArgs = cli.group(RLOptimizerArgs(per_device_train_batch_size=8, learning_rate=3e-5,
                                                           total_episodes=2240))
    evaluation: EvalArgs = cli.group(EvalArgs())
    run: RLRunArgs = cli.group(RLRunArgs())
    corrections: TokenCorrectionArgs = cli.group(TokenCorrectionArgs())
    lora: LoraArgs = cli.group(LoraArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


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
    if args.soft_punish_cache and args.soft_punish_cache >= args.generation.response_length:
        common.fail(f"--soft_punish_cache {args.soft_punish_cache} must be below --response_length "
                    f"{args.generation.response_length}")
    return common.batch_sizes(args.optimizer, world_size)


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
        # in fp64 and in two passes (the mean, then the squares about it): large rewards with a small spread
        # would lose the spread in a sum of squares
        batch_rewards = rewards.to(common.local_device(), torch.float64)
        count_and_total = torch.stack([torch.ones_like(batch_rewards).sum(), batch_rewards.sum()])
        torch.distributed.all_reduce(count_and_total)
        count, total = count_and_total.tolist()
        squares = ((batch_rewards - total / count) ** 2).sum()
        torch.distributed.all_reduce(squares)
        advantages = advantages / (math.sqrt(squares.item() / (count - 1)) + 1e-4)
    return advantages.flatten()


def final_scores(reward_model, rollout: common.Rollout, prompt_rows: dict, task: common.Task, args,
                 update: int) -> torch.Tensor:
    """(N,) the rewards that make the advantages: the reward model's score or --reward_fn's value, then the
    missing-EOS penalty, then DAPO's soft overlong punishment."""
    scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task,
                                        args.generation.local_rollout_forward_batch_size, update)
    if args.generation.missing_eos_penalty:  # no stop token: the penalty instead of the score
        scores = torch.where(rollout.contains_eos, scores, args.generation.penalty_reward_value)
    if args.soft_punish_cache:
        scores = scores + soft_overlong_punishment(rollout.lengths, args.generation.response_length,
                                                   args.soft_punish_cache)
    return scores


def sample_round(policy, reward_model, task: common.Task, sampler, args, update: int):
    """The sampler's next prompts, k samples each, truncated after the first stop token, and their rewards:
    (prompt_rows {column: values}, rollout, scores (N,))."""
    prompt_rows = task.train_prompts[sampler.next_indices()]
    # query_ids, query_mask: (N, P), left-padded; responses: (N, R)
    query_ids, query_mask, responses = common.sample_responses(policy, prompt_rows["input_ids"], args.num_samples,
                                                               args.generation, args.run.seed, task, sampler)
    rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
    return prompt_rows, rollout, final_scores(reward_model, rollout, prompt_rows, task, args, update)


def gather_groups(rounds: list[tuple], groups: torch.Tensor, k: int, task: common.Task):
    """The batch --dynamic_sampling chose (common.fill_with_signal): the groups `groups` of the rounds (prompt_rows,
    rollout, scores), numbered over the rounds in order. Returns (prompt_rows, rollout, scores) as one round."""
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
                   for name in rounds[0][0]}
    return ({name: [values[g] for g in groups.tolist()] for name, values in prompt_rows.items()},
            common.truncate_rollout(query_ids[rows], query_mask[rows], responses[rows], task), scores[rows])


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


def token_average(values: torch.Tensor, mask: torch.Tensor, loss_type: str, max_tokens: int,
                  step_tokens: float) -> torch.Tensor:
    """The average that --loss_type names, of per-token `values` (n, R) over `mask`ed tokens of n rows:
    grpo, each row's mean, then their mean; bnpo, over these tokens; dr_grpo, the sum over rows x max_tokens
    (--response_length, or --max_episode_tokens for episodes); dapo and cispo, the sum over `step_tokens` (this
    rank's share of the completion tokens of the whole optimizer step, all micro-batches and ranks: see main)."""
    total = (values * mask).sum()
    if loss_type == "grpo":
        return ((values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return total / (values.shape[0] * max_tokens)
    return total / max(step_tokens, 1e-9)


def policy_loss(new_logprobs, old_logprobs, advantages, mask, args, step_tokens: float, max_tokens: int,
                ref_logprobs=None, entropy=None, weights=1.0, clip: bool = True):
    """The GRPO-family loss of n rows (completions, or episodes), over the tokens of `mask` (an episode's: the
    policy's): new_logprobs (the training forward), old_logprobs (those the ratio is taken against), ref_logprobs
    (with --beta), entropy (with --entropy_coef) and mask, all (n, R); advantages (n,), or (n, R) a token's own;
    step_tokens and max_tokens, the averages' denominators (token_average); weights, each policy term's importance
    weight (1, or those of --off_policy_correction: corrections.off_policy_terms), (n, R) or (n, 1); `clip` False
    (m2po) takes the ratio unclipped. Returns (loss, share of masked tokens whose clip binds, the ratios (n, R) or
    (n, 1))."""
    log_ratio = new_logprobs - old_logprobs  # (n, R)
    if args.importance_sampling_level == "sequence":  # GSPO: exp of the mean per-token log-ratio
        log_ratio = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    a = advantages[:, None] if advantages.dim() == 1 else advantages  # (n, 1), or (n, R): each token its own
    if args.loss_type == "cispo":  # REINFORCE weighted by the clipped ratio, no gradient through it
        bound = upper_clip(args) if clip else math.inf
        per_token = -torch.clamp(ratio, max=bound).detach() * a * new_logprobs
        clipped = (ratio > bound) & (a > 0)
    elif not clip:  # m2po: its trust region is the tokens it keeps
        per_token, clipped = -ratio * a, torch.zeros_like(ratio, dtype=torch.bool)
    else:
        clipped_ratio = torch.clamp(ratio, 1 - args.epsilon, 1 + upper_clip(args))
        capped = ratio if args.delta is None else torch.clamp(ratio, max=args.delta)
        per_token = -torch.min(capped * a, clipped_ratio * a)
        clipped = capped * a > clipped_ratio * a
    per_token = weights * per_token  # the KL and entropy terms are not reweighted (as TRL's, slime's)
    if args.beta:
        per_token = per_token + args.beta * token_kl(new_logprobs, ref_logprobs, args.kl_estimator)
    loss = token_average(per_token, mask, args.loss_type, max_tokens, step_tokens)
    if args.entropy_coef:
        loss = loss - args.entropy_coef * token_average(entropy, mask, args.loss_type, max_tokens, step_tokens)
    clipfrac = common.masked_mean(clipped.expand_as(mask).float(), mask.bool())
    return loss, clipfrac, ratio


# Shapes: B prompts per update on this rank (local_batch_size), k samples per prompt, N = B*k rollout
# rows (each prompt's k adjacent), P prompt tokens (left-padded), R response tokens (the batch's longest
# response, at most --response_length).
def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size, num_updates = check_args(args, world_size)
    batch_size = local_batch_size * world_size
    outputs.resolve_output_dir(args.run)
    common.seed_everything(args.run.seed + rank, args.run.torch_deterministic)
    dtype = torch.bfloat16 if args.distributed.bf16 else torch.float32
    task = data.load_task(args.data, args.reward, args.evaluation, args.lora, rank, dtype,
                          evaluate=args.run.eval_every > 0)
    evaluate = functools.partial(evaluation.evaluate, args.evaluation, args.generation, args.run.seed, task)
    sampler = data.PromptSampler(len(task.train_prompts), local_batch_size, rank, world_size, args.run.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        outputs.prepare_output_dir(args.run, cli.flag_values(args))
    torch.distributed.barrier()

    from transformers import get_scheduler

    # no reference policy at all with --beta 0 (but the free one of LoRA, the adapter off, for evaluation)
    policy, ref_policy = lora.load_policy(args.data.model_name_or_path, args.lora, dtype, reference=args.beta > 0)
    reward_model = None if args.reward.reward_fn else data.load_reward_model(args.reward.reward_model_path, dtype)
    parameter_counts = lora.trainable_parameters(policy)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.optimizer.learning_rate)
    num_optimizer_steps = num_updates * args.optimizer.num_epochs * args.optimizer.num_mini_batches
    scheduler = get_scheduler(args.optimizer.lr_scheduler_type, optimizer, num_warmup_steps=0,
                              num_training_steps=num_optimizer_steps)
    policy = common.prepare_deepspeed(policy, args.distributed, args.optimizer, optimizer, scheduler)
    if args.beta > 0 or args.lora.use_peft:
        ref_policy = lora.reference_policy(args.distributed, ref_policy, policy)
    if reward_model is not None:  # none with --reward_fn
        reward_model = common.prepare_deepspeed(reward_model, args.distributed).module

    state = outputs.OnlineTrainerState()
    if args.run.resume:
        state = outputs.load_checkpoint(args.run.output_dir, policy)
        sampler.position = state.data_position
    logger = outputs.MetricsLogger(args.run, cli.flag_values(args), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "objective/kl", "eval/gold_win_rate"))
    logger.log(state.update, parameter_counts)
    if state.update == 0 and args.run.eval_every:
        logger.log_evaluation(0, 0, evaluate(policy, ref_policy, reward_model, 0))
    k = args.num_samples
    micro_batch_size = args.optimizer.per_device_train_batch_size
    mini_batch_size = micro_batch_size * args.optimizer.gradient_accumulation_steps  # prompts per optimizer step
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: k samples per prompt, truncated after the first stop token, and their rewards (with
        # --dynamic_sampling, more rounds until the groups with unequal rewards fill the batch); then
        # the reference log-probs (with --beta) and the sampling weights' log-probs.
        t0 = time.time()
        prompt_rows, rollout, scores = sample_round(policy, reward_model, task, sampler, args, update)
        sampling_metrics = {}
        if args.dynamic_sampling:  # every rank samples as many rounds: HF generate is collective under ZeRO-3
            rounds, groups, sampling_metrics = common.fill_with_signal(
                (prompt_rows, rollout, scores),
                functools.partial(sample_round, policy, reward_model, task, sampler, args, update), k,
                local_batch_size, args.max_sampling_rounds, all_ranks=True)
            prompt_rows, rollout, scores = gather_groups(rounds, groups, k, task)
        t1 = time.time()
        common.check_rewards(scores, update)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args.generation) if args.beta else None  # (N, R)
        orders = [torch.randperm(local_batch_size) for _ in range(args.optimizer.num_epochs)]  # (B,) prompts each
        # (N, R) the sampling weights' log-probs, the ratios' denominator: the first optimizer step's forward
        # computes them for its rows (under the same weights); one forward here for every other row
        first_rows = (orders[0][:mini_batch_size, None] * k + torch.arange(k)).flatten()
        logprobs = common.start_logprobs_but_first_step(policy, rollout, args.generation, first_rows)
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
                step_tokens = common.loss_denominator(mask[step_rows], args.optimizer.gradient_accumulation_steps)
                for prompt_ids in mini_batch.split(micro_batch_size):
                    rows = (prompt_ids[:, None] * k + torch.arange(k)).flatten()  # each prompt's k samples
                    # (n, R) each: the entropy is logged, and in the loss with --entropy_coef
                    new_logprobs, entropy = common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.generation.temperature, args.generation.top_p, entropy=True)
                    if not args.entropy_coef:  # logged only: its graph, (n, R, vocab), goes before the backward
                        entropy = entropy.detach()
                    common.reuse_first_step_logprobs(logprobs, rows, new_logprobs, epoch, step)
                    terms = corrections.off_policy_terms(
                        new_logprobs, logprobs[rows], start_logprobs[rows], mask[rows], args.corrections,
                        args.corrections.correction_level == "sequence")
                    loss, clipfrac, ratio = policy_loss(
                        new_logprobs, terms.anchor, advantages[rows], mask[rows], args, step_tokens,
                        args.generation.response_length, ref_logprobs[rows] if args.beta else None, entropy,
                        terms.token_weights, terms.clip)
                    stats["off_policy"].append(terms.diagnostics)
                    policy.backward(loss)
                    policy.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["loss"].append(loss.item())
                    stats["clipfrac"].append(clipfrac)
                    stats["entropy"].append(common.masked_mean(entropy.detach(), mask[rows]))
                    stats["ratio"].append(ratio.detach().expand_as(mask[rows])[mask[rows].bool()])
        t3 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items()}
        state.update, state.episode, state.data_position = update, state.episode + batch_size, sampler.position
        rollout_stats = common.rollout_metrics(rollout, logprobs, None, scores)
        if args.beta:
            rollout_stats["objective/kl"] = common.masked_sum(logprobs - ref_logprobs, rollout.mask).mean().item()
        metrics = common.all_reduce_mean({
            "loss/policy_avg": stats["loss"],
            "policy/clipfrac_avg": stats["clipfrac"],
            "policy/entropy_avg": stats["entropy"],
            # an update whose every token is left out (--mask_truncated_completions) has no ratio: 1 and 0
            "val/ratio": ratios.mean().item() if len(ratios) else 1.0,
            "val/ratio_var": ratios.var().item() if len(ratios) > 1 else 0.0,
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
        if args.run.eval_every and (update % args.run.eval_every == 0 or update == num_updates):
            logger.log_evaluation(update, state.episode, evaluate(policy, ref_policy, reward_model, update))
        # a preemption signal (SIGTERM, SIGUSR1) on any rank: checkpoint this update, then exit
        preempted = common.preemption_requested()
        if args.run.save_every and update % args.run.save_every == 0:
            outputs.save_snapshot(args.run, policy, task.tokenizer, state)
        if preempted or (args.run.save_every and update % args.run.save_every == 0):
            outputs.save_checkpoint(args.run.output_dir, policy, state)
        if preempted:
            common.exit_preempted(update, logger)

    outputs.save_policy(args.run.output_dir, policy, task.tokenizer, state, merged=args.lora.save_merged)
    logger.close()


if __name__ == "__main__":
    main(cli.parse(Args))
