"""Which tokens move when a corrected run trains on stale samples? For a run's snapshots (`--save_every`), on
completions the starting policy samples (what every update of a K-stale run trains on until its own samples arrive,
update K + 2), each token's log-ratio d = log pi_update - log pi_start: the mismatch KL it adds (k3: exp(d) - d - 1,
the estimator of async/mismatch_kl), by position in the completion and by kind (in the "#### N" solution format of
GSM8k and the arithmetic task: a step's result after "=", the other digits of the working, the final answer after
"####", the symbols, the stop token), the (position, token) pairs that carry most of it, and how it concentrates
(the share of a completion's mismatch in its single largest token; the tokens per completion with |d| > 1). Also
split by whether the completion was right. Prints a table per snapshot and writes
bench/results/which_tokens_move_<name>.json.

    python grpo_vllm.py --preset toy-math --async_steps 16 --off_policy_correction decoupled --total_episodes 8192 \\
        --save_every 4 --output_dir runs/mechanism/decoupled      # killed after update 32 is enough
    python bench/which_tokens_move.py --run_dir runs/mechanism/decoupled --updates 8 16 24 28 32
"""

import json
import os
import statistics
import sys
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import data  # noqa: E402
import math_reward  # noqa: E402

KINDS = ("result", "working", "answer", "symbol", "stop")
POSITIONS = ((0, 4), (4, 8), (8, 12), (12, 16), (16, 24))  # token positions in the completion, [start, stop)


@dataclass
class Args:
    run_dir: str
    """a run with snapshots (policies/update-N, --save_every) and its args.json"""
    updates: tuple[int, ...] = (8, 16, 24, 32)
    """the snapshots to compare with the starting policy"""
    prompts: int = 256
    """train prompts, one starting-policy completion each, at the run's temperature"""
    name: str | None = None
    """the results file's name: which_tokens_move_<name>.json (default: the run folder's name)"""
    output_dir: str = os.path.join(ROOT, "bench", "results")
    """where the results file goes"""


def token_kinds(tokens: list[str], eos: str) -> list[str]:
    """Each completion token's kind in a "#### N" solution: "result" (after "=" until the next "," or "####"),
    "answer" (after "####"), "working" (the other digits), "symbol", "stop"."""
    kinds, state = [], "working"
    for token in tokens:
        text = token.lstrip("~")
        if token == eos:
            kinds.append("stop")
        elif text == "####":
            kinds.append("symbol")
            state = "answer"
        elif text == "=":
            kinds.append("symbol")
            state = "result" if state != "answer" else state
        elif text in (",", "+", "-", "*", "/"):
            kinds.append("symbol")
            state = "working" if state == "result" else state
        elif text.isdigit():
            kinds.append(state)
        else:
            kinds.append("symbol")
    return kinds


