"""Asynchronous PPO: a vLLM engine samples batch t+1 while the trainer learns on batch t. ppo.py is
its synchronous twin (`diff ppo.py ppo_vllm.py` shows only the asynchronous part) and ALGORITHMS.md
has every formula.

Batch t is sampled with exactly the weights after update t-1-K (`--async_steps K`; 0 is synchronous).
The clipped per-token ratios are taken against the log-probs of the weights that sampled the batch:
the engine's, which async/logprob_diff checks against the trainer's model under the same weights.

    python ppo_vllm.py                                         # toy task: trainer on one core, vLLM on the other
    python ppo_vllm.py --vllm_device shared --async_steps 0    # one device, engine and trainer taking turns
    deepspeed --num_gpus 3 ppo_vllm.py --bf16 ...              # GPU node: 3 training GPUs, vLLM on cuda:3
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
import inflight
import lora
import toy
import vllm_generator


@dataclass
class Args:
    # Configuration
    preset: str | None = None
    """start from configs/ppo_vllm/NAME.yaml, a named configuration (the README lists them); flags override it"""
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
    value_model_path: str | None = None
    """value model: a one-label decoder classifier with the policy's vocabulary; default: the reward model
    (as in the paper), or with --reward_fn the policy with a fresh scalar head"""
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
    off_policy_correction: Literal["none", "decoupled", "tis", "mask"] = "none"
    """how the loss treats samples drawn with other weights than those it trains (ALGORITHMS.md, "Off-policy
    corrections"): none, the ratio against the sampling weights' log-probs; decoupled (AReaL's decoupled PPO, the
    kit's variant), against the weights just before each optimizer step, each term weighted by
    min(pi_those / pi_sampling, --is_cap); tis (truncated importance sampling), against the weights at the
    start of the update, weighted by min(pi_start / pi_sampling, --is_cap); mask (IcePop), the same ratio and
    weight, but terms whose weight lies outside [--is_mask_low, --is_cap] are dropped"""
    is_level: Literal["token", "sequence"] = "token"
    """importance weights per token, or per completion (sequence: exp of its summed log-ratio, on every token)"""
    is_cap: float | None = None
    """upper bound of the importance weight: default 5 with decoupled (AReaL's), 2 with tis (verl's, slime's), 5
    with mask (IcePop's); with none, the bound that async/is_truncated_frac counts against (2)"""
    is_mask_low: float = 0.5
    """with --off_policy_correction mask, the smallest weight kept (IcePop's 0.5)"""
    cliprange_value: float = 0.2
    """clip range of the value prediction around the rollout's value"""
    vf_coef: float = 0.1
    """weight of the value loss: loss = policy loss + vf_coef * value loss"""

    # Optimisation
    total_episodes: int = 4480
    """prompts to train on, over all ranks"""
    per_device_train_batch_size: int = 16
    """completions per micro-batch on each rank"""
    gradient_accumulation_steps: int = 4
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per epoch over a generated batch; the i-th of the first epoch is i-1 updates off-policy"""
    num_epochs: int = 4
    """passes over each generated batch, prompt order shuffled each time (the reference's num_ppo_epochs)"""
    learning_rate: float = 3e-5
    """peak learning rate of policy and value model, decayed linearly to 0"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (over policy and value model together)"""
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
    policy/ is the adapter. The value model trains a LoRA adapter of its own (same flags) and its value head in
    full. The engine samples from base + adapter, merged out of place into each weight send"""
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
    """DeepSpeed ZeRO stage of policy and value model (3 also partitions the reference and reward models;
    2 on a single rank runs as stage 0: nothing to partition)"""
    bf16: bool = False
    """train and generate in bfloat16 (GPU runs)"""
    local_rank: int = -1
    """set by the deepspeed launcher"""


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
    (at the temperature) of each response token, from the positions that predicted it.  Each (batch, response_len)."""
    inputs, mask = common.response_inputs(query_ids, query_mask, responses, lengths)
    logits, values = model(**inputs)
    start = query_ids.shape[1] - 1
    logprobs = common.logprobs_from_logits(logits[:, start:-1], responses, temperature, top_p)
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


def policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange: float, step_tokens: float, weights=1.0):
    """Clipped surrogate on per-token ratios, each term times its importance weight (1, or those of
    --off_policy_correction: corrections.off_policy_terms), summed over real tokens and divided by
    `step_tokens` (common.step_share: every token of the optimizer step weighs the same); old: the
    log-probs the ratio is taken against. Returns (loss, clipfrac, ratio)."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
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
    rank, world_size = common.init_distributed(vllm_generator.process_group_timeout(args))
    vllm_generator.check_async_args(args, world_size)
    local_batch_size, num_updates = common.batch_sizes(args, world_size)
    batch_size = local_batch_size * world_size
    common.resolve_output_dir(args)
    common.seed_everything(args.seed + rank, args.torch_deterministic)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    task = data.load_task(args, rank, dtype, evaluation=args.eval_every > 0)
    data.check_value_model(args, task)
    # the engine samples whole global batches; each rank trains on its share of one
    sampler = data.PromptSampler(len(task.train_prompts), batch_size, 0, 1, args.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        common.prepare_output_dir(args, vllm_generator.RESUME_MAY_CHANGE)
    torch.distributed.barrier()

    from transformers import get_scheduler

    policy, ref_policy = lora.load_policy(args, dtype)  # ref_policy: None with --use_peft (the adapter off)
    value_model = data.load_value_model(args, dtype)
    if args.use_peft:  # a LoRA adapter of its own, and its value head (peft's modules_to_save) in full
        value_model = lora.with_lora(value_model, args, "SEQ_CLS").get_base_model()
    reward_model = None if args.reward_fn else data.load_reward_model(args.reward_model_path, dtype)
    agent = PolicyAndValue(policy, value_model)
    parameter_counts = lora.trainable_parameters(agent)
    optimizer = torch.optim.AdamW([p for p in agent.parameters() if p.requires_grad], lr=args.learning_rate)
    num_optimizer_steps = num_updates * args.num_epochs * args.num_mini_batches
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=num_optimizer_steps)
    agent = common.prepare_deepspeed(agent, args, optimizer, scheduler)
    ref_policy = lora.reference_policy(args, ref_policy, agent, part="policy")
    if reward_model is not None:  # none with --reward_fn
        reward_model = common.prepare_deepspeed(reward_model, args).module

    state = common.OnlineTrainerState()
    if args.resume:
        state = common.load_checkpoint(args.output_dir, agent)
    logger = common.MetricsLogger(args, os.path.basename(args.output_dir), num_updates, state.update,
                                  ("loss/policy_avg", "objective/scores", "async/staleness", "eval/gold_win_rate"))
    logger.log(state.update, parameter_counts)
    # The generator process beside rank 0 holds the engine; it starts while the trainer evaluates. A
    # resumed run first trains on the batches its checkpoint had sampled ahead (with older weights),
    # and samples from the checkpoint's weights after them.
    generator = vllm_generator.AsyncGenerator(args, task, sampler, state, num_updates, 1)
    if state.update == 0 and args.eval_every:
        logger.log_evaluation(0, 0, evaluation.evaluate(args, task, agent, ref_policy, reward_model, 0, part="policy"))
    generator.wait_for_engine()
    if state.update > 0:  # the engine samples from the checkpoint's weights
        generator.publish_weights(agent, state.update, part="policy")
    pad = task.tokenizer.pad_token_id
    mini_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps  # prompts per optimizer step
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: this rank's share of the batch the engine sampled for this update, K updates ago
        # with older weights; then the details as in the synchronous twin.
        t0 = time.time()
        batch = generator.batch_for(update)
        prompt_rows = task.train_prompts[batch["prompt_indices"]]  # {column: values}
        query_ids, query_mask = common.left_pad(batch["queries"], pad, agent.device)  # (B, P)
        responses = batch["responses"].to(agent.device)  # (B, R)
        t1 = time.time()
        rollout = common.truncate_rollout(query_ids, query_mask, responses, task)
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args)  # (B, R)
        scores = common.rollout_rewards(reward_model, rollout, prompt_rows, task, args, update)  # (B,)
        if args.missing_eos_penalty:  # no stop token: the penalty instead of the score
            scores = torch.where(rollout.contains_eos, scores, args.penalty_reward_value)
        common.check_rewards(scores, update)
        rows = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.lengths)
        with torch.no_grad():  # the values of the sampled tokens, and their log-probs at the start of the update
            start_logprobs, values, _ = common.in_chunks(
                lambda *chunk: forward_responses(agent, *chunk, args.temperature, args.top_p),
                args.local_rollout_forward_batch_size, *rows)  # (B, R)
        # (B, R) the old policy's: the engine's log-probs under the weights that sampled the batch, which the
        # trainer no longer holds when K > 0 (async/logprob_diff shows they equal its model's)
        logprobs = batch["logprobs"][:, :rollout.responses.shape[1]].to(agent.device)

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
        for _ in range(args.num_epochs):
            order = torch.randperm(local_batch_size)  # (B,) prompts, shuffled
            for mini_batch in order.split(mini_batch_size):
                step_tokens = common.step_share(mask[mini_batch], args)
                for micro_batch in mini_batch.split(args.per_device_train_batch_size):
                    new_logprobs, new_values, entropy = forward_responses(
                        agent, *(tensor[micro_batch] for tensor in rows), args.temperature, args.top_p)
                    micro_mask = mask[micro_batch]
                    old_logprobs, weights, diagnostics = corrections.off_policy_terms(
                        new_logprobs, logprobs[micro_batch], start_logprobs[micro_batch], micro_mask, args)
                    pg_loss, pg_clipfrac, ratio = policy_loss(new_logprobs, old_logprobs, advantages[micro_batch],
                                                              micro_mask, args.cliprange, step_tokens, weights)
                    stats["off_policy"].append(diagnostics)
                    vf_loss, vf_clipfrac = value_loss(new_values, values[micro_batch], returns[micro_batch],
                                                      micro_mask, args.cliprange_value, step_tokens)
                    agent.backward(pg_loss + args.vf_coef * vf_loss)
                    agent.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["pg_loss"].append(pg_loss.item())
                    stats["vf_loss"].append(vf_loss.item())
                    stats["pg_clipfrac"].append(pg_clipfrac.item())
                    stats["vf_clipfrac"].append(vf_clipfrac.item())
                    stats["approxkl"].append(0.5 * common.masked_mean((new_logprobs - old_logprobs).detach() ** 2,
                                                                      micro_mask))
                    stats["entropy"].append(common.masked_mean(entropy.detach(), micro_mask))
                    stats["ratio"].append(ratio.detach()[micro_mask.bool()])
        t3 = time.time()

        # Weight sync: the new policy weights to the engine, in memory, announced by version number.
        generator.publish_weights(agent, update, part="policy")
        t4 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items()}
        # the generator has drawn ahead; the trainer has consumed exactly one global batch per update
        state.update, state.episode, state.data_position = update, state.episode + batch_size, update
        metrics = common.all_reduce_mean({
            "policy/approxkl_avg": stats["approxkl"],
            "policy/clipfrac_avg": stats["pg_clipfrac"],
            "policy/entropy_avg": stats["entropy"],
            "loss/policy_avg": stats["pg_loss"],
            "loss/value_avg": stats["vf_loss"],
            "val/clipfrac_avg": stats["vf_clipfrac"],
            "val/ratio": ratios.mean().item(),
            "val/ratio_var": ratios.var().item(),
            **off_policy,
            **common.rollout_metrics(args, rollout, logprobs, ref_logprobs, scores),
            "objective/non_score_reward": non_score_reward,
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
            "lr": agent.get_lr()[0], "episode": state.episode,
            "eps": (state.episode - start_episode) / (time.time() - start_time)})
        if args.inflight_updates:  # each token's staleness
            metrics |= inflight.inflight_metrics(batch, rollout.mask, update)
        logger.log(update, metrics)
        if args.eval_every and (update % args.eval_every == 0 or update == num_updates):
            eval_metrics = evaluation.evaluate(args, task, agent, ref_policy, reward_model, update, part="policy")
            logger.log_evaluation(update, state.episode, eval_metrics)
        # a preemption signal (SIGTERM, SIGUSR1) on any rank: checkpoint this update, then exit
        preempted = common.preemption_requested()
        if args.save_every and update % args.save_every == 0:
            common.save_snapshot(args, agent, task.tokenizer, state, part="policy")
        if preempted or (args.save_every and update % args.save_every == 0):
            # the batches already sampled for the next K updates, with weights this checkpoint no longer
            # has, are saved with it: a resumed run trains on exactly the same samples
            state.pending_batches, state.engine_snapshot = generator.sample_ahead(update)
            common.save_checkpoint(args.output_dir, agent, state)
        if preempted:
            common.exit_preempted(update, logger)

    common.save_policy(args, agent, task.tokenizer, state, part="policy")
    generator.stop()
    logger.close()


if __name__ == "__main__":
    main(cli.parse(Args))
