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

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import cli
import common
import data
import evaluation
import inflight
import lora
import toy
import vllm_generator


@dataclass
class Args:
    # Configuration
    preset: str | None = None
    """start from configs/online_dpo_vllm/NAME.yaml, a named configuration (the README lists them); flags override it"""
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

    # Asynchronous generation
    async_steps: int = 1
    """K: how many updates the sampling weights may lag behind the trained weights (0: synchronous)"""
    inflight_updates: bool = False
    """the engine takes each new weight version between two decode steps, keeping the KV of its requests in
    flight, instead of sampling whole batches K updates ahead: a batch is the next prompt groups to finish,
    each token records the version that sampled it (async/token_staleness_*); --async_steps K still bounds how
    far ahead the engine runs (README: In-flight weight updates)"""
    inflight_deterministic: bool = False
    """with --inflight_updates: swap versions at fixed points (the version after update t-K once the batch of
    update t is finished, waiting for it if need be) instead of as soon as each arrives: repeatable, and a run
    killed and resumed from a --save_every checkpoint trains exactly as the uninterrupted one"""
    max_lag: int | None = None
    """with --inflight_updates: drop (and count, async/dropped_groups) each group with a token sampled more than
    this many versions before the weights that would train on it; another group takes its place (default: none
    dropped)"""
    vllm_device: str | None = None
    """device of the vLLM engine: "cpu" (its own cores), "cuda:<i>", or "shared": the single training rank's
    own device (its GPU, or all its cores), engine and trainer taking turns; default: the GPU after this
    node's training GPUs, else cpu. <i> counts the GPUs the ranks see (through an inherited
    CUDA_VISIBLE_DEVICES: under SLURM's "4,5,6,7", cuda:3 is GPU 7); under deepspeed --num_gpus/--include,
    which shows each rank only the training GPUs, it is a physical GPU id"""
    vllm_engines_per_node: int = 1
    """engines on each node, each sampling for an equal share of the node's training ranks (e.g. 6 training GPUs
    and 2 engines: 3 ranks each) on the GPUs after the training ones (from --vllm_device's); on a CPU they share
    the --vllm_cpu_threads cores"""
    vllm_cpu_threads: int = 1
    """CPU only: cores given to the engine (the last ones); the trainer keeps the rest"""
    vllm_cpu_kv_cache_gib: int = 1
    """CPU only: RAM reserved for the engine's KV cache"""
    vllm_gpu_memory_utilization: float | None = None
    """GPU only: share of the engine's GPU memory vLLM may take (weights, activations, KV cache); default: on a
    GPU of its own, all that stays free beside what the generator process holds there (the copy of the policy
    that checks async/logprob_diff, the K+1 weight versions it may receive before loading them, NCCL's
    buffers), rounded down; 0.3 with --vllm_device shared (the rest is the trainer's; there the engine frees
    its memory while the trainer trains). Checked against the GPU's free memory before the engine starts"""
    vllm_enforce_eager: bool = False
    """GPU only: run the engine without CUDA graphs (less memory and a shorter start, slower sampling); an
    engine on a CPU always runs eagerly"""
    logprob_check_every: int = 10
    """check async/logprob_diff on the batch of update 1 and of every this many updates after (1: every batch);
    a check costs the generator about as much as sampling its rows (time/logprob_check)"""
    logprob_check_rows: int = 16
    """rows of each checked batch (the first ones) that async/logprob_diff covers: the generator process
    recomputes their log-probs with the trainer's model code, on the engine's device"""
    max_logprob_diff: float | None = None
    """the most async/logprob_diff (per token) a checked batch right after a weight load may show, or the
    engine did not take the new weights and the run stops; default 1e-3, 0.1 with --bf16 (vLLM's and the
    trainer's bf16 kernels differ more)"""
    engine_start_timeout: float = 1800.0
    """seconds the trainer waits for the vLLM engine to start (it loads the model and warms up) before it
    stops with an error"""
    generator_timeout: float = 600.0
    """seconds the trainer waits for each batch, once the engine has started, before it stops with an error"""

    # LoRA
    use_peft: bool = False
    """train a LoRA adapter (peft) instead of every weight: the reference policy is the same model with the
    adapter switched off (no second copy in memory); checkpoints hold the adapter and its optimizer state;
    policy/ is the adapter; the engine samples from base + adapter, merged out of place into each weight send"""
    lora_r: int = 16
    """LoRA rank r of each adapted layer's update B A"""
    lora_alpha: int = 32
    """LoRA scale: the update is (lora_alpha / lora_r) B A"""
    lora_dropout: float = 0.0
    """dropout on each adapted layer's input to A while the model is in training mode; 0 keeps the policy's
    log-probs the same in every forward (as the kit's dropout-free models do), which async/logprob_diff assumes"""
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
        common.fail(f"--num_samples must be at least 2 to form a (chosen, rejected) pair, got {args.num_samples}")
    if args.beta <= 0:
        common.fail(f"--beta must be positive, got {args.beta}")
    vllm_generator.check_async_args(args, world_size)
    return common.batch_sizes(args, world_size)


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
    rank, world_size = common.init_distributed(vllm_generator.process_group_timeout(args))
    local_batch_size, num_updates = check_args(args, world_size)
    batch_size = local_batch_size * world_size
    common.resolve_output_dir(args)
    common.seed_everything(args.seed + rank, args.torch_deterministic)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    task = data.load_task(args, rank, dtype, evaluation=args.eval_every > 0)
    # the engine samples whole global batches; each rank trains on its share of one
    sampler = data.PromptSampler(len(task.train_prompts), batch_size, 0, 1, args.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        common.prepare_output_dir(args, vllm_generator.RESUME_MAY_CHANGE)
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
    logger = common.MetricsLogger(args, os.path.basename(args.output_dir), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "async/staleness", "eval/gold_win_rate"))
    logger.log(state.update, parameter_counts)
    # The generator process beside rank 0 holds the engine; it starts while the trainer evaluates. A
    # resumed run first trains on the batches its checkpoint had sampled ahead (with older weights),
    # and samples from the checkpoint's weights after them.
    generator = vllm_generator.AsyncGenerator(args, task, sampler, state, num_updates, args.num_samples)
    if state.update == 0 and args.eval_every:
        logger.log_evaluation(0, 0, evaluation.evaluate(args, task, policy, ref_policy, reward_model, 0))
    generator.wait_for_engine()
    if state.update > 0:  # the engine samples from the checkpoint's weights
        generator.publish_weights(policy, state.update)
    k, pad = args.num_samples, task.tokenizer.pad_token_id
    mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps  # prompts per optimizer step
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: this rank's share of the batch the engine sampled for this update, K updates ago
        # with older weights; then the details as in the synchronous twin.
        t0 = time.time()
        batch = generator.batch_for(update)
        prompt_rows = task.train_prompts[batch["prompt_indices"]]  # {column: values}
        query_ids, query_mask = common.left_pad(batch["queries"], pad, policy.device)  # (N, P)
        responses = batch["responses"].to(policy.device)  # (N, R)
        t1 = time.time()
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args)  # (N, R)
        scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task, args, update)  # (N,)
        if args.missing_eos_penalty:  # no stop token: the penalty instead of the score
            scores = torch.where(rollout.contains_eos, scores, args.penalty_reward_value)
        common.check_rewards(scores, update)
        # (N, R) the engine's, under the weights that sampled them
        logprobs = batch["logprobs"][:, :rollout.responses.shape[1]].to(policy.device)
        ref_seq_logps = common.masked_sum(ref_logprobs, rollout.mask)  # (N,)

        # Pairs: best (chosen) vs worst (rejected) of each prompt's k samples.
        chosen_rows, rejected_rows, valid = best_and_worst(scores, k)  # (B,) each
        t2 = time.time()

        # Learn: num_epochs passes over the batch, each num_mini_batches optimizer steps (the i-th
        # trains on data i-1 steps stale), each accumulated over gradient_accumulation_steps
        # micro-batches of per_device_train_batch_size pairs.
        stats = {name: [] for name in ("loss", "chosen_rewards", "rejected_rewards", "chosen_logps",
                                       "rejected_logps", "valid")}
        for _ in range(args.num_epochs):
            order = torch.randperm(local_batch_size)  # (B,) prompts, shuffled
            for mini_batch in order.split(mini_batch_size):
                step_pairs = common.step_share(valid[mini_batch], args)  # non-tied, every rank's
                for pairs in mini_batch.split(args.per_device_train_batch_size):
                    rows = torch.cat([chosen_rows[pairs], rejected_rows[pairs]])
                    seq_logps = common.masked_sum(common.response_logprobs(
                        policy, rollout.query_ids[rows], rollout.query_mask[rows], rollout.responses[rows],
                        rollout.lengths[rows], args.temperature, args.top_p), rollout.mask[rows])
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
            **common.rollout_metrics(args, rollout, logprobs, ref_logprobs, scores),
            "objective/tie_fraction": 1 - valid.mean().item(),
            "time/wait": t1 - t0,
            "time/score": t2 - t1,
            "time/train": t3 - t2,
            "time/weight_send": t4 - t3,  # the trainer waits for it
            "time/weight_sync": t4 - t3 + batch["metrics"]["time/weight_load"],
            # its engine's, averaged over the engines: time/generate, time/weight_load (before the batch), and on
            # checked batches async/logprob_diff and its cost, time/logprob_check
            **batch["metrics"],
        })
        metrics.update({
            "async/staleness": update - 1 - batch["version"],  # updates between sampling and training weights
            "lr": policy.get_lr()[0], "episode": state.episode,
            "eps": (state.episode - start_episode) / (time.time() - start_time)})
        if args.inflight_updates:  # each token's staleness
            metrics |= inflight.inflight_metrics(batch, rollout.mask, update)
        logger.log(update, metrics)
        if args.eval_every and (update % args.eval_every == 0 or update == num_updates):
            logger.log_evaluation(update, state.episode,
                                  evaluation.evaluate(args, task, policy, ref_policy, reward_model, update))
        # a preemption signal (SIGTERM, SIGUSR1) on any rank: checkpoint this update, then exit
        preempted = common.preemption_requested()
        if args.save_every and update % args.save_every == 0:
            common.save_snapshot(args, policy, task.tokenizer, state)
        if preempted or (args.save_every and update % args.save_every == 0):
            # the batches already sampled for the next K updates, with weights this checkpoint no longer
            # has, are saved with it: a resumed run trains on exactly the same samples
            state.pending_batches, state.engine_snapshot = generator.sample_ahead(update)
            common.save_checkpoint(args.output_dir, policy, state)
        if preempted:
            common.exit_preempted(update, logger)

    common.save_policy(args, policy, task.tokenizer, state)
    generator.stop()
    logger.close()


if __name__ == "__main__":
    main(cli.parse(Args))
