"""RLOO: k completions per prompt, each baselined by the mean reward of the other k-1, and a clipped
surrogate on the sequence-level ratio; no value model. One of the baselines of "Asynchronous RLHF"
(Noukhovitch et al., 2024), after Ahmadian et al. (2024); ALGORITHMS.md has every formula.

    python rloo.py                                         # toy task, one CPU process
    deepspeed --num_gpus 2 rloo.py                         # two ranks (CPU: add --bind_cores_to_rank)
    deepspeed --num_gpus 4 rloo.py --bf16 --model_name_or_path mnoukhov/pythia410m-sft-tldr ...
"""

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch

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
    """start from configs/rloo/NAME.yaml, a named configuration (the README lists them); flags override it"""
    config: str | None = None
    """a YAML file of these flags' values (`learning_rate: 3.0e-6` per line), or a run's args.json to repeat
    that run; applied after --preset, and the flags given override it"""

    # Model and data
    model_name_or_path: str = toy.SFT_POLICY
    """SFT policy to start from; also the frozen reference policy (a local directory or hub id)"""
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
    num_samples: int = 2
    """k: completions per prompt; each one's baseline is the mean reward of the other k-1"""
    kl_coef: float = 0.05
    """weight of the sequence KL in the reward: reward = score - kl_coef * sum_t (logp - ref_logp)"""
    cliprange: float = 0.2
    """clip range of the sequence-level policy ratio"""
    off_policy_correction: Literal["none", "decoupled", "tis", "mask"] = "none"
    """how the loss treats samples drawn with other weights than those it trains (ALGORITHMS.md, "Off-policy
    corrections"): none, the ratio against the sampling weights' log-probs; decoupled (AReaL's decoupled PPO, the
    kit's variant), against the weights just before each optimizer step, each term weighted by
    min(pi_those / pi_sampling, --is_cap); tis (truncated importance sampling), against the weights at the
    start of the update, weighted by min(pi_start / pi_sampling, --is_cap); mask (IcePop), the same ratio and
    weight, but terms whose weight lies outside [--is_mask_low, --is_cap] are dropped"""
    is_cap: float | None = None
    """upper bound of the importance weight: default 5 with decoupled (AReaL's), 2 with tis (verl's, slime's), 5
    with mask (IcePop's); with none, the bound that async/is_truncated_frac counts against (2)"""
    is_mask_low: float = 0.5
    """with --off_policy_correction mask, the smallest weight kept (IcePop's 0.5)"""

    # Optimisation
    total_episodes: int = 4480
    """prompts to train on, over all ranks"""
    per_device_train_batch_size: int = 16
    """prompts per micro-batch on each rank (each with its k completions)"""
    gradient_accumulation_steps: int = 4
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over a generated batch; the i-th of the first epoch is i-1 updates off-policy"""
    num_epochs: int = 4
    """passes over each generated batch, prompt order shuffled each time (the reference's num_ppo_epochs)"""
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
        common.fail(f"--num_samples must be at least 2: the leave-one-out baseline needs another sample, "
                    f"got {args.num_samples}")
    return common.batch_sizes(args, world_size)


def leave_one_out_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """A_i = r_i - (sum_j r_j - r_i) / (k - 1) for the rewards r of each prompt's k samples.
    rewards: (prompts * k,) -> (prompts * k,)"""
    per_prompt = rewards.view(-1, k)  # (prompts, k)
    baselines = (per_prompt.sum(dim=1, keepdim=True) - per_prompt) / (k - 1)
    return (per_prompt - baselines).flatten()


def sequence_policy_loss(new_seq_logps, old_seq_logps, advantages, cliprange: float, weights=1.0):
    """Clipped surrogate on the sequence-level ratio exp(sum new_logp - sum old_logp), each sequence's term
    times its importance weight (1, or those of --off_policy_correction: corrections.off_policy_terms), averaged
    over sequences. All inputs (batch,); old: the log-probs the ratio is taken against. Returns (loss,
    clipfrac, ratio)."""
    ratio = torch.exp(new_seq_logps - old_seq_logps)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    return (weights * torch.max(unclipped, clipped)).mean(), (clipped > unclipped).float().mean(), ratio


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

    policy, ref_policy = lora.load_policy(args, dtype)  # ref_policy: None with --use_peft (the adapter off)
    reward_model = None if args.reward_fn else data.load_reward_model(args.reward_model_path, dtype)
    parameter_counts = lora.trainable_parameters(policy)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate)
    num_optimizer_steps = num_updates * args.num_epochs * args.num_mini_batches
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=num_optimizer_steps)
    policy = common.prepare_deepspeed(policy, args, optimizer, scheduler)
    ref_policy = lora.reference_policy(args, ref_policy, policy)
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
        # Rollout: k samples per prompt, then the details in order: truncate after the first stop
        # token, reference log-probs, the reward at the last real token, the missing-EOS penalty.
        t0 = time.time()
        prompt_rows = task.train_prompts[sampler.next_indices()]  # {column: values}
        # query_ids, query_mask: (N, P), left-padded; responses: (N, R)
        query_ids, query_mask, responses = common.sample_responses(policy, prompt_rows["input_ids"], k, args, task,
                                                                   sampler)
        t1 = time.time()
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args)  # (N, R)
        scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task, args, update)  # (N,)
        if args.missing_eos_penalty:  # no stop token: the penalty instead of the score
            scores = torch.where(rollout.contains_eos, scores, args.penalty_reward_value)
        common.check_rewards(scores, update)
        # (N, R) under the sampling weights: the old policy. Not the training forward's: the advantages
        # need them (the KL penalty) for every row before the first one trains
        logprobs = common.rollout_logprobs(policy, rollout, args, args.top_p)
        start_logprobs = logprobs  # the sampler is the trainer, at the start of the update

        # Advantages: the KL-penalised sequence reward, baselined by the other samples of its prompt.
        kl = common.masked_sum(logprobs - ref_logprobs, rollout.mask)  # (N,)
        advantages = leave_one_out_advantages(scores - args.kl_coef * kl, k)  # (N,)
        t2 = time.time()

        # Learn: num_epochs passes over the batch, each num_mini_batches optimizer steps (the i-th
        # trains on data i-1 steps stale), each accumulated over gradient_accumulation_steps
        # micro-batches of per_device_train_batch_size prompts with all their k samples.
        stats = {name: [] for name in ("loss", "clipfrac", "approxkl", "ratio", "off_policy")}
        for _ in range(args.num_epochs):
            order = torch.randperm(local_batch_size)  # (B,) prompts, shuffled
            for mini_batch in order.split(mini_batch_size):
                for prompt_ids in mini_batch.split(args.per_device_train_batch_size):
                    rows = (prompt_ids[:, None] * k + torch.arange(k)).flatten()  # each prompt's k samples
                    new_logprobs = common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.temperature, args.top_p)  # (n, R)
                    old_logprobs, weights, diagnostics = corrections.off_policy_terms(
                        new_logprobs, logprobs[rows], start_logprobs[rows], rollout.mask[rows], args)
                    new_seq_logps = common.masked_sum(new_logprobs, rollout.mask[rows])  # (n,)
                    old_seq_logps = common.masked_sum(old_logprobs, rollout.mask[rows])
                    loss, clipfrac, ratio = sequence_policy_loss(new_seq_logps, old_seq_logps, advantages[rows],
                                                                 args.cliprange, weights.flatten())
                    policy.backward(loss)
                    policy.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["loss"].append(loss.item())
                    stats["clipfrac"].append(clipfrac.item())
                    stats["approxkl"].append(0.5 * ((new_seq_logps.detach() - old_seq_logps) ** 2).mean().item())
                    stats["off_policy"].append(diagnostics)
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
            "val/ratio": ratios.mean().item(),
            "val/ratio_var": ratios.var().item(),
            **off_policy,
            **common.rollout_metrics(args, rollout, logprobs, ref_logprobs, scores),
            "time/generate": t1 - t0,
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
