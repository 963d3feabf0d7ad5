"""Asynchronous online DPO: a vLLM engine samples batch t+1 while the trainer learns on batch t.
The method of "Asynchronous RLHF" (Noukhovitch et al., 2024); online_dpo.py is its synchronous
twin (`diff online_dpo.py online_dpo_vllm.py` shows only the asynchronous part) and ALGORITHMS.md
has every formula.

Batch t is sampled with exactly the weights after update t-1-K (`--async_steps K`): K=0 is
synchronous, K=1 the paper's setting (every batch after the first is one update stale). The
staleness of each batch is measured from the weight version that produced it and logged.

    python online_dpo_vllm.py                                  # toy task: trainer on one core, vLLM on the other
    deepspeed --num_gpus 2 online_dpo_vllm.py --vllm_cpu_threads 1   # two CPU training ranks, one engine
    deepspeed --num_gpus 3 online_dpo_vllm.py --bf16 ...       # GPU node: 3 training GPUs, vLLM on cuda:3
"""

import functools
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import async_generator
import cli
import common
import data
import evaluation
import inflight
import lora
import outputs
import rollouts
import vllm_generator
from cli import ConfigFiles
from common import DistributedArgs, GenerationArgs, RLOptimizerArgs
from data import DataArgs, RewardArgs
from evaluation import EvalArgs
from lora import LoraArgs
from outputs import RLRunArgs
from vllm_generator import AsyncArgs
from vllm_placement import EngineArgs


