"""RLOO: k completions per prompt, each baselined by the mean reward of the other k-1, and a clipped
surrogate on the sequence-level ratio; no value model. One of the baselines of "Asynchronous RLHF"
(Noukhovitch et al., 2024), after Ahmadian et al. (2024); ALGORITHMS.md has every formula.

    python rloo.py                                         # toy task, one CPU process
    deepspeed --num_gpus 2 rloo.py                         # two ranks (CPU: add --bind_cores_to_rank)
    deepspeed --num_gpus 4 rloo.py --bf16 --model_name_or_path mnoukhov/pythia410m-sft-tldr ...
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
from corrections import CorrectionArgs
from data import DataArgs, RewardArgs
from evaluation import EvalArgs
from lora import LoraArgs
from outputs import RLRunArgs


@dataclass
class Args:
    """RLOO's own flags; the groups below hold the flags every RL script shares, each declared in the
    module that reads it"""

    num_samples: int = 2
    """k: completions per prompt; each one's baseline is the mean reward of the other k-1"""
    kl_coef: float = 0.05
    """weight of the sequence KL in the reward: reward = score - kl_coef * sum_t (logp - ref_logp)"""
    cliprange: float = 0.2
    """clip range of the sequence-level policy ratio"""

    # the flags every RL script shares, by kind (flat names on the command line: --learning_rate)
    data: DataArgs = cli.group(DataArgs())
    reward: RewardArgs = cli.group(RewardArgs())
    generation: GenerationArgs = cli.group(GenerationArgs())
    optimizer: RLOptimizerArgs = cli.group(RLOptimizerArgs(num_epochs=4, learning_rate=3e-5))
    evaluation: EvalArgs = cli.group(EvalArgs())
    run: RLRunArgs = cli.group(RLRunArgs())
    corrections: CorrectionArgs = cli.group(CorrectionArgs())
    lora: LoraArgs = cli.group(LoraArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def check_args(args: Args, world_size: int) -> tuple[int, int]:
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2: the leave-one-out baseline needs another sample, "
                    f"got {args.num_samples}")
    return common.batch_sizes(args.optimizer, world_size)


def leave_one_out_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """A_i = r_i - (sum_j r_j - r_i) / (k - 1) for the rewards r of each prompt's k samples.
    rewards: (prompts * k,) -> (prompts * k,)"""
    per_prompt = rewards.view(-1, k)  # (prompts, k)
    baselines = (per_prompt.sum(dim=1, keepdim=True) - per_prompt) / (k - 1)
    return (per_prompt - baselines).flatten()


