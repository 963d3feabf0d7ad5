"""The paper's evaluation protocol, the same in every RL script and in eval_checkpoints.py: near-greedy
completions of held-out prompts, scored by the gold scorer against the references (gold win-rate), by the
proxy reward, and (with --answer_column) by their final answer; KL and perplexity under the SFT policy
(ALGORITHMS.md, "5. Evaluation")."""

import contextlib
import math
from dataclasses import dataclass

import torch

import common
import math_reward


@dataclass
class SamplingEvalArgs(common.FlagGroup):
    """Evaluation: held-out prompts and their near-greedy completions"""

    eval_num_prompts: int = 256
    """validation prompts used by each evaluation (grpo_multiturn.py: rows, one near-greedy episode each)"""
    eval_temperature: float = 0.01
    """near-greedy temperature of evaluation completions (the paper's protocol)"""

    def check(self):
        common.check_signs(self, ("eval_num_prompts",))


@dataclass
class EvalArgs(SamplingEvalArgs):
    """Evaluation: held-out prompts, their near-greedy completions, and how they are scored"""

    gold_model_path: str | None = None
    """gold reward model for evaluation, or "toy" (the embedded task's programmatic scorer); default: toy
    on the toy task's data, else none (evaluation then reports the proxy reward and KL)"""
    answer_column: str | None = None
    """column of solutions ending in `#### N` (GSM8k's format): evaluation reports eval/accuracy, the share of
    greedy completions with the same final answer"""
    reference_column: str = "reference_response"
    """column of reference completions: with a gold scorer, evaluation reports the gold win-rate against
    them (no win-rate when the column is absent)"""


