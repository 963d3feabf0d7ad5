"""Asynchronous GRPO and its variants: a vLLM engine samples batch t+1 while the trainer learns on batch t.
grpo.py is its synchronous twin (`diff grpo.py grpo_vllm.py` shows only the asynchronous part) and
ALGORITHMS.md has every formula.

Batch t is sampled with exactly the weights after update t-1-K (`--async_steps K`; 0 is synchronous).
The ratios are taken against the log-probs of the weights that sampled the batch: the engine's, which
async/logprob_diff checks against the trainer's model under the same weights.

    python grpo_vllm.py                                        # toy task: trainer on one core, vLLM on the other
    python grpo_vllm.py --loss_type dr_grpo --scale_rewards none   # Dr. GRPO, one update off-policy
    python grpo_vllm.py --vllm_device shared --async_steps 0   # one device, engine and trainer taking turns
    deepspeed --num_gpus 3 grpo_vllm.py --bf16 ...             # GPU node: 3 training GPUs, vLLM on cuda:3
"""

import functools
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch

import async_generator
import cli
import common
import corrections
import data
import evaluation
import inflight
import lora
import outputs
import rollouts
import vllm_generator
from cli import ConfigFiles
from common import DistributedArgs, GenerationArgs, RLOptimizerArgs
from corrections import TokenCorrectionArgs
from data import DataArgs, RewardArgs
from evaluation import EvalArgs
from lora import LoraArgs
from outputs import RLRunArgs
from vllm_generator import AsyncArgs
from vllm_placement import EngineArgs