@dataclass
class Args:
    """Asynchronous online DPO's own flags; the groups below hold the flags every RL script shares, each declared in the
    module that reads it"""

    num_samples: int = 2
    """k: completions per prompt; DPO trains on the best (chosen) vs the worst (rejected)"""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -logsigmoid(beta * logits); ipo: (logits - 1 / (2 beta))^2"""
    beta: float = 0.1
    """strength of the implicit KL constraint to the reference policy"""
    kl_coef: float = 0.05
    """weight of KL in the logged objective/rlhf_reward (DPO's loss does not use it)"""

    # the flags every RL script shares, by kind (flat names on the command line: --learning_rate)
    data: DataArgs = cli.group(DataArgs())
    reward: RewardArgs = cli.group(RewardArgs())
    generation: GenerationArgs = cli.group(GenerationArgs())
    optimizer: RLOptimizerArgs = cli.group(RLOptimizerArgs())
    evaluation: EvalArgs = cli.group(EvalArgs())
    run: RLRunArgs = cli.group(RLRunArgs())
    lora: LoraArgs = cli.group(LoraArgs())
    asynchronous: AsyncArgs = cli.group(AsyncArgs())
    vllm: EngineArgs = cli.group(EngineArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def check_args(args: Args, world_size: int) -> tuple[int, int]:
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2 to form a (chosen, rejected) pair, got {args.num_samples}")
    if args.beta <= 0:
        common.fail(f"--beta must be positive, got {args.beta}")
    async_generator.check_flags(args.asynchronous, args.vllm, world_size)
    return common.batch_sizes(args.optimizer, world_size)


def best_and_worst(scores: torch.Tensor, k: int):
    """Rows of the highest- (chosen) and lowest-scoring (rejected) sample of each prompt's k, the first
    among equals, and whether the two differ: a prompt whose samples all tie has no preference and is
    left out of the loss.  scores: (prompts * k,) -> chosen_rows, rejected_rows, valid: (prompts,) each"""
    per_prompt = scores.view(-1, k)  # (prompts, k)
    offsets = torch.arange(len(per_prompt), device=scores.device) * k
    valid = (per_prompt.max(1).values > per_prompt.min(1).values).float()
    return offsets + per_prompt.argmax(1), offsets + per_prompt.argmin(1), valid


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, loss_type: str):
    """Per-pair DPO loss on sequence log-prob sums.  All inputs: (pairs,)

    logits = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)); sigmoid: -logsigmoid(beta * logits),
    ipo: (logits - 1 / (2 beta))^2.
    """
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * logits)
    return (logits - 1 / (2 * beta)) ** 2


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
    logger = outputs.MetricsLogger(args.run, cli.flag_values(args), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "async/staleness", "eval/gold_win_rate"))
    logger.log(state.update, parameter_counts)
    # The generator process beside rank 0 holds the engine; it starts while the trainer evaluates. A
    # resumed run first trains on the batches its checkpoint had sampled ahead (with older weights),
    # and samples from the checkpoint's weights after them: whole batches, or in flight.
    source = rollouts.SamplePrompts.of(task, args.data, args.generation, args.distributed.bf16, sampler,
                                             args.num_samples, args.evaluation)
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
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args.generation)  # (N, R)
        scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task,
                                        args.generation.local_rollout_forward_batch_size, update)  # (N,)
        if args.generation.missing_eos_penalty:  # no stop token: the penalty instead of the score
            scores = torch.where(rollout.contains_eos, scores, args.generation.penalty_reward_value)
        common.check_rewards(scores, update)
        # (N, R) the engine's, under the weights that sampled them
        logprobs = batch.logprobs[:, :rollout.responses.shape[1]].to(policy.device)
        ref_seq_logps = common.masked_sum(ref_logprobs, rollout.mask)  # (N,)

        # Pairs: best (chosen) vs worst (rejected) of each prompt's k samples.
        chosen_rows, rejected_rows, valid = best_and_worst(scores, k)  # (B,) each
        t2 = time.time()

        # Learn: num_epochs passes over the batch, each num_mini_batches optimizer steps (the i-th
        # trains on data i-1 steps stale), each accumulated over gradient_accumulation_steps
        # micro-batches of per_device_train_batch_size pairs.
        stats = {name: [] for name in ("loss", "chosen_rewards", "rejected_rewards", "chosen_logps",
                                       "rejected_logps", "valid")}
        for _ in range(args.optimizer.num_epochs):
            order = torch.randperm(local_batch_size)  # (B,) prompts, shuffled
            for mini_batch in order.split(mini_batch_size):
                # the step's non-tied pairs, every rank's
                step_pairs = common.loss_denominator(valid[mini_batch], args.optimizer.gradient_accumulation_steps)
                for pairs in mini_batch.split(micro_batch_size):
                    rows = torch.cat([chosen_rows[pairs], rejected_rows[pairs]])
                    seq_logps = common.masked_sum(common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.generation.temperature, args.generation.top_p), rollout.mask[rows])
                    policy_chosen, policy_rejected = seq_logps.chunk(2)
                    ref_chosen, ref_rejected = ref_seq_logps[chosen_rows[pairs]], ref_seq_logps[rejected_rows[pairs]]
                    losses = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta,
                                      args.loss_type)
                    pair_mask = valid[pairs]
                    loss = (losses * pair_mask).sum() / step_pairs
                    policy.backward(loss)
                    policy.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["loss"].append(losses.detach())
                    stats["chosen_rewards"].append(args.beta * (policy_chosen - ref_chosen).detach())
                    stats["rejected_rewards"].append(args.beta * (policy_rejected - ref_rejected).detach())
                    stats["chosen_logps"].append(policy_chosen.detach())
                    stats["rejected_logps"].append(policy_rejected.detach())
                    stats["valid"].append(pair_mask)
        t3 = time.time()

        # Weight sync: the new weights to the engine, in memory, announced by version number.
        generator.publish_weights(policy, update)
        t4 = time.time()

        # Log: pair statistics over non-tied pairs only; rollout statistics over every sample.
        stats = {name: torch.cat(values) for name, values in stats.items()}
        pair_valid = stats.pop("valid")
        # the generator has drawn ahead; the trainer has consumed exactly one global batch per update
        state.update, state.episode, state.data_position = update, state.episode + batch_size, update
        metrics = common.all_reduce_masked_means({
            "loss/policy_avg": stats["loss"],
            "rewards/chosen": stats["chosen_rewards"],
            "rewards/rejected": stats["rejected_rewards"],
            "rewards/accuracies": (stats["chosen_rewards"] > stats["rejected_rewards"]).float(),
            "rewards/margins": stats["chosen_rewards"] - stats["rejected_rewards"],
            "logps/chosen": stats["chosen_logps"],
            "logps/rejected": stats["rejected_logps"],
        }, pair_valid)
        metrics |= common.all_reduce_masked_means(
            {"objective/scores_margin": scores[chosen_rows] - scores[rejected_rows]}, valid)
        metrics |= common.all_reduce_mean({
            **common.rollout_metrics(rollout, logprobs, ref_logprobs, scores, args.kl_coef),
            "objective/tie_fraction": 1 - valid.mean().item(),
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