@torch.no_grad()
def main(args: Args):
    with open(os.path.join(args.run_dir, "args.json")) as f:
        flags = json.load(f)["args"]  # toy:NAME values resolved to their paths
    from transformers import AutoModelForCausalLM

    policy_path = flags["model_name_or_path"]
    tokenizer = data.load_tokenizer(policy_path)
    rows = data.load_split(flags["dataset_name"], flags["train_split"]).select(range(args.prompts))
    temperature = flags["temperature"]
    eos_ids = data.eos_token_ids(policy_path, tokenizer)
    start = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    torch.manual_seed(flags["seed"])
    queries = [tokenizer(q)["input_ids"] for q in rows[flags["prompt_column"]]]
    query_ids, query_mask = common.left_pad(queries, tokenizer.pad_token_id, "cpu")
    responses = common.generate(start, query_ids, query_mask, flags["response_length"], temperature, eos_ids,
                                tokenizer.pad_token_id)
    responses, lengths, _ = common.truncate_after_eos(responses, eos_ids, tokenizer.pad_token_id)
    mask = common.response_mask(lengths, responses.shape[1]).bool()  # (N, R)
    start_logprobs = common.response_logprobs(start, query_ids, query_mask, responses, lengths, temperature)
    _, completions = common.decode_responses(tokenizer, query_ids, query_mask, responses, lengths, True)
    right = torch.tensor([math_reward.same_final_answer(c, a) for c, a in zip(completions,
                                                                             rows[flags["answer_column"]])])
    kinds = [token_kinds(tokenizer.convert_ids_to_tokens(row[:length]), tokenizer.eos_token)
             for row, length in zip(responses.tolist(), lengths.tolist())]
    results = {"run_dir": args.run_dir, "prompts": args.prompts, "starting_accuracy": right.float().mean().item(),
               "by_update": {}}
    print(f"{args.run_dir}: {args.prompts} completions of the starting policy (accuracy {right.float().mean():.3f}), "
          f"{mask.sum().item()} tokens")
    for update in args.updates:
        path = os.path.join(args.run_dir, "policies", f"update-{update}")
        policy = AutoModelForCausalLM.from_pretrained(path).eval()
        logprobs = common.response_logprobs(policy, query_ids, query_mask, responses, lengths, temperature)
        d = (logprobs - start_logprobs).masked_fill(~mask, 0.0)  # (N, R)
        k3 = (torch.exp(d) - d - 1).masked_fill(~mask, 0.0)
        total = k3.sum().item()
        by_kind = {}
        for kind in KINDS:
            chosen = torch.zeros_like(mask)
            for i, row in enumerate(kinds):
                for j, k in enumerate(row):
                    chosen[i, j] = k == kind
            by_kind[kind] = {"tokens": chosen.sum().item(), "share_of_mismatch": k3[chosen].sum().item() / total,
                             "mean_d": d[chosen].mean().item() if chosen.any() else None,
                             "mean_abs_d": d[chosen].abs().mean().item() if chosen.any() else None}
        by_position = {f"{a}-{b - 1}": k3[:, a:b].sum().item() / total for a, b in POSITIONS if a < k3.shape[1]}
        by_token = {}  # (position, token) -> its share of the mismatch
        for i, row in enumerate(responses.tolist()):
            for j, token in enumerate(tokenizer.convert_ids_to_tokens(row[:lengths[i]])):
                by_token[(j, token)] = by_token.get((j, token), 0.0) + k3[i, j].item() / total
        top = sorted(by_token.items(), key=lambda item: -item[1])[:5]
        per_completion = k3.sum(dim=1)  # (N,)
        largest = k3.max(dim=1).values / per_completion.clamp_min(1e-12)
        moved = ((d.abs() > 1) & mask).sum(dim=1).float()
        entry = {"mismatch_kl_per_token": total / mask.sum().item(), "by_kind": by_kind, "by_position": by_position,
                 "largest_token_share_median": statistics.median(largest.tolist()),
                 "tokens_moved_by_more_than_1_per_completion": moved.mean().item(),
                 "top_tokens": [[position, token, share] for (position, token), share in top],
                 "mismatch_kl_right_vs_wrong": [k3[right].sum().item() / mask[right].sum().item(),
                                                k3[~right].sum().item() / max(mask[~right].sum().item(), 1)]}
        results["by_update"][update] = entry
        print(f"\nupdate {update}: mismatch KL per token {entry['mismatch_kl_per_token']:.4f} (right completions "
              f"{entry['mismatch_kl_right_vs_wrong'][0]:.4f}, wrong {entry['mismatch_kl_right_vs_wrong'][1]:.4f}); "
              f"a completion's largest token carries {entry['largest_token_share_median']:.2f} of its mismatch "
              f"(median); tokens with |d| > 1 per completion {entry['tokens_moved_by_more_than_1_per_completion']:.2f}")
        for kind, values in by_kind.items():
            if values["tokens"]:
                print(f"  {kind:8} {values['tokens']:5d} tokens, {values['share_of_mismatch']:.2f} of the mismatch, "
                      f"mean d {values['mean_d']:+.3f}, mean |d| {values['mean_abs_d']:.3f}")
        print("  by position: " + ", ".join(f"{span} {share:.2f}" for span, share in by_position.items()))
        print("  the largest (position: token): " + ", ".join(f"{position}: {token!r} {share:.2f}"
                                                             for (position, token), share in top))
    name = args.name or os.path.basename(os.path.normpath(args.run_dir))
    destination = os.path.join(args.output_dir, f"which_tokens_move_{name}.json")
    with open(destination, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nresults in {destination}")


if __name__ == "__main__":
    main(tyro.cli(Args))