def engine_seeds(seed: int, update: int, rows: int) -> list[int]:
    """The sampling seed of each evaluation prompt's completions in a vLLM engine (the _vllm scripts' engine,
    eval_checkpoints.py --vllm): from (seed, update, row) alone, so both sample the same completions of the same
    weights however the engine batches them."""
    return [hash((seed, update, row)) % 2**63 for row in range(rows)]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """`model` in eval mode, then back in the mode it was in."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


@torch.no_grad()
def evaluate(evaluation: EvalArgs, generation: common.GenerationArgs, seed: int, task: common.Task, policy, ref_policy,
             reward_model, update: int, part: str | None = None,
             generated: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Near-greedy completions of the evaluation prompts: their proxy reward, their gold score and gold
    win-rate against the references (where there are a gold scorer and references), their accuracy
    (with --answer_column: the share whose final answer `#### N` is the solution's), their perplexity
    under the SFT policy (per token, at temperature 1: the paper's measure of drift), and KL to the SFT
    policy. `generation`: the training's sampling (KL is estimated on samples at its temperature and top_p),
    and its chunk size.

    Each rank evaluates its own share of the eval prompts; the numbers are averaged over ranks. Sampling
    has a random state of its own, seeded from (`seed`, `update`, rank), and leaves the training's as it
    was: how often a run evaluates does not change its training, and eval_checkpoints.py gets the numbers
    the run logged for the same update (on as many ranks).
    `part`: the policy's attribute name when the engine trains more than the policy (PPO).
    `generated`: the near-greedy and the sampled completions of this rank's prompts, (rows, response_length)
    each, from elsewhere (eval_checkpoints.py's vLLM engine), and the sampled ones' log-probs under the policy
    where `policy` no longer holds the weights that sampled them (the _vllm scripts' engine evaluates the weights
    of an earlier update: vllm_generator.Evaluation); by default the policy samples them with HF `generate`.
    """
    tokenizer, eos_ids, gold_score = task.tokenizer, task.eos_ids, task.gold_score
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = task.eval_prompts.select(range(rank, len(task.eval_prompts), world_size))
    totals = {"proxy_score": 0.0, "num_eos_tokens": 0.0, "response_length": 0.0}
    if ref_policy is not None:  # None: no reference policy (GRPO's beta 0), so no KL and no perplexity under it
        totals.update(kl=0.0, ref_nll=0.0)
    if evaluation.answer_column:
        totals["accuracy"] = 0.0
    if gold_score is not None:
        totals.update(gold_score=0.0, **({"gold_win_rate": 0.0} if task.has_references else {}))
    cuda_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    # in eval mode (no --lora_dropout), as eval_checkpoints.py evaluates the saved policy
    with torch.random.fork_rng(devices=cuda_devices), eval_mode(policy):
        torch.manual_seed(hash((seed, update, rank)))  # a tuple of ints hashes the same in every process
        chunk_size, length = generation.local_rollout_forward_batch_size, generation.response_length
        for start in range(0, len(rows), chunk_size):
            batch = rows[start:start + chunk_size]  # {column: values}
            query_ids, query_mask = common.left_pad(batch["input_ids"], tokenizer.pad_token_id, policy.device)
            with common.full_parameters(policy, part) as model:
                given_logprobs = []  # the sampled completions' log-probs, where they come with them
                if generated is None:
                    greedy = common.generate(model, query_ids, query_mask, length, evaluation.eval_temperature,
                                             eos_ids, tokenizer.pad_token_id)
                    # KL is estimated on samples at the training temperature: near-greedy ones say little about it
                    sampled = common.generate(model, query_ids, query_mask, length, generation.temperature,
                                              eos_ids, tokenizer.pad_token_id, generation.top_p)
                else:
                    greedy, sampled, *given_logprobs = (responses[start:start + len(query_ids)].to(policy.device)
                                                        for responses in generated)
                sampled, sampled_lengths, _ = common.truncate_after_eos(sampled, eos_ids, tokenizer.pad_token_id)
                logprobs = given_logprobs[0] if given_logprobs else common.response_logprobs(
                    model, query_ids, query_mask, sampled, sampled_lengths, generation.temperature, generation.top_p)
            mask = common.response_mask(sampled_lengths, sampled.shape[1])
            greedy, lengths, contains_eos = common.truncate_after_eos(greedy, eos_ids, tokenizer.pad_token_id)
            if evaluation.answer_column:
                _, completions = common.decode_responses(tokenizer, query_ids, query_mask, greedy, lengths, True)
                answers = batch[evaluation.answer_column]
                totals["accuracy"] += sum(map(math_reward.same_final_answer, completions, answers))
            if gold_score is not None:
                queries, responses = common.decode_responses(tokenizer, query_ids, query_mask, greedy, lengths, False)
                policy_gold = torch.tensor(gold_score(queries, responses))
                totals["gold_score"] += policy_gold.sum().item()
                if task.has_references:
                    reference_gold = torch.tensor(gold_score(queries, batch[evaluation.reference_column]))
                    totals["gold_win_rate"] += (policy_gold > reference_gold).float().sum().item()
            if task.reward_fn is not None:
                rollout = common.Rollout(query_ids, query_mask, greedy, lengths, contains_eos)
                proxy = common.function_rewards(task, rollout, batch, "evaluation")
            else:
                proxy = common.score_responses(reward_model, query_ids, query_mask, greedy, lengths, contains_eos,
                                               tokenizer, task.reward_tokenizer)
            if generation.missing_eos_penalty:  # as in training
                proxy = torch.where(contains_eos, proxy, generation.penalty_reward_value)
            if ref_policy is not None:
                ref_logprobs = common.response_logprobs(ref_policy, query_ids, query_mask, sampled, sampled_lengths,
                                                        generation.temperature)
                greedy_ref_logprobs = common.response_logprobs(ref_policy, query_ids, query_mask, greedy, lengths, 1.0)
                greedy_mask = common.response_mask(lengths, greedy.shape[1])
                totals["ref_nll"] -= common.masked_sum(greedy_ref_logprobs, greedy_mask).sum().item()
                totals["kl"] += common.masked_sum(logprobs - ref_logprobs, mask).sum().item()
            totals["proxy_score"] += proxy.sum().item()
            totals["num_eos_tokens"] += contains_eos.float().sum().item()
            totals["response_length"] += lengths.float().sum().item()
    counts = torch.tensor([float(len(rows))] + list(totals.values()), dtype=torch.float64, device=policy.device)
    torch.distributed.all_reduce(counts)
    means = {name: value / counts[0].item() for name, value in zip(totals, counts[1:].tolist())}
    if ref_policy is not None:  # per token over every completion's tokens (not a mean of per-completion ones)
        means["ref_perplexity"] = math.exp(means.pop("ref_nll") / max(means["response_length"], 1e-9))
    return {f"eval/{name}": value for name, value in means.items()}
