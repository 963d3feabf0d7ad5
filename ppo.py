"""PPO with a value model: one completion per prompt, a per-token KL penalty, GAE, clipped policy
and value losses. The PPO baseline of "Asynchronous RLHF" (Noukhovitch et al., 2024), after "The N+
Implementation Details of RLHF with PPO" (Huang et al., 2024); ALGORITHMS.md has every formula.

    python ppo.py                                          # toy task, one CPU process
    deepspeed --num_gpus 2 ppo.py                          # two ranks (CPU: add --bind_cores_to_rank)
    deepspeed --num_gpus 4 ppo.py --bf16 --model_name_or_path mnoukhov/pythia410m-sft-tldr ...
"""

import functools
import time
from dataclasses import dataclass

import torch

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
    """PPO's own flags; the groups below hold the flags every RL script shares, each declared in the
    module that reads it"""

    value_model_path: str | None = None
    """value model: a one-label decoder classifier with the policy's vocabulary; default: the reward model
    (as in the paper), or with --reward_fn the policy with a fresh scalar head"""
    kl_coef: float = 0.05
    """weight of the per-token KL penalty -kl_coef * (logp - ref_logp) in the reward"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (masked, mean kept) before GAE"""
    gamma: float = 1.0
    """discount of GAE"""
    lam: float = 0.95
    """lambda of GAE"""
    cliprange: float = 0.2
    """clip range of the per-token policy ratio"""
    cliprange_value: float = 0.2
    """clip range of the value prediction around the rollout's value"""
    vf_coef: float = 0.1
    """weight of the value loss: loss = policy loss + vf_coef * value loss"""

    # the flags every RL script shares, by kind (flat names on the command line: --learning_rate)
    data: DataArgs = cli.group(DataArgs())
    reward: RewardArgs = cli.group(RewardArgs())
    generation: GenerationArgs = cli.group(GenerationArgs())
    optimizer: RLOptimizerArgs = cli.group(RLOptimizerArgs(num_epochs=4, learning_rate=3e-5))
    evaluation: EvalArgs = cli.group(EvalArgs())
    run: RLRunArgs = cli.group(RLRunArgs())
    corrections: TokenCorrectionArgs = cli.group(TokenCorrectionArgs())
    lora: LoraArgs = cli.group(LoraArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


class PolicyAndValue(torch.nn.Module):
    """Policy and value model as one module, so one DeepSpeed engine trains both, as the reference
    does: the loss is one sum (policy loss + vf_coef * value loss), so one backward, one optimizer
    step and one gradient clip cover both. Only `policy` is saved as the trained model."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy, self.value_model = policy, value_model

    def forward(self, input_ids, attention_mask, position_ids):
        """Policy logits (batch, len, vocab) and the value head at every position (batch, len)."""
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        backbone = getattr(self.value_model, self.value_model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids).last_hidden_state
        return logits, self.value_model.score(hidden).squeeze(-1).float()


def forward_responses(model, query_ids, query_mask, responses, lengths, temperature, top_p):
    """Log-probs (common.logprobs_from_logits; INVALID_LOGPROB at pads), values (0 at pads) and entropies
    (at the temperature; no gradient) of each response token, from the positions that predicted it.
    Each (batch, response_len)."""
    inputs, mask = common.response_inputs(query_ids, query_mask, responses, lengths)
    logits, values = model(**inputs)
    start = query_ids.shape[1] - 1
    logprobs = common.logprobs_from_logits(logits[:, start:-1], responses, temperature, top_p)
    with torch.no_grad():  # logged only: no graph of (batch, response_len, vocab) held through the backward pass
        logits = logits[:, start:-1].float() / (temperature + 1e-7)
        entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return logprobs.masked_fill(~mask, common.INVALID_LOGPROB), values[:, start:-1] * mask, entropy


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std over the real entries of the whole batch, every rank's (unbiased variance): the
    same numbers however many ranks share the batch. The mean is added back when `shift_mean` is False.
    Padded entries are returned as 0."""
    count_and_sum = torch.stack([mask.sum(), (values * mask).sum()]).to(torch.float64)
    torch.distributed.all_reduce(count_and_sum)
    count, mean = count_and_sum[0], (count_and_sum[1] / count_and_sum[0]).to(values.dtype)
    squares = (((values - mean) * mask) ** 2).sum().to(torch.float64)
    torch.distributed.all_reduce(squares)
    whitened = (values - mean) * torch.rsqrt((squares / (count - 1)).to(values.dtype) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def token_rewards(logprobs, ref_logprobs, scores, lengths, mask, kl_coef: float) -> torch.Tensor:
    """-kl_coef * (logp - ref_logp) at every real token, plus the score at the last real token.  (batch, len)"""
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    rewards[torch.arange(len(rewards), device=rewards.device), lengths - 1] += scores
    return rewards


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over each response's real tokens.  All (batch, len).

    The episode ends at the last real token: nothing is bootstrapped from beyond it (pads hold
    value 0 and reward 0, and advantages at pads are 0). Returns (advantages, returns).
    """
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, advantages + values


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the real tokens, all (batch, len): the share of the returns'
    variance the value model's predictions explain (1: all of it; 0: no better than their mean; negative: worse;
    NaN where the returns do not vary)."""
    real = mask.bool()
    variance = returns[real].var()
    return (1 - (returns[real] - values[real]).var() / variance).item() if variance > 0 else float("nan")


def policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange: float, step_tokens: float, weights=1.0,
                clip: bool = True):
    """Clipped surrogate on per-token ratios, each term times its importance weight (1, or those of
    --off_policy_correction: corrections.off_policy_terms), summed over real tokens and divided by
    `step_tokens` (common.loss_denominator: every token of the optimizer step weighs the same); old: the
    log-probs the ratio is taken against; `clip` False (m2po) leaves the ratio unclipped. Returns (loss,
    clipfrac, ratio)."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange) if clip else unclipped
    loss = (weights * torch.max(unclipped, clipped) * mask).sum() / step_tokens
    clipfrac = ((clipped > unclipped).float() * mask).sum() / mask.sum()
    return loss, clipfrac, ratio


def value_loss(new_values, old_values, returns, mask, cliprange_value: float, step_tokens: float):
    """0.5 * max((V - returns)^2, (clip(V, V_old +- c) - returns)^2), summed over real tokens and divided by
    `step_tokens` (as the policy loss). Returns (loss, clipfrac)."""
    clipped_values = old_values + torch.clamp(new_values - old_values, -cliprange_value, cliprange_value)
    unclipped_loss, clipped_loss = (new_values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * (torch.max(unclipped_loss, clipped_loss) * mask).sum() / step_tokens
    clipfrac = ((clipped_loss > unclipped_loss).float() * mask).sum() / mask.sum()
    return loss, clipfrac


# Shapes: B prompts per update on this rank (local_batch_size), one sample each, P prompt tokens
# (left-padded), R response tokens (the batch's longest, at most --response_length).
def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size, num_updates = common.batch_sizes(args.optimizer, world_size)
    batch_size = local_batch_size * world_size
    outputs.resolve_output_dir(args.run)
    common.seed_everything(args.run.seed + rank, args.run.torch_deterministic)
    dtype = torch.bfloat16 if args.distributed.bf16 else torch.float32
    task = data.load_task(args.data, args.reward, args.evaluation, args.lora, rank, dtype,
                          evaluate=args.run.eval_every > 0)
    evaluate = functools.partial(evaluation.evaluate, args.evaluation, args.generation, args.run.seed, task)
    value_model_path = data.value_model_path(args.value_model_path, args.data.model_name_or_path, args.reward)
    data.check_value_model(value_model_path, task, args.data.model_name_or_path)
    sampler = data.PromptSampler(len(task.train_prompts), local_batch_size, rank, world_size, args.run.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        outputs.prepare_output_dir(args.run, cli.flag_values(args))
    torch.distributed.barrier()

    from transformers import get_scheduler

    policy, ref_policy = lora.load_policy(args.data.model_name_or_path, args.lora, dtype)  # ref_policy: None with LoRA
    value_model = data.load_value_model(value_model_path, dtype)
    if args.lora.use_peft:  # a LoRA adapter of its own, and its value head (peft's modules_to_save) in full
        value_model = lora.with_lora(value_model, args.lora, "SEQ_CLS").get_base_model()
    reward_model = None if args.reward.reward_fn else data.load_reward_model(args.reward.reward_model_path, dtype)
    agent = PolicyAndValue(policy, value_model)
    parameter_counts = lora.trainable_parameters(agent)
    optimizer = torch.optim.AdamW([p for p in agent.parameters() if p.requires_grad], lr=args.optimizer.learning_rate)
    num_optimizer_steps = num_updates * args.optimizer.num_epochs * args.optimizer.num_mini_batches
    scheduler = get_scheduler(args.optimizer.lr_scheduler_type, optimizer, num_warmup_steps=0,
                              num_training_steps=num_optimizer_steps)
    agent = common.prepare_deepspeed(agent, args.distributed, args.optimizer, optimizer, scheduler)
    ref_policy = lora.reference_policy(args.distributed, ref_policy, agent, part="policy")
    if reward_model is not None:  # none with --reward_fn
        reward_model = common.prepare_deepspeed(reward_model, args.distributed).module

    state = outputs.OnlineTrainerState()
    if args.run.resume:
        state = outputs.load_checkpoint(args.run.output_dir, agent)
        sampler.position = state.data_position
    logger = outputs.MetricsLogger(args.run, cli.flag_values(args), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "objective/kl", "eval/gold_win_rate"))
    logger.log(state.update, parameter_counts)
    if state.update == 0 and args.run.eval_every:
        logger.log_evaluation(0, 0, evaluate(agent, ref_policy, reward_model, 0, part="policy"))
    micro_batch_size = args.optimizer.per_device_train_batch_size
    mini_batch_size = micro_batch_size * args.optimizer.gradient_accumulation_steps  # prompts per optimizer step
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: one sample per prompt, then the details in order: truncate after the first stop
        # token, reference log-probs, the reward at the last real token, the missing-EOS penalty.
        t0 = time.time()
        prompt_rows = task.train_prompts[sampler.next_indices()]  # {column: values}
        # query_ids, query_mask: (B, P), left-padded; responses: (B, R)
        query_ids, query_mask, responses = common.sample_responses(agent, prompt_rows["input_ids"], 1,
                                                                   args.generation, args.run.seed, task, sampler,
                                                                   part="policy")
        t1 = time.time()
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args.generation)  # (B, R)
        scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task,
                                        args.generation.local_rollout_forward_batch_size, update)  # (B,)
        if args.generation.missing_eos_penalty:  # no stop token: the penalty instead of the score
            scores = torch.where(rollout.contains_eos, scores, args.generation.penalty_reward_value)
        common.check_rewards(scores, update)
        rows = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.lengths)
        # log-probs under the sampling weights and the values of the sampled tokens; not the training
        # forward's: the advantages need them (KL penalty, GAE) for every row before the first one trains
        with torch.no_grad():
            logprobs, values, _ = common.in_chunks(
                lambda *chunk: forward_responses(agent, *chunk, args.generation.temperature, args.generation.top_p),
                args.generation.local_rollout_forward_batch_size, *rows)  # (B, R) each
        start_logprobs = logprobs  # the sampler is the trainer, at the start of the update

        # Advantages: per-token KL penalty plus the score at the last real token, then GAE.
        mask = rollout.mask.float()  # (B, R)
        rewards = token_rewards(logprobs, ref_logprobs, scores, rollout.lengths, mask, args.kl_coef)  # (B, R)
        non_score_reward = (rewards.sum(1) - scores).mean().item()
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae_advantages(rewards, values, mask, args.gamma, args.lam)  # (B, R) each
        advantages = masked_whiten(advantages, mask)  # over the whole batch, every rank's
        t2 = time.time()

        # Learn: num_epochs passes over the batch, each num_mini_batches optimizer steps (the i-th
        # trains on data i-1 steps stale), each accumulated over gradient_accumulation_steps
        # micro-batches of per_device_train_batch_size prompts.
        stats = {name: [] for name in ("pg_loss", "vf_loss", "pg_clipfrac", "vf_clipfrac", "approxkl", "entropy",
                                       "ratio", "off_policy")}
        for _ in range(args.optimizer.num_epochs):
            order = torch.randperm(local_batch_size)  # (B,) prompts, shuffled
            for mini_batch in order.split(mini_batch_size):
                step_tokens = common.loss_denominator(mask[mini_batch], args.optimizer.gradient_accumulation_steps)
                for micro_batch in mini_batch.split(micro_batch_size):
                    new_logprobs, new_values, entropy = forward_responses(
                        agent, *(tensor[micro_batch] for tensor in rows), args.generation.temperature,
                        args.generation.top_p)
                    micro_mask = mask[micro_batch]
                    terms = corrections.off_policy_terms(
                        new_logprobs, logprobs[micro_batch], start_logprobs[micro_batch], micro_mask,
                        args.corrections, args.corrections.correction_level == "sequence")
                    pg_loss, pg_clipfrac, ratio = policy_loss(new_logprobs, terms.anchor, advantages[micro_batch],
                                                              micro_mask, args.cliprange, step_tokens,
                                                              terms.token_weights, terms.clip)
                    stats["off_policy"].append(terms.diagnostics)
                    vf_loss, vf_clipfrac = value_loss(new_values, values[micro_batch], returns[micro_batch],
                                                      micro_mask, args.cliprange_value, step_tokens)
                    agent.backward(pg_loss + args.vf_coef * vf_loss)
                    agent.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["pg_loss"].append(pg_loss.item())
                    stats["vf_loss"].append(vf_loss.item())
                    stats["pg_clipfrac"].append(pg_clipfrac.item())
                    stats["vf_clipfrac"].append(vf_clipfrac.item())
                    stats["approxkl"].append(0.5 * common.masked_mean((new_logprobs - terms.anchor).detach() ** 2,
                                                                      micro_mask))
                    stats["entropy"].append(common.masked_mean(entropy, micro_mask))
                    stats["ratio"].append(ratio.detach()[micro_mask.bool()])
        t3 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items()}
        state.update, state.episode, state.data_position = update, state.episode + batch_size, sampler.position
        metrics = common.all_reduce_mean({
            "policy/approxkl_avg": stats["approxkl"],
            "policy/clipfrac_avg": stats["pg_clipfrac"],
            "policy/entropy_avg": stats["entropy"],
            "loss/policy_avg": stats["pg_loss"],
            "loss/value_avg": stats["vf_loss"],
            "val/clipfrac_avg": stats["vf_clipfrac"],
            "val/explained_variance": explained_variance(values, returns, mask),  # the values before the update
            "val/ratio": ratios.mean().item(),
            "val/ratio_var": ratios.var().item(),
            **off_policy,
            **common.rollout_metrics(rollout, logprobs, ref_logprobs, scores, args.kl_coef),
            "objective/non_score_reward": non_score_reward,
            "time/generate": t1 - t0,
            "time/score": t2 - t1,
            "time/train": t3 - t2,
        })
        metrics.update({"lr": agent.get_lr()[0], "episode": state.episode,
                        "eps": (state.episode - start_episode) / (time.time() - start_time)})
        logger.log(update, metrics)
        if args.run.eval_every and (update % args.run.eval_every == 0 or update == num_updates):
            eval_metrics = evaluate(agent, ref_policy, reward_model, update, part="policy")
            logger.log_evaluation(update, state.episode, eval_metrics)
        # a preemption signal (SIGTERM, SIGUSR1) on any rank: checkpoint this update, then exit
        preempted = common.preemption_requested()
        if args.run.save_every and update % args.run.save_every == 0:
            outputs.save_snapshot(args.run, agent, task.tokenizer, state, part="policy")
        if preempted or (args.run.save_every and update % args.run.save_every == 0):
            outputs.save_checkpoint(args.run.output_dir, agent, state)
        if preempted:
            common.exit_preempted(update, logger)

    outputs.save_policy(args.run.output_dir, agent, task.tokenizer, state, part="policy", merged=args.lora.save_merged)
    logger.close()


if __name__ == "__main__":
    main(cli.parse(Args))