def sequence_policy_loss(new_seq_logps, old_seq_logps, advantages, cliprange: float, weights=1.0,
                         clip: bool = True):
    """Clipped surrogate on the sequence-level ratio exp(sum new_logp - sum old_logp), each sequence's term
    times its importance weight (1, or those of --off_policy_correction: corrections.off_policy_terms), averaged
    over sequences. All inputs (batch,); old: the log-probs the ratio is taken against; `clip` False (m2po)
    leaves the ratio unclipped. Returns (loss, clipfrac, ratio)."""
    ratio = torch.exp(new_seq_logps - old_seq_logps)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange) if clip else unclipped
    return (weights * torch.max(unclipped, clipped)).mean(), (clipped > unclipped).float().mean(), ratio


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

    policy, ref_policy = lora.load_policy(args.data.model_name_or_path, args.lora, dtype)  # ref_policy: None with LoRA
    reward_model = None if args.reward.reward_fn else data.load_reward_model(args.reward.reward_model_path, dtype)
    parameter_counts = lora.trainable_parameters(policy)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.optimizer.learning_rate)
    num_optimizer_steps = num_updates * args.optimizer.num_epochs * args.optimizer.num_mini_batches
    scheduler = get_scheduler(args.optimizer.lr_scheduler_type, optimizer, num_warmup_steps=0,
                              num_training_steps=num_optimizer_steps)
    policy = common.prepare_deepspeed(policy, args.distributed, args.optimizer, optimizer, scheduler)
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
        # Rollout: k samples per prompt, then the details in order: truncate after the first stop
        # token, reference log-probs, the reward at the last real token, the missing-EOS penalty.
        t0 = time.time()
        prompt_rows = task.train_prompts[sampler.next_indices()]  # {column: values}
        # query_ids, query_mask: (N, P), left-padded; responses: (N, R)
        query_ids, query_mask, responses = common.sample_responses(policy, prompt_rows["input_ids"], k,
                                                                   args.generation, args.run.seed, task, sampler)
        t1 = time.time()
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args.generation)  # (N, R)
        scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task,
                                        args.generation.local_rollout_forward_batch_size, update)  # (N,)
        if args.generation.missing_eos_penalty:  # no stop token: the penalty instead of the score
            scores = torch.where(rollout.contains_eos, scores, args.generation.penalty_reward_value)
        common.check_rewards(scores, update)
        # (N, R) under the sampling weights: the old policy. Not the training forward's: the advantages
        # need them (the KL penalty) for every row before the first one trains
        logprobs = common.rollout_logprobs(policy, rollout, args.generation, args.generation.top_p)
        start_logprobs = logprobs  # the sampler is the trainer, at the start of the update

        # Advantages: the KL-penalised sequence reward, baselined by the other samples of its prompt.
        kl = common.masked_sum(logprobs - ref_logprobs, rollout.mask)  # (N,)
        advantages = leave_one_out_advantages(scores - args.kl_coef * kl, k)  # (N,)
        t2 = time.time()

        # Learn: num_epochs passes over the batch, each num_mini_batches optimizer steps (the i-th
        # trains on data i-1 steps stale), each accumulated over gradient_accumulation_steps
        # micro-batches of per_device_train_batch_size prompts with all their k samples.
        stats = {name: [] for name in ("loss", "clipfrac", "approxkl", "entropy", "ratio", "off_policy")}
        for _ in range(args.optimizer.num_epochs):
            order = torch.randperm(local_batch_size)  # (B,) prompts, shuffled
            for mini_batch in order.split(mini_batch_size):
                for prompt_ids in mini_batch.split(micro_batch_size):
                    rows = (prompt_ids[:, None] * k + torch.arange(k)).flatten()  # each prompt's k samples
                    new_logprobs, entropy = common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.generation.temperature, args.generation.top_p,
                        entropy=True)  # (n, R) each
                    entropy = entropy.detach()  # logged only: its graph, (n, R, vocab), goes before the backward
                    terms = corrections.off_policy_terms(new_logprobs, logprobs[rows], start_logprobs[rows],
                                                         rollout.mask[rows], args.corrections, sequence_level=True)
                    # (n,) each completion's log-prob, over the tokens the correction keeps (m2po drops some)
                    new_seq_logps = common.masked_sum(new_logprobs, terms.kept)
                    old_seq_logps = common.masked_sum(terms.anchor, terms.kept)
                    loss, clipfrac, ratio = sequence_policy_loss(new_seq_logps, old_seq_logps, advantages[rows],
                                                                 args.cliprange, terms.weights.flatten(), terms.clip)
                    policy.backward(loss)
                    policy.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["loss"].append(loss.item())
                    stats["clipfrac"].append(clipfrac.item())
                    stats["approxkl"].append(0.5 * ((new_seq_logps.detach() - old_seq_logps) ** 2).mean().item())
                    stats["off_policy"].append(terms.diagnostics)
                    stats["entropy"].append(common.masked_mean(entropy, rollout.mask[rows]))
                    stats["ratio"].append(ratio.detach())
        t3 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items()}
        state.update, state.episode, state.data_position = update, state.episode + batch_size, sampler.position
        metrics = common.all_reduce_mean({
            "loss/policy_avg": stats["loss"],
            "policy/clipfrac_avg": stats["clipfrac"],
            "policy/approxkl_avg": stats["approxkl"],
            "policy/entropy_avg": stats["entropy"],
            "val/ratio": ratios.mean().item(),
            "val/ratio_var": ratios.var().item(),
            **off_policy,
            **common.rollout_metrics(rollout, logprobs, ref_logprobs, scores, args.kl_coef),
            "time/generate": t1 - t0,
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
