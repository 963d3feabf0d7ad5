"""What a run's accuracy is made of, update by update, on the arithmetic task (toy-math), from its snapshots
(`--save_every`: `bench/off_policy_corrections.py --save_every 4`). On the problems the run evaluated on (the first
--eval_num_prompts of its evaluation split), split by class: no carry from the units column; a carry with units
summing to 10-14 (the starting policy mostly forgets it); a carry with units summing to 15-18 (it mostly carries).
For the starting policy and each snapshot, per class:
- accuracy: the share of near-greedy completions (temperature 0.01, as the run's evaluation) with the right final
  answer; the classes' shares, weighted by their counts, are printed beside the run's own eval/accuracy;
- decision: the probability, at the run's sampling temperature, of the task's one decision given the worked
  solution up to it (" 4 + 9 = 13 , 2 + 5" -> "+" to add the carry, "=" for none), the right one.
Writes (adds its runs to) bench/results/dip_diagnostics.json: {run folder name: {"world": the build and CPU
(off_policy_corrections.world), "update": [...], "eval_accuracy": [...], "classes": {class: {"problems": n,
"accuracy": [...], "decision": [...]}}}}.

    python bench/dip_diagnostics.py runs/long/grpo-math-k16-decoupled_total_episodes-8192_eval_in_trainer-seed1
"""

import json
import os
import sys
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the kit's modules: bench/lora.py is no kit module

from off_policy_corrections import world  # noqa: E402

import common  # noqa: E402
import data  # noqa: E402
import math_reward  # noqa: E402

CLASSES = ("no carry", "carry 10-14", "carry 15-18")
EVAL_TEMPERATURE = 0.01  # the evaluation's near-greedy completions (evaluation.SamplingEvalArgs)


@dataclass
class Args:
    run_dirs: tyro.conf.Positional[tuple[str, ...]]
    """runs with snapshots (policies/update-N) and their args.json"""
    output: str = os.path.join(ROOT, "bench", "results", "dip_diagnostics.json")
    """the results file; runs already in it are kept, those given replaced"""


def problem_class(a: int, b: int) -> str:
    units = a % 10 + b % 10
    return CLASSES[0] if units < 10 else CLASSES[1] if units < 15 else CLASSES[2]


def decision_split(solution: str) -> tuple[str, str]:
    """A worked solution ("4 + 9 = 13 , 2 + 5 + 1 = 8 #### 83") cut before its decision: ("4 + 9 = 13 , 2 + 5", "+");
    without a carry the decision is "="."""
    units, tens = solution.split(" , ")
    words = tens.split()
    return f"{units} , {' '.join(words[:3])}", words[3]


@torch.no_grad()
def measure(policy, tokenizer, queries: list[list[int]], rows, flags: dict, seed: int) -> dict:
    """One policy's accuracy and decision probability on each evaluation problem: {"right": (N,), "decision": (N,)}."""
    pad, temperature = tokenizer.pad_token_id, flags["temperature"]
    query_ids, query_mask = common.left_pad(queries, pad, "cpu")
    torch.manual_seed(seed)
    eos_ids = data.eos_token_ids(flags["model_name_or_path"], tokenizer)
    completions = common.generate(policy, query_ids, query_mask, flags["response_length"], EVAL_TEMPERATURE, eos_ids,
                                  pad)
    completions, lengths, _ = common.truncate_after_eos(completions, eos_ids, pad)
    _, texts = common.decode_responses(tokenizer, query_ids, query_mask, completions, lengths, True)
    right = torch.tensor([math_reward.same_final_answer(t, s) for t, s in zip(texts, rows[flags["answer_column"]])])
    # the worked solution up to the decision, and the decision, as a response: its last token's log-prob
    cut = [decision_split(solution) for solution in rows[flags["answer_column"]]]
    responses = [tokenizer(f"{prefix} {decision}")["input_ids"] for prefix, decision in cut]
    lengths = torch.tensor([len(r) for r in responses])
    padded = torch.full((len(responses), int(lengths.max())), pad)  # (N, R)
    for i, response in enumerate(responses):
        padded[i, :len(response)] = torch.tensor(response)
    logprobs = common.response_logprobs(policy, query_ids, query_mask, padded, lengths, temperature)  # (N, R)
    decision = logprobs[torch.arange(len(responses)), lengths - 1].exp()
    return {"right": right.float(), "decision": decision}


def diagnose(run_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    with open(os.path.join(run_dir, "args.json")) as f:
        flags = json.load(f)["args"]  # toy:NAME values resolved to their paths
    tokenizer = data.load_tokenizer(flags["model_name_or_path"])
    rows = data.load_split(flags["dataset_name"], flags["eval_split"]).select(range(flags["eval_num_prompts"]))
    queries = [tokenizer(q)["input_ids"] for q in rows[flags["prompt_column"]]]
    classes = [problem_class(a, b) for a, b in zip(rows["a"], rows["b"])]
    snapshots = sorted(int(name.removeprefix("update-")) for name in os.listdir(os.path.join(run_dir, "policies")))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logged = {m["update"]: m["eval/accuracy"] for m in map(json.loads, f) if "eval/accuracy" in m}
    result = {"world": world(run_dir), "update": [0, *snapshots],
              "eval_accuracy": [logged.get(u) for u in [0, *snapshots]],
              "classes": {c: {"problems": classes.count(c), "accuracy": [], "decision": []} for c in CLASSES}}
    for update in result["update"]:
        path = (flags["model_name_or_path"] if update == 0
                else os.path.join(run_dir, "policies", f"update-{update}"))
        measured = measure(AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer, queries, rows, flags,
                           flags["seed"])
        for c in CLASSES:
            chosen = torch.tensor([k == c for k in classes])
            result["classes"][c]["accuracy"].append(round(measured["right"][chosen].mean().item(), 6))
            result["classes"][c]["decision"].append(round(measured["decision"][chosen].mean().item(), 6))
    return result


def main(args: Args):
    results = {}
    if os.path.exists(args.output):
        with open(args.output) as f:
            results = json.load(f)
    for run_dir in args.run_dirs:
        name = os.path.basename(os.path.normpath(run_dir))
        results[name] = run = diagnose(run_dir)
        counts = {c: run["classes"][c]["problems"] for c in CLASSES}
        print(f"\n{name}: problems per class " + ", ".join(f"{c} {n}" for c, n in counts.items()))
        print(f"{'update':>6} {'eval/accuracy':>13} {'classes pooled':>14} " + "".join(
            f"{c + ' acc / decision':>28}" for c in CLASSES))
        for i, update in enumerate(run["update"]):
            pooled = sum(run["classes"][c]["accuracy"][i] * n for c, n in counts.items()) / sum(counts.values())
            logged = run["eval_accuracy"][i]
            print(f"{update:>6} {'-' if logged is None else f'{logged:.3f}':>13} {pooled:>14.3f} " + "".join(
                f"{run['classes'][c]['accuracy'][i]:>17.3f} / {run['classes'][c]['decision'][i]:.3f}"
                for c in CLASSES))
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    print(f"\nresults in {args.output}")


if __name__ == "__main__":
    main(tyro.cli(Args))