@dataclass
class Args:
    """Asynchronous GRPO's own flags; the groups below hold the flags every RL script shares, each declared in the
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
    (dynamic_sampling/* metrics; the prompts drawn and dropped are used up, as in DAPO). The engine's process
    scores each round (with a copy of the reward model on its device, or --reward_fn) and samples the further
    prompts; the trainer takes its rewards"""
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
    asynchronous: AsyncArgs = cli.group(AsyncArgs())
    vllm: EngineArgs = cli.group(EngineArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def check_args(args: Args, world_size: int) -> tuple[int, int]:
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2: a group's advantages need another sample, "
                    f"got {args.num_samples}")
    async_generator.check_flags(args.asynchronous, args.vllm, world_size)
    if args.asynchronous.inflight_updates and args.dynamic_sampling:
        common.fail("--inflight_updates does not combine with --dynamic_sampling: turn one off")
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
    rank, world_size = common.init_distributed(vllm_generator.process_group_timeout(args.asynchronous))
    local_batch_size, num_updates = check_args(args, world_size)
    batch_size = local_batch_size * world_size
    outputs.resolve_output_dir(args.run)
    common.seed_everything(args.run.seed + rank, args.run.torch_deterministic)
    dtype = torch.bfloat16 if args.distributed.bf16 else torch.float32
    task = data.load_task(args.data, args.reward, args.evaluation, args.lora, rank, dtype,
                          evaluate=args.run.eval_every > 0)
    evaluate = functools.partial(evaluation.evaluate, args.evaluation, args.generation, args.run.seed, task)
    # the engine samples whole global batches; each rank trains on its share of one
    sampler = data.PromptSampler(len(task.train_prompts), batch_size, 0, 1, args.run.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        outputs.prepare_output_dir(args.run, cli.flag_values(args), vllm_generator.RESUME_MAY_CHANGE)
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
    logger = outputs.MetricsLogger(args.run, cli.flag_values(args), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "async/staleness", "eval/gold_win_rate"))
    logger.log(state.update, parameter_counts)
    # The generator process beside rank 0 holds the engine; it starts while the trainer evaluates. A
    # resumed run first trains on the batches its checkpoint had sampled ahead (with older weights),
    # and samples from the checkpoint's weights after them: whole batches, or in flight. With --dynamic_sampling
    # the generator process scores each round of samples as final_scores does here.
    dynamic_sampling = None
    if args.dynamic_sampling:
        dynamic_sampling = rollouts.DynamicSampling(functools.partial(final_scores, args=args), task, args.reward,
                                                          args.max_sampling_rounds)
    source = rollouts.SamplePrompts.of(task, args.data, args.generation, args.distributed.bf16, sampler,
                                             args.num_samples, args.evaluation, dynamic_sampling)
    generator = async_generator.AsyncGenerator(args.asynchronous, args.vllm, source, args.run, state, num_updates)
    # the starting policy's evaluation: here while the engine starts, or (by default) in the engine once started
    for evaluated, generated in generator.evaluations(state.update, wait=False):
        logger.log_evaluation(evaluated, 0, evaluate(policy, ref_policy, reward_model, evaluated, generated=generated))
    generator.wait_for_engine()
    if state.update > 0:  # the engine samples from the checkpoint's weights
        generator.publish_weights(policy, state.update)
    k, pad = args.num_samples, task.tokenizer.pad_token_id
    micro_batch_size = args.optimizer.per_device_train_batch_size
    mini_batch_size = micro_batch_size * args.optimizer.gradient_accumulation_steps  # prompts per optimizer step
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: this rank's share of the batch the engine sampled for this update, K updates ago
        # with older weights; then the details as in the synchronous twin.
        t0 = time.time()
        batch = generator.batch_for(update)
        prompt_rows = task.train_prompts[batch.prompt_indices]  # {column: values}
        query_ids, query_mask = common.left_pad(batch.queries, pad, policy.device)  # (N, P)
        responses = batch.responses.to(policy.device)  # (N, R)
        t1 = time.time()
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args.generation) if args.beta else None  # (N, R)
        if args.dynamic_sampling:  # the engine's process scored every round to choose the groups
            scores = batch.scores.to(policy.device)  # (N,)
        else:
            scores = final_scores(reward_model, rollout, prompt_rows, task, args, update)  # (N,)
        common.check_rewards(scores, update)
        # (N, R) the old policy's: the engine's log-probs under the weights that sampled the batch, which the
        # trainer no longer holds when K > 0 (async/logprob_diff shows they equal its model's)
        logprobs = batch.logprobs[:, :rollout.responses.shape[1]].to(policy.device)
        orders = [torch.randperm(local_batch_size) for _ in range(args.optimizer.num_epochs)]  # (B,) prompts each
        # (N, R) the trainer's log-probs at the start of the update, which decoupled, tis, mask and m2po take the
        # ratio against: the first optimizer step's forward computes them for its rows; one forward here for
        # every other row (none and pure_is never read them: a copy stands in)
        first_rows = (orders[0][:mini_batch_size, None] * k + torch.arange(k)).flatten()
        start_logprobs = (common.start_logprobs_but_first_step(policy, rollout, args.generation, first_rows)
                          if args.corrections.reads_start_logprobs else logprobs.clone())

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
                    common.reuse_first_step_logprobs(start_logprobs, rows, new_logprobs, epoch, step)
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

        # Weight sync: the new weights to the engine, in memory, announced by version number.
        generator.publish_weights(policy, update)
        t4 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items()}
        # the generator has drawn ahead; the prompts drawn up to this batch (several rounds with --dynamic_sampling)
        state.update, state.episode, state.data_position = update, state.episode + batch_size, batch.data_position
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
            "time/wait": t1 - t0,
            "time/score": t2 - t1,
            "time/train": t3 - t2,
            "time/weight_send": t4 - t3,  # the trainer waits for it
            "time/weight_sync": t4 - t3 + batch.metrics["time/weight_load"],
            # its engine's, averaged over the engines: time/generate, time/weight_load (before the batch), and on
            # checked batches async/logprob_diff and its cost, time/logprob_check
            **batch.metrics,
        })
        metrics.update({
            # updates between the sampling weights and the trained ones
            "async/staleness": vllm_generator.staleness(update, batch.version),
            "lr": policy.get_lr()[0], "episode": state.episode,
            "eps": (state.episode - start_episode) / (time.time() - start_time)})
        if args.asynchronous.inflight_updates:  # each token's staleness
            metrics |= inflight.inflight_metrics(batch, rollout.mask, update)
        logger.log(update, metrics)
        # a preemption signal (SIGTERM, SIGUSR1) on any rank: checkpoint this update, then exit
        preempted = common.preemption_requested()
        checkpoint = preempted or (args.run.save_every and update % args.run.save_every == 0)
        # Evaluate (--eval_every): the engine evaluates the weights of each update due, between its batches, and
        # the numbers arrive some updates later, logged with that update (all of them before a checkpoint and at
        # the end); with --eval_in_trainer, this update's weights, here
        for evaluated, generated in generator.evaluations(update, wait=checkpoint or update == num_updates):
            logger.log_evaluation(evaluated, evaluated * batch_size,
                                  evaluate(policy, ref_policy, reward_model, evaluated, generated=generated))
        if args.run.save_every and update % args.run.save_every == 0:
            outputs.save_snapshot(args.run, policy, task.tokenizer, state)
        if checkpoint:
            # the batches already sampled for the next K updates, with weights this checkpoint no longer
            # has, are saved with it: a resumed run trains on exactly the same samples
            state.pending_batches, state.engine_snapshot = generator.checkpoint_state(update)
            outputs.save_checkpoint(args.run.output_dir, policy, state)
        if preempted:
            common.exit_preempted(update, logger)

    outputs.save_policy(args.run.output_dir, policy, task.tokenizer, state, merged=args.lora.save_merged)
    generator.stop()
    logger.close()


if __name__ == "__main__":
    main(cli.parse(Args))
