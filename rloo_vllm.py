"""Asynchronous RLOO: a vLLM engine samples batch t+1 while the trainer learns on batch t. rloo.py is
its synchronous twin (`diff rloo.py rloo_vllm.py` shows only the asynchronous part) and ALGORITHMS.md
has every formula.

Batch t is sampled with exactly the weights after update t-1-K (`--async_steps K`; 0 is synchronous).
The clipped ratio is taken against the log-probs of the weights that sampled the batch: the engine's,
which async/logprob_diff checks against the trainer's model under the same weights.

    python rloo_vllm.py                                        # toy task: trainer on one core, vLLM on the other
    python rloo_vllm.py --vllm_device shared --async_steps 0   # one device, engine and trainer taking turns
    deepspeed --num_gpus 3 rloo_vllm.py --bf16 ...             # GPU node: 3 training GPUs, vLLM on cuda:3
"""

import functools
import time
from dataclasses import dataclass

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
from corrections import CorrectionArgs
from data import DataArgs, RewardArgs
from evaluation import EvalArgs
from lora import LoraArgs
from outputs import RLRunArgs
from vllm_generator import AsyncArgs
from vllm_placement import EngineArgs


@dataclass
class Args:
    """Asynchronous RLOO's own flags; the groups below hold the flags every RL script shares, each declared in the
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
    asynchronous: AsyncArgs = cli.group(AsyncArgs())
    vllm: EngineArgs = cli.group(EngineArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def check_args(args: Args, world_size: int) -> tuple[int, int]:
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2: the leave-one-out baseline needs another sample, "
                    f"got {args.num_samples}")
    async_generator.check_flags(args.asynchronous, args.vllm, world_size)
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

        # Advantages: the KL-penalised sequence reward, baselined by the other samples of its prompt.
        kl = common.masked_sum(logprobs - ref_logprobs, rollout.mask)  # (N,)
        advantages = leave_one_out_advantages(scores - args.kl_coef * kl, k)  # (N,)
        t2 = time.time()

        # Learn: num_epochs passes over the batch, each num_mini_batches optimizer steps (the i-th
        # trains on data i-1 steps stale), each accumulated over gradient_accumulation_steps
        # micro-batches of per_device_train_batch_size prompts with all their k samples.
        stats = {name: [] for name in ("loss", "clipfrac", "approxkl", "entropy", "ratio", "off_policy")}
        for epoch, order in enumerate(orders):
            for step, mini_batch in enumerate(order.split(mini_batch_size)):
                for prompt_ids in mini_batch.split(micro_batch_size):
                    rows = (prompt_ids[:, None] * k + torch.arange(k)).flatten()  # each prompt's k samples
                    new_logprobs, entropy = common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.generation.temperature, args.generation.top_p,
                        entropy=True)  # (n, R) each
                    entropy = entropy.detach()  # logged only: its graph, (n, R, vocab), goes before the backward
                    common.reuse_first_step_logprobs(start_logprobs, rows, new_logprobs, epoch, step)
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

        # Weight sync: the new weights to the engine, in memory, announced by version number.
        generator.publish_weights(policy, update)
        t4 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items()}
        # the generator has drawn ahead; the trainer has consumed exactly one global batch per update
        state.update, state.episode, state.data_position = update, state.episode + batch_size, update
        metrics = common.all_reduce_mean({
            "loss/policy_avg": stats["loss"],
            "policy/clipfrac_avg": stats["clipfrac"],
            "policy/approxkl_avg": stats["approxkl"],
            "policy/entropy_avg": stats["entropy"],
            "val/ratio": ratios.mean().item(),
            "val/ratio_var": ratios.var().item(),
            **off_policy,
            **common.rollout_metrics(rollout, logprobs, ref_logprobs, scores, args.kl_coef),
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
