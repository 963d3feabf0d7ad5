"""Online best-of-k: sample k completions per prompt, keep the one the reward model scores highest,
and train on it with the negative log-likelihood (supervised learning on the best of k). One of the
baselines of "Asynchronous RLHF" (Noukhovitch et al., 2024); ALGORITHMS.md has every formula.

    python bok.py                                          # toy task, one CPU process
    deepspeed --num_gpus 2 bok.py                          # two ranks (CPU: add --bind_cores_to_rank)
    deepspeed --num_gpus 4 bok.py --bf16 --model_name_or_path mnoukhov/pythia410m-sft-tldr ...
"""

import functools
import time
from dataclasses import dataclass

import torch

import cli
import common
import data
import evaluation
import lora
import outputs
from cli import ConfigFiles
from common import DistributedArgs, GenerationArgs, RLOptimizerArgs
from data import DataArgs, RewardArgs
from evaluation import EvalArgs
from lora import LoraArgs
from outputs import RLRunArgs


@dataclass
class Args:
    """Online best-of-k's own flags; the groups below hold the flags every RL script shares, each declared in the
    module that reads it"""

    num_samples: int = 2
    """k: completions per prompt; the one the reward model scores highest is trained on"""
    kl_coef: float = 0.05
    """weight of KL in the logged objective/rlhf_reward (the loss has no KL term)"""

    # the flags every RL script shares, by kind (flat names on the command line: --learning_rate)
    data: DataArgs = cli.group(DataArgs())
    reward: RewardArgs = cli.group(RewardArgs())
    generation: GenerationArgs = cli.group(GenerationArgs())
    optimizer: RLOptimizerArgs = cli.group(RLOptimizerArgs(learning_rate=3e-4))
    evaluation: EvalArgs = cli.group(EvalArgs())
    run: RLRunArgs = cli.group(RLRunArgs())
    lora: LoraArgs = cli.group(LoraArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def best_of_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Row of the highest-scoring sample of each prompt; among tied best samples, the first.
    scores: (prompts * k,) -> (prompts,)"""
    per_prompt = scores.view(-1, k)  # (prompts, k)
    offsets = torch.arange(len(per_prompt), device=scores.device) * k
    return offsets + per_prompt.argmax(dim=1)  # argmax returns the first maximum


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor, step_tokens: float) -> torch.Tensor:
    """Negative log-likelihood summed over real tokens and divided by `step_tokens`
    (common.loss_denominator: every token of the optimizer step weighs the same).  (batch, len)"""
    return -(logprobs * mask).sum() / step_tokens


# Shapes: B prompts per update on this rank (local_batch_size), k samples per prompt, N = B*k rollout
# rows (each prompt's k adjacent), P prompt tokens (left-padded), R response tokens (the batch's longest
# response, at most --response_length).
def main(args: Args):
    rank, world_size = common.init_distributed()
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2 to choose the best of them, got {args.num_samples}")
    local_batch_size, num_updates = common.batch_sizes(args.optimizer, world_size)
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
    ref_policy = lora.reference_policy(args.distributed, ref_policy, policy)  # for the logged KL only
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
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args.generation)  # (N, R), for the logged KL only
        scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task,
                                        args.generation.local_rollout_forward_batch_size, update)  # (N,)
        if args.generation.missing_eos_penalty:  # no stop token: the penalty instead of the score
            scores = torch.where(rollout.contains_eos, scores, args.generation.penalty_reward_value)
        common.check_rewards(scores, update)
        best_rows = best_of_k(scores, k)  # (B,)
        orders = [torch.randperm(local_batch_size) for _ in range(args.optimizer.num_epochs)]  # (B,) prompts each
        # The policy's log-probs under the sampling weights, for the logged KL and entropy: the first
        # optimizer step's forward computes them for its best completions; one forward here for the rest.
        first_rows = best_rows[orders[0][:mini_batch_size]]
        logprobs = common.start_logprobs_but_first_step(policy, rollout, args.generation, first_rows)  # (N, R)
        t2 = time.time()

        # Learn: num_epochs passes over the best completions, each num_mini_batches optimizer steps,
        # each accumulated over gradient_accumulation_steps micro-batches of per_device_train_batch_size.
        losses = []
        for epoch, order in enumerate(orders):
            for step, mini_batch in enumerate(order.split(mini_batch_size)):
                step_tokens = common.loss_denominator(rollout.mask[best_rows[mini_batch]],
                                                      args.optimizer.gradient_accumulation_steps)
                for prompt_ids in mini_batch.split(micro_batch_size):
                    rows = best_rows[prompt_ids]
                    new_logprobs = common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.generation.temperature, args.generation.top_p)  # (prompts, R)
                    common.reuse_first_step_logprobs(logprobs, rows, new_logprobs, epoch, step)
                    loss = nll_loss(new_logprobs, rollout.mask[rows], step_tokens)
                    policy.backward(loss)
                    policy.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    losses.append(loss.item())
        t3 = time.time()

        # Log
        per_prompt = scores.view(-1, k)  # (B, k)
        state.update, state.episode, state.data_position = update, state.episode + batch_size, sampler.position
        metrics = common.all_reduce_mean({
            "loss/policy_avg": sum(losses) / len(losses),
            "objective/best_scores": scores[best_rows].mean().item(),
            "objective/tie_fraction": (per_prompt.max(1).values == per_prompt.min(1).values).float().mean().item(),
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
