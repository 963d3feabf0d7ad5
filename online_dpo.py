"""Online DPO, synchronous: sample k completions per prompt with HF generate, score them with a
reward model, and run a DPO step on (best, worst) pairs. The synchronous baseline of
"Asynchronous RLHF" (Noukhovitch et al., 2024); see SPEC.md for every formula.

    python online_dpo.py                                   # toy task, one CPU process
    deepspeed --num_gpus 2 online_dpo.py                   # two ranks (CPU: add --bind_cores_to_rank)
    deepspeed --num_gpus 4 online_dpo.py --bf16 --model_name_or_path mnoukhov/pythia410m-sft-tldr ...
"""

import functools
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

import common
import toy


@dataclass
class Args:
    # Model and data
    model_name_or_path: str = toy.SFT_POLICY
    """SFT policy to start from; also the frozen reference policy (a local directory or hub id)"""
    reward_model_path: str = toy.REWARD_MODEL
    """proxy reward model (sequence classification, one label) that RL optimises"""
    gold_model_path: str = "toy"
    """gold reward model for evaluation; "toy" is the embedded task's programmatic scorer"""
    dataset_name: str = toy.DATASET
    """prompts: a hub id, a `save_to_disk` directory, a data directory, or a .json/.jsonl/.parquet file"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "validation"
    """split to evaluate on (needs the reference column)"""
    prompt_column: str = "query"
    """column holding the prompt text"""
    reference_column: str = "reference_response"
    """column holding the reference completion that evaluation compares against"""
    chat_template: bool = False
    """wrap each prompt as a user message in the tokenizer's chat template"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens are dropped (the count is printed)"""

    # Generation
    response_length: int = 12
    """new tokens sampled per completion"""
    temperature: float = 0.7
    """sampling temperature; log-probs everywhere use logits / (temperature + 1e-7)"""
    penalty_reward_value: float = -1.0
    """reward given instead of the score to a completion with no stop token"""

    # Algorithm
    num_samples: int = 2
    """k: completions per prompt; DPO trains on the best (chosen) vs the worst (rejected)"""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -logsigmoid(beta * logits); ipo: (logits - 1 / (2 beta))^2"""
    beta: float = 0.1
    """strength of the implicit KL constraint to the reference policy"""
    kl_coef: float = 0.05
    """weight of KL in the logged objective/rlhf_reward (DPO's loss does not use it)"""

    # Optimisation
    total_episodes: int = 4480
    """prompts to train on, over all ranks"""
    per_device_train_batch_size: int = 16
    """prompts (pairs) per micro-batch on each rank"""
    gradient_accumulation_steps: int = 4
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per generated batch; the i-th is i-1 updates off-policy"""
    num_epochs: int = 1
    """passes over each generated batch"""
    learning_rate: float = 1e-4
    """peak learning rate, decayed linearly to 0 (the paper's 3e-6 is for 1B-parameter models)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / scoring forward pass"""

    # Evaluation, logging, checkpoints
    eval_every: int = 10
    """evaluate every this many updates (and before the first and after the last)"""
    eval_num_prompts: int = 256
    """validation prompts used by each evaluation"""
    eval_temperature: float = 0.01
    """near-greedy temperature of evaluation completions (the paper's protocol)"""
    save_every: int = 0
    """write a resumable checkpoint every this many updates (0: never)"""
    output_dir: str | None = None
    """run directory (metrics.jsonl, checkpoints, policy); default runs/<exp_name>__<seed>__<time>"""
    resume: bool = False
    """continue the run in --output_dir from its latest complete checkpoint"""
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

    # Distributed
    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage of the policy (3 also partitions the reference and reward models)"""
    bf16: bool = False
    """train and generate in bfloat16 (GPU runs)"""
    local_rank: int = -1
    """set by the deepspeed launcher"""


def check_args(args: Args, world_size: int) -> tuple[int, int]:
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2 to form a (chosen, rejected) pair, got {args.num_samples}")
    if args.beta <= 0:
        common.fail(f"--beta must be positive, got {args.beta}")
    return common.batch_sizes(args, world_size)


def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size, num_updates = check_args(args, world_size)
    batch_size = local_batch_size * world_size
    if args.output_dir is None:
        if args.resume:
            common.fail("--resume needs --output_dir, the directory of the run to continue")
        args.output_dir = os.path.join("runs", f"{args.exp_name}__{args.seed}__{int(time.time())}")
    if toy.TOY_DIR in (os.path.dirname(args.model_name_or_path), os.path.dirname(args.dataset_name)):
        if rank == 0:
            toy.build()
        torch.distributed.barrier()

    from transformers import AutoModelForCausalLM, get_scheduler

    common.seed_everything(args.seed + rank, args.torch_deterministic)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tokenizer = common.load_tokenizer(args.model_name_or_path)
    eos_ids = common.eos_token_ids(args.model_name_or_path, tokenizer)
    reward_tokenizer = common.load_tokenizer(args.reward_model_path)
    if common.same_vocabulary(tokenizer, reward_tokenizer):
        reward_tokenizer = None  # score token ids directly, no decode / re-encode
    train_prompts = common.load_prompts(args, tokenizer, args.train_split)
    eval_prompts = common.load_prompts(args, tokenizer, args.eval_split, keep_columns=(args.reference_column,))
    eval_prompts = eval_prompts.select(range(min(args.eval_num_prompts, len(eval_prompts))))
    gold_score = common.load_gold_scorer(args.gold_model_path, dtype, tokenizer)
    sampler = common.PromptSampler(len(train_prompts), local_batch_size, rank, world_size, args.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        common.prepare_output_dir(args.output_dir, args.resume)
    torch.distributed.barrier()

    policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
    reward_model = common.load_reward_model(args.reward_model_path, dtype)
    for model in (policy, ref_policy, reward_model):
        common.disable_dropout(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate)
    num_optimizer_steps = num_updates * args.num_epochs * args.num_mini_batches
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=num_optimizer_steps)
    policy = common.prepare_deepspeed(policy, args, optimizer, scheduler)
    ref_policy = common.prepare_deepspeed(ref_policy, args).module
    reward_model = common.prepare_deepspeed(reward_model, args).module

    state = common.OnlineTrainerState()
    if args.resume:
        state = common.load_checkpoint(args.output_dir, policy)
        sampler.position = state.data_position
    logger = common.MetricsLogger(args, os.path.basename(args.output_dir), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "objective/kl", "eval/gold_win_rate"))

    def run_evaluation():
        metrics = common.evaluate(args, policy, ref_policy, reward_model, tokenizer, reward_tokenizer, eos_ids,
                                  eval_prompts, gold_score)
        logger.log(state.update, {**metrics, "episode": state.episode})
        if rank == 0:
            logger.progress.write(f"update {state.update}: gold win-rate {metrics['eval/gold_win_rate']:.3f}, "
                                  f"gold score {metrics['eval/gold_score']:.3f}, KL {metrics['eval/kl']:.3f}")

    if state.update == 0:
        run_evaluation()
    k, pad = args.num_samples, tokenizer.pad_token_id
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: k samples per prompt, truncated after the first stop token, scored.
        t0 = time.time()
        prompts = train_prompts.select(sampler.next_indices())["input_ids"]
        query_ids, query_mask = common.left_pad(prompts, pad)
        query_ids, query_mask = query_ids.repeat_interleave(k, 0), query_mask.repeat_interleave(k, 0)  # (B*k, P)
        chunk = args.local_rollout_forward_batch_size
        with torch.no_grad(), common.full_parameters(policy) as model:
            responses = common.in_chunks(functools.partial(
                common.generate, model, response_length=args.response_length, temperature=args.temperature,
                eos_ids=eos_ids, pad_token_id=pad), chunk, query_ids, query_mask)  # (B*k, R)
        t1 = time.time()
        responses, lengths, contains_eos = common.truncate_after_eos(responses, eos_ids, pad)
        mask = common.response_mask(lengths, args.response_length)  # (B*k, R)
        rollout = (query_ids, query_mask, responses, lengths)
        with torch.no_grad():
            logprobs = common.in_chunks(functools.partial(
                common.response_logprobs, policy, temperature=args.temperature), chunk, *rollout)
            ref_logprobs = common.in_chunks(functools.partial(
                common.response_logprobs, ref_policy, temperature=args.temperature), chunk, *rollout)
            scores = common.in_chunks(functools.partial(
                common.score_responses, reward_model, penalty_reward_value=args.penalty_reward_value,
                policy_tokenizer=tokenizer, reward_tokenizer=reward_tokenizer), chunk, *rollout, contains_eos)
        ref_seq_logps = common.masked_sum(ref_logprobs, mask)  # (B*k,)
        kl = common.masked_sum(logprobs - ref_logprobs, mask)  # (B*k,)

        # Pairs: best vs worst of each prompt's k samples; a prompt whose samples all tie is masked out.
        per_prompt = scores.view(-1, k)  # (B, k)
        offsets = torch.arange(len(per_prompt)) * k
        chosen_rows, rejected_rows = offsets + per_prompt.argmax(1), offsets + per_prompt.argmin(1)  # (B,)
        valid = (per_prompt.max(1).values > per_prompt.min(1).values).float()  # (B,)
        t2 = time.time()

        # Learn: epochs x mini-batches x micro-batches, one optimizer step per mini-batch.
        stats = {name: [] for name in ("loss", "chosen_rewards", "rejected_rewards", "chosen_logps",
                                       "rejected_logps", "valid")}
        for _ in range(args.num_epochs):
            order = torch.randperm(local_batch_size)
            for start in range(0, local_batch_size, args.per_device_train_batch_size):
                pairs = order[start:start + args.per_device_train_batch_size]
                rows = torch.cat([chosen_rows[pairs], rejected_rows[pairs]])
                seq_logps = common.masked_sum(common.response_logprobs(
                    policy, query_ids[rows], query_mask[rows], responses[rows], lengths[rows], args.temperature),
                    mask[rows])
                policy_chosen, policy_rejected = seq_logps.chunk(2)
                ref_chosen, ref_rejected = ref_seq_logps[chosen_rows[pairs]], ref_seq_logps[rejected_rows[pairs]]
                losses = common.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, args.beta,
                                  args.loss_type)
                pair_mask = valid[pairs]
                loss = (losses * pair_mask).sum() / pair_mask.sum().clamp(min=1)
                policy.backward(loss)
                policy.step()  # DeepSpeed steps the optimizer once per gradient_accumulation_steps calls
                stats["loss"].append(losses.detach())
                stats["chosen_rewards"].append(args.beta * (policy_chosen - ref_chosen).detach())
                stats["rejected_rewards"].append(args.beta * (policy_rejected - ref_rejected).detach())
                stats["chosen_logps"].append(policy_chosen.detach())
                stats["rejected_logps"].append(policy_rejected.detach())
                stats["valid"].append(pair_mask)
        t3 = time.time()

        # Log: pair statistics over non-tied pairs only; rollout statistics over every sample.
        stats = {name: torch.cat(values) for name, values in stats.items()}
        pair_valid = stats.pop("valid")
        state.update, state.episode, state.data_position = update, state.episode + batch_size, sampler.position
        metrics = common.all_reduce_mean({
            "loss/policy_avg": common.masked_mean(stats["loss"], pair_valid),
            "rewards/chosen": common.masked_mean(stats["chosen_rewards"], pair_valid),
            "rewards/rejected": common.masked_mean(stats["rejected_rewards"], pair_valid),
            "rewards/accuracies": common.masked_mean(
                (stats["chosen_rewards"] > stats["rejected_rewards"]).float(), pair_valid),
            "rewards/margins": common.masked_mean(stats["chosen_rewards"] - stats["rejected_rewards"], pair_valid),
            "logps/chosen": common.masked_mean(stats["chosen_logps"], pair_valid),
            "logps/rejected": common.masked_mean(stats["rejected_logps"], pair_valid),
            "objective/scores": scores.mean().item(),
            "objective/scores_margin": common.masked_mean(scores[chosen_rows] - scores[rejected_rows], valid),
            "objective/tie_fraction": 1 - valid.mean().item(),
            "objective/kl": kl.mean().item(),
            "objective/entropy": -common.masked_sum(logprobs, mask).mean().item(),
            "objective/rlhf_reward": (scores - args.kl_coef * kl).mean().item(),
            # a count over the whole batch: each rank's count times world_size averages to the sum
            "val/num_eos_tokens": contains_eos.sum().item() * world_size,
            "time/generate": t1 - t0,
            "time/score": t2 - t1,
            "time/train": t3 - t2,
        })
        metrics.update({"lr": policy.get_lr()[0], "episode": state.episode,
                        "eps": (state.episode - start_episode) / (time.time() - start_time)})
        logger.log(update, metrics)
        if update % args.eval_every == 0 or update == num_updates:
            run_evaluation()
        if args.save_every and update % args.save_every == 0:
            common.save_checkpoint(args.output_dir, policy, state)

    common.save_policy(args.output_dir, policy, tokenizer)
    logger.close()
    if rank == 0:
        print(f"saved the policy to {os.path.join(args.output_dir, 'policy')}")


if __name__ == "__main__":
    main(tyro.cli(Args))
