"""GRPO over several turns of an environment: a group is k episodes from the same initial state (a dataset row and
a reset seed), each episode's return the reward of all its tokens; the policy's tokens are trained, the
environment's are masked out of the loss. A copy of grpo.py with the rollout made a turn loop
(`diff grpo.py grpo_multiturn.py`); ALGORITHMS.md has every formula, README "Multi-turn environments" the
environment contract (environments.py reads it).

    python grpo_multiturn.py                                     # guess-the-number (toy), one CPU process
    python grpo_multiturn.py --env my_env.py:MyEnv --model_name_or_path ... --dataset_name ... --chat_template
    deepspeed --num_gpus 2 grpo_multiturn.py                     # two ranks (CPU: add --bind_cores_to_rank)
"""

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch

import cli
import common
import corrections
import data
import environments
import evaluation
import lora
import outputs
import toy
from cli import ConfigFiles
from common import DistributedArgs, GenerationArgs, RLOptimizerArgs
from corrections import TokenCorrectionArgs
from data import DatasetArgs
from environments import EnvArgs
from evaluation import SamplingEvalArgs
from lora import LoraArgs
from outputs import RLRunArgs


@dataclass
class Args:
    """Multi-turn GRPO's own flags; the groups below hold the flags every RL script shares, each declared in the
    module that reads it"""

    num_samples: int = 4
    """k: episodes per initial state (row and reset seed), the group whose returns make each one's advantage"""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] = "dapo"
    """how the per-token losses are averaged (TRL's names): grpo, per sequence then over sequences; dr_grpo,
    summed and divided by rows x --max_episode_tokens; dapo, over every completion token of the optimizer step,
    all ranks; bnpo, over the tokens of each micro-batch; cispo, dapo's average of the REINFORCE loss
    -sg(min(ratio, --epsilon_high)) A logp (the ratio clipped, not the update)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage = reward - its group's mean, divided by the group's std (group), the whole batch's (batch),
    or nothing (none: Dr. GRPO); each std plus 1e-4"""
    turn_advantage: Literal["episode", "reward_to_go", "turn_index_norm", "unbiased", "gigpo"] = "episode"
    """how credit goes to each turn (ALGORITHMS.md, "Credit per turn"), each turn's advantage on its own tokens:
    episode, every turn its episode's return against its group's (--scale_rewards); reward_to_go, its discounted
    return from that turn on (--gamma) against the group's mean at the same turn index; turn_index_norm, the
    return-to-go of the turn rewards normalised per turn index across the group (as several papers do; biased where
    the policy decides when to stop); unbiased, against the mean of the group's other episodes at that turn;
    gigpo, GiGPO's episode advantage plus a step advantage among the group's turns that start from the same
    environment state (the environment's state_key())"""
    gamma: float = 1.0
    """the discount of later turns' rewards in a turn's return-to-go (every --turn_advantage but episode)"""
    epsilon: float = 0.2
    """the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """upper clip of the ratio, 1 + epsilon_high (default: --epsilon; DAPO's clip-higher: 0.28); with cispo
    the cap of the ratio itself (e.g. 5.0)"""
    delta: float | None = None
    """two-sided clipping: the unclipped ratio is also capped at delta (> 1 + epsilon_high), bounding the loss
    of negative advantages"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio per token; sequence (GSPO): one per episode, exp of the mean log-ratio of the policy's tokens"""
    mask_truncated_completions: bool = False
    """truncated episodes (by --max_turns or --max_episode_tokens) leave the loss (their returns still count in
    their group's baseline)"""
    beta: float = 0.0
    """weight of a per-token KL penalty to the reference policy in the loss; 0 loads no reference policy at
    all (then no KL is logged, in training or evaluation)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator of --beta, r = ref_logp - logp: k1 -r, k2 r^2 / 2, k3 exp(r) - r - 1"""
    entropy_coef: float = 0.0
    """weight of an entropy bonus: the loss minus entropy_coef times the policy's mean token entropy"""

    # the flags every RL script shares, by kind (flat names on the command line: --learning_rate)
    env: EnvArgs = cli.group(EnvArgs())
    data: DatasetArgs = cli.group(DatasetArgs(model_name_or_path=toy.GUESS_POLICY, dataset_name=toy.GUESS_DATASET))
    generation: GenerationArgs = cli.group(GenerationArgs(response_length=4))  # a turn's tokens
    optimizer: RLOptimizerArgs = cli.group(RLOptimizerArgs(per_device_train_batch_size=8, learning_rate=1e-4,
                                                           total_episodes=1280))
    evaluation: SamplingEvalArgs = cli.group(SamplingEvalArgs())
    run: RLRunArgs = cli.group(RLRunArgs())
    corrections: TokenCorrectionArgs = cli.group(TokenCorrectionArgs())
    lora: LoraArgs = cli.group(LoraArgs())
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def check_args(args: Args, world_size: int) -> tuple[int, int]:
    if args.num_samples < 2:
        common.fail(f"--num_samples must be at least 2: a group's advantages need another sample, "
                    f"got {args.num_samples}")
    if not 0 < args.epsilon < 1:
        common.fail(f"--epsilon must be in (0, 1): the ratio is clipped below at 1 - epsilon, "
                    f"got {args.epsilon}")
    common.check_signs(args, (), ("beta", "entropy_coef"))
    if args.loss_type == "cispo" and (args.epsilon_high is None or args.epsilon_high <= 1):
        common.fail(f"--loss_type cispo caps the ratio itself at --epsilon_high, which must be above 1 (e.g. 5.0), "
                    f"got {args.epsilon_high}")
    if args.epsilon_high is not None and args.epsilon_high <= 0:
        common.fail(f"--epsilon_high must be positive (the ratio's upper clip is 1 + epsilon_high), "
                    f"got {args.epsilon_high}")
    if not 0 < args.gamma <= 1:
        common.fail(f"--gamma must be in (0, 1], got {args.gamma}")
    if args.gamma != 1 and args.turn_advantage == "episode":
        common.fail(f"--gamma {args.gamma} discounts the turns' returns-to-go: it applies to --turn_advantage "
                    "reward_to_go, turn_index_norm, unbiased or gigpo, not to episode")
    if args.delta is not None and args.delta <= 1 + upper_clip(args):
        common.fail(f"--delta caps the unclipped ratio above its clip, so it must exceed 1 + epsilon_high = "
                    f"{1 + upper_clip(args):g}, got {args.delta}")
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


def play_episodes(model, task: environments.EnvTask, rows: dict, seeds: list[int], k: int, args, temperature: float,
                  seed_key: str, first_row: int) -> environments.Episodes:
    """k episodes of each row ({column: values}) from its reset seed, each row's k adjacent, played by `model` (a
    policy whose parameters are whole) to their end: done, --max_turns, or the context limit. Every turn, the
    episodes still playing sample a turn each (at `temperature`), the environments step on them concurrently, and
    each turn and reply is appended as tokens (environments.EpisodeLoop). `seed_key`, `first_row`: the sampling's
    seeds (environments.sample_actions)."""
    env, generation = args.env, args.generation
    loop = environments.EpisodeLoop(task, env)
    episodes = loop.start(rows, seeds, k, first_row)

    def sample_turn(episodes: list[environments.Episode], turn: int) -> list:  # a Turn per episode still playing
        return environments.sample_actions(model, episodes, task, generation.response_length, env.max_episode_tokens,
                                           temperature, generation.top_p, generation.local_rollout_forward_batch_size,
                                           f"{seed_key}/{turn}", first_row)

    loop.play_turn_by_turn(episodes, sample_turn)
    return environments.collate(episodes, task.tokenizer.pad_token_id, common.local_device())


def sample_round(policy, task: environments.EnvTask, sampler, args) -> environments.Episodes:
    """The sampler's next rows, k episodes each from the row's reset seed (the group's shared initial state)."""
    indices = sampler.next_indices()
    first_prompt = sampler.rank * sampler.local_batch_size  # this rank's rows in the global batch
    seeds = [environments.reset_seed(args.run.seed, sampler.position, first_prompt + i) for i in range(len(indices))]
    with common.full_parameters(policy) as model:
        return play_episodes(model, task, task.train_rows[indices], seeds, args.num_samples, args,
                             args.generation.temperature, f"{args.run.seed}/{sampler.position}",
                             first_prompt * args.num_samples)


def final_scores(episodes: environments.Episodes, args) -> torch.Tensor:
    """(N,) the rewards that make the advantages: each episode's return, or --penalty_reward_value for an episode
    with a turn that ran out of tokens before its stop token (with --missing_eos_penalty)."""
    if args.generation.missing_eos_penalty:
        return torch.where(episodes.contains_eos, episodes.returns, args.generation.penalty_reward_value)
    return episodes.returns


@torch.no_grad()
def evaluate(policy, task: environments.EnvTask, args, update: int) -> dict[str, float]:
    """One near-greedy episode (--eval_temperature) of each evaluation row, from a reset seed of its own that is the
    same in every evaluation: eval/return_mean, eval/turns_mean, eval/truncated_episodes (their share). Each rank
    plays its share; the numbers are over all of them."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    indices = list(range(rank, len(task.eval_rows), world_size))
    seeds = [environments.reset_seed(args.run.seed, -1, i) for i in indices]
    with evaluation.eval_mode(policy), common.full_parameters(policy) as model:
        episodes = play_episodes(model, task, task.eval_rows[indices], seeds, 1, args,
                                 args.evaluation.eval_temperature, f"{args.run.seed}/eval/{update}", rank)
    totals = torch.tensor([float(len(indices)), episodes.returns.sum().item(), episodes.turns.sum().item(),
                           episodes.truncated.sum().item()], dtype=torch.float64, device=common.local_device())
    torch.distributed.all_reduce(totals)
    count, returns, turns, truncated = totals.tolist()
    return {"eval/return_mean": returns / count, "eval/turns_mean": turns / count,
            "eval/truncated_episodes": truncated / count}


def returns_to_go(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1}: each turn's discounted return from that turn on. rewards: (N, T) -> (N, T)"""
    returns, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for turn in reversed(range(rewards.shape[1])):
        running = rewards[:, turn] + gamma * running
        returns[:, turn] = running
    return returns


def turn_advantages(turn_rewards: torch.Tensor, turns: torch.Tensor, state_keys: torch.Tensor, scores: torch.Tensor,
                    k: int, args) -> torch.Tensor:
    """Each turn's advantage under --turn_advantage (ALGORITHMS.md, "Credit per turn"), for groups of k adjacent
    episodes: reward_to_go, G_t against the mean G_t of the group's episodes that took a turn t; turn_index_norm, the
    return-to-go of the turn rewards normalised per turn index across the group (biased when the policy decides when
    to stop); unbiased, G_t against the mean G_t of the group's other episodes that took a turn t (0 if none); gigpo,
    the episode's group advantage (group_advantages of `scores`) plus the turn's G_t normalised among the group's
    turns that start from the same state (state_keys; 0 for a state no other turn starts from).
    turn_rewards, state_keys: (N, T); turns, scores: (N,) -> (N, T), 0 past each episode's last turn"""
    width = turn_rewards.shape[1]
    played = (torch.arange(width, device=turns.device) < turns[:, None]).float()  # (N, T)
    in_groups = lambda values: values.view(-1, k, width)  # noqa: E731  (groups, k, T)
    if args.turn_advantage == "turn_index_norm":
        rewards, taken = in_groups(turn_rewards), in_groups(played)
        count = taken.sum(dim=1, keepdim=True)  # (groups, 1, T) episodes with a turn t
        mean = (rewards * taken).sum(dim=1, keepdim=True) / count.clamp(min=1)
        std = (((rewards - mean) ** 2 * taken).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        normalised = ((rewards - mean) / (std + 1e-4) * taken).view(-1, width)
        return returns_to_go(normalised, args.gamma) * played
    returns = returns_to_go(turn_rewards, args.gamma) * played  # (N, T)
    if args.turn_advantage == "gigpo":
        return group_advantages(scores, k, args.scale_rewards)[:, None] * played + step_advantages(
            returns, played, state_keys, k)
    group_returns, taken = in_groups(returns), in_groups(played)
    total, count = (group_returns * taken).sum(dim=1, keepdim=True), taken.sum(dim=1, keepdim=True)
    if args.turn_advantage == "reward_to_go":
        baseline = total / count.clamp(min=1)
    else:  # unbiased: the others' (leave-one-out), which do not depend on this episode's actions
        baseline = (total - group_returns) / (count - 1).clamp(min=1)
    return ((group_returns - baseline) * taken).view(-1, width)


def step_advantages(returns: torch.Tensor, played: torch.Tensor, state_keys: torch.Tensor, k: int) -> torch.Tensor:
    """GiGPO's step level: each turn's return-to-go against those of the turns of its group that start from the same
    state (its anchor group), divided by their std (+ 1e-4); 0 for a turn whose state no other turn of the group
    starts from. returns, played, state_keys: (N, T) -> (N, T)"""
    width = returns.shape[1]
    keys, g, taken = (values.reshape(-1, k * width) for values in (state_keys, returns, played))  # (groups, kT)
    # (groups, kT, kT): two turns of a group that were taken and start from the same state
    same = (keys[:, :, None] == keys[:, None, :]) & (taken[:, :, None] > 0) & (taken[:, None, :] > 0)
    count = same.sum(dim=2)  # (groups, kT) the turns of each turn's anchor group, itself included
    mean = (same * g[:, None, :]).sum(dim=2) / count.clamp(min=1)
    std = ((same * (g[:, None, :] - mean[:, :, None]) ** 2).sum(dim=2) / (count - 1).clamp(min=1)).sqrt()
    step = (g - mean) / (std + 1e-4) * taken  # 0 for a turn alone in its anchor group: it is its own mean
    return step.view(-1, width)


def token_advantages(per_turn: torch.Tensor, token_turns: torch.Tensor) -> torch.Tensor:
    """Each of the policy's tokens takes its turn's advantage; every other token 0.
    per_turn: (N, T), token_turns: (N, R) -> (N, R)"""
    return per_turn.gather(1, token_turns.clamp(min=0)) * (token_turns >= 0)


def final_turn_rewards(episodes: environments.Episodes, args) -> torch.Tensor:
    """(N, T) each turn's reward, as final_scores takes the returns: with --missing_eos_penalty an episode with a turn
    that ran out of tokens before its stop token has --penalty_reward_value at its last turn and 0 before."""
    if not args.generation.missing_eos_penalty:
        return episodes.turn_rewards
    last = torch.arange(episodes.turn_rewards.shape[1], device=episodes.turns.device) == episodes.turns[:, None] - 1
    penalised = torch.where(last, args.generation.penalty_reward_value, 0.0)
    return torch.where(episodes.contains_eos[:, None], episodes.turn_rewards, penalised)


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


# Shapes: B rows (initial states) per update on this rank (local_batch_size), k episodes per row, N = B*k
# episodes (each row's k adjacent), P tokens of the first message (left-padded), R tokens after it, the policy's
# and the environment's (the batch's longest; P + R is at most --max_episode_tokens).
def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size, num_updates = check_args(args, world_size)
    batch_size = local_batch_size * world_size
    outputs.resolve_output_dir(args.run)
    common.seed_everything(args.run.seed + rank, args.run.torch_deterministic)
    dtype = torch.bfloat16 if args.distributed.bf16 else torch.float32
    task = environments.load_env_task(args.data, args.env, args.evaluation.eval_num_prompts, args.lora, rank,
                                      evaluate=args.run.eval_every > 0,
                                      response_length=args.generation.response_length)
    if args.turn_advantage == "gigpo" and not callable(getattr(task.env_class, "state_key", None)):
        common.fail(f"--turn_advantage gigpo groups turns by the state they start from, which the environment names: "
                    f"--env {args.env.env!r} has no state_key() method")
    sampler = data.PromptSampler(len(task.train_rows), local_batch_size, rank, world_size, args.run.seed)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        outputs.prepare_output_dir(args.run, cli.flag_values(args), environments.RESUME_MAY_CHANGE)
    torch.distributed.barrier()

    from transformers import get_scheduler

    # no reference policy at all with --beta 0 (but the free one of LoRA, the adapter off, for evaluation)
    policy, ref_policy = lora.load_policy(args.data.model_name_or_path, args.lora, dtype, reference=args.beta > 0)
    parameter_counts = lora.trainable_parameters(policy)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.optimizer.learning_rate)
    num_optimizer_steps = num_updates * args.optimizer.num_epochs * args.optimizer.num_mini_batches
    scheduler = get_scheduler(args.optimizer.lr_scheduler_type, optimizer, num_warmup_steps=0,
                              num_training_steps=num_optimizer_steps)
    policy = common.prepare_deepspeed(policy, args.distributed, args.optimizer, optimizer, scheduler)
    if args.beta > 0 or args.lora.use_peft:
        ref_policy = lora.reference_policy(args.distributed, ref_policy, policy)

    state = outputs.OnlineTrainerState()
    if args.run.resume:
        state = outputs.load_checkpoint(args.run.output_dir, policy)
        sampler.position = state.data_position
    logger = outputs.MetricsLogger(args.run, cli.flag_values(args), num_updates, state.update,
                                  ("loss/policy_avg", "rollout/return_mean", "objective/kl", "eval/return_mean"))
    logger.log(state.update, parameter_counts)
    if state.update == 0 and args.run.eval_every:
        logger.log_evaluation(0, 0, evaluate(policy, task, args, 0))
    k = args.num_samples
    micro_batch_size = args.optimizer.per_device_train_batch_size
    mini_batch_size = micro_batch_size * args.optimizer.gradient_accumulation_steps  # prompts per optimizer step
    start_time, start_episode = time.time(), state.episode
    for update in range(state.update + 1, num_updates + 1):
        # Rollout: k episodes per row played to their end, turn by turn (play_episodes), and their returns;
        # then the reference log-probs (with --beta) and the sampling weights' log-probs.
        t0 = time.time()
        rollout = sample_round(policy, task, sampler, args)  # environments.Episodes; rollout.mask: the policy's tokens
        scores = final_scores(rollout, args)
        t1 = time.time()
        ref_logprobs = common.rollout_logprobs(ref_policy, rollout, args.generation) if args.beta else None  # (N, R)
        orders = [torch.randperm(local_batch_size) for _ in range(args.optimizer.num_epochs)]  # (B,) prompts each
        # (N, R) the sampling weights' log-probs, the ratios' denominator: the first optimizer step's forward
        # computes them for its rows (under the same weights); one forward here for every other row
        first_rows = (orders[0][:mini_batch_size, None] * k + torch.arange(k)).flatten()
        logprobs = common.start_logprobs_but_first_step(policy, rollout, args.generation, first_rows)
        start_logprobs = logprobs  # the sampler is the trainer, at the start of the update

        # Advantages: each return against its group's (--turn_advantage episode), or each turn's on its own tokens;
        # the tokens that count in the loss (the policy's).
        if args.turn_advantage == "episode":
            advantages = group_advantages(scores, k, args.scale_rewards)  # (N,)
        else:
            per_turn = turn_advantages(final_turn_rewards(rollout, args), rollout.turns, rollout.state_keys, scores,
                                       k, args)  # (N, T)
            advantages = token_advantages(per_turn, rollout.token_turns)  # (N, R)
        mask = rollout.mask.float()  # (N, R)
        if args.mask_truncated_completions:
            mask = mask * (1 - rollout.truncated[:, None])
        if args.env.env_failure == "drop_group":  # a group with an episode that failed leaves the loss
            mask = mask * environments.kept_groups(rollout, k)[:, None]
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
                    common.reuse_first_step_logprobs(logprobs, rows, new_logprobs, epoch, step)
                    terms = corrections.off_policy_terms(
                        new_logprobs, logprobs[rows], start_logprobs[rows], mask[rows], args.corrections,
                        args.corrections.correction_level == "sequence")
                    loss, clipfrac, ratio = policy_loss(
                        new_logprobs, terms.anchor, advantages[rows], mask[rows], args, step_tokens,
                        args.env.max_episode_tokens, ref_logprobs[rows] if args.beta else None, entropy,
                        terms.token_weights, terms.clip)
                    stats["off_policy"].append(terms.diagnostics)
                    policy.backward(loss)
                    policy.step()  # DeepSpeed steps the optimizer after the mini-batch's last micro-batch
                    stats["loss"].append(loss.item())
                    stats["clipfrac"].append(clipfrac)
                    stats["entropy"].append(common.masked_mean(entropy.detach(), mask[rows]))
                    stats["ratio"].append(ratio.detach().expand_as(mask[rows])[mask[rows].bool()])
        t3 = time.time()

        # Log: averages over every micro-batch of every epoch; rollout statistics over the batch.
        ratios, off_policy = torch.cat(stats.pop("ratio")), corrections.merge_diagnostics(stats.pop("off_policy"))
        stats = {name: sum(values) / len(values) for name, values in stats.items()}
        state.update, state.episode, state.data_position = update, state.episode + batch_size, sampler.position
        # over the groups kept, as the loss (a group --env_failure drop_group dropped is reported apart)
        rollout_stats = environments.objective_metrics(rollout, k, logprobs, ref_logprobs, scores)
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
            **environments.rollout_metrics(rollout, k),
            "time/generate": t1 - t0,  # the episodes: sampling and the environment's steps
            "time/score": t2 - t1,
            "time/train": t3 - t2,
        })
        metrics.update({"lr": policy.get_lr()[0], "episode": state.episode,
                        "eps": (state.episode - start_episode) / (time.time() - start_time)})
        logger.log(update, metrics)
        if args.run.eval_every and (update % args.run.eval_every == 0 or update == num_updates):
            logger.log_evaluation(update, state.episode, evaluate(policy, task, args, update))
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
