"""Evaluate every saved policy of a run (its SFT start, each --save_every snapshot, the final policy), or
given model folders, on the evaluation prompts, as the RL scripts evaluate during training: near-greedy
completions, their gold win-rate against the references, gold and proxy scores, accuracy where there is an
answer column, perplexity under the SFT policy and KL to it. Writes a table and a plot against episodes,
and resumes where it stopped. The last step of the pipeline: sft.py -> reward_model.py -> an RL script ->
eval_checkpoints.py.

    python eval_checkpoints.py --run_dir runs/online_dpo__1__1732400000        # settings from the run's args.json
    python eval_checkpoints.py --model_paths A/policy B/policy --output_dir cmp  # any HF policies
"""

import contextlib
import gc
import json
import os
from dataclasses import dataclass, field

import torch

import cli
import common
import data
import evaluation
import toy


@dataclass
class Args:
    # What to evaluate
    run_dir: str | None = None
    """a training run's output directory: its policies/update-N snapshots, its final policy and its SFT start
    (update 0) are evaluated, and every field below that the run recorded defaults to the run's value"""
    model_paths: list[str] = field(default_factory=list)
    """Hugging Face policies to evaluate, besides (or instead of) the run's"""
    output_dir: str | None = None
    """where the table (eval.jsonl, eval.csv) and plot (eval.png) go; default RUN_DIR/eval; an existing table
    is continued: policies already in it are not evaluated again"""
    config: str | None = None
    """a YAML file of these flags' values; applied after the run's settings, and the flags given override it"""

    # The evaluation (the RL scripts' fields of the same names; with --run_dir, the run's values)
    model_name_or_path: str = toy.SFT_POLICY
    """the SFT (reference) policy: KL and perplexity are measured against it"""
    reward_model_path: str = toy.REWARD_MODEL
    """proxy reward model of eval/proxy_score"""
    reward_fn: str | None = None
    """a Python function as the proxy reward instead of a reward model (path/to/file.py:name or module:name)"""
    gold_model_path: str | None = None
    """gold reward model, or "toy"; default: toy on the toy task's data, else none"""
    dataset_name: str = toy.DATASET
    """the prompts (a hub id, a `save_to_disk` directory, a data directory, or a .json/.jsonl/.parquet file)"""
    train_split: str = "train"
    """the run's train split: without --eval_split in the dataset, its last --eval_num_prompts are evaluated"""
    eval_split: str = "validation"
    """split to evaluate on"""
    prompt_column: str = "query"
    """column holding the prompt text"""
    prompt_template: str | None = None
    """a format string over the dataset's columns that makes the prompt"""
    answer_column: str | None = None
    """column of solutions ending in `#### N`: eval/accuracy"""
    reference_column: str = "reference_response"
    """column of reference completions, for the gold win-rate"""
    chat_template: bool = False
    """wrap each prompt as a user message in the tokenizer's chat template"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens are dropped"""
    response_length: int = 12
    """new tokens per completion"""
    temperature: float = 0.7
    """temperature of the samples that KL is estimated on"""
    top_p: float = 1.0
    """nucleus sampling of those samples"""
    eval_temperature: float = 0.01
    """near-greedy temperature of the evaluated completions"""
    missing_eos_penalty: bool = True
    """give --penalty_reward_value instead of the proxy score to a completion with no stop token"""
    penalty_reward_value: float = -1.0
    """proxy reward of a completion with no stop token (with --missing_eos_penalty)"""
    eval_num_prompts: int = 256
    """evaluation prompts"""
    local_rollout_forward_batch_size: int = 64
    """rows per generation / scoring forward pass"""
    bf16: bool = False
    """evaluate in bfloat16 (GPU runs)"""
    vllm: bool = False
    """generate the completions with a vLLM engine in this process (one engine, each policy's weights loaded
    into it) instead of HF `generate`: faster, and the same numbers in distribution (not the run's own
    samples); one process only, and the policies must have the SFT policy's architecture"""
    vllm_gpu_memory_utilization: float = 0.3
    """with --vllm on a GPU: the share of its memory the engine may take (the HF models share the GPU)"""
    vllm_enforce_eager: bool = False
    """with --vllm on a GPU: run the engine without CUDA graphs (less memory, slower sampling)"""
    vllm_cpu_kv_cache_gib: int = 1
    """with --vllm on a CPU: GiB of memory for the engine's KV cache"""
    seed: int = 1
    """seed of the sampling (with --run_dir, the run's); each policy samples with the seed its run's evaluation
    of the same update had, so a run's own numbers come out again (on as many ranks)"""
    local_rank: int = -1
    """set by the deepspeed launcher"""


# the fields that --run_dir takes from the run's args.json
RUN_FIELDS = ("seed", "model_name_or_path", "reward_model_path", "reward_fn", "gold_model_path", "dataset_name",
              "train_split", "eval_split", "prompt_column", "prompt_template", "answer_column", "reference_column",
              "chat_template", "max_prompt_length", "response_length", "temperature", "top_p", "eval_temperature",
              "missing_eos_penalty", "penalty_reward_value", "eval_num_prompts", "local_rollout_forward_batch_size",
              "bf16")


def policies_to_evaluate(args: Args) -> list[dict]:
    """[{"policy": path, "update", "episode"}] in training order: the run's SFT start (update 0), its
    snapshots and final policy (one per update), then --model_paths (update and episode from their
    trained.json, None without one)."""
    found = []
    if args.run_dir:
        snapshots = os.path.join(args.run_dir, "policies")
        names = sorted(os.listdir(snapshots), key=lambda n: int(n.split("-")[1])) if os.path.isdir(snapshots) else []
        saved = [os.path.join(snapshots, n) for n in names if n.startswith("update-")]
        saved += [os.path.join(args.run_dir, "policy")] if os.path.isdir(os.path.join(args.run_dir, "policy")) else []
        if not saved:
            common.fail(f"--run_dir {args.run_dir!r} has no saved policy (policies/update-N or policy/); train with "
                        "--save_every N to keep a snapshot every N updates")
        found.append({"policy": args.model_name_or_path, "update": 0, "episode": 0})
    for path in saved if args.run_dir else []:
        found.append({"policy": path, **trained_to(path)})
    for path in args.model_paths:
        if not os.path.isfile(os.path.join(path, "config.json")):
            common.fail(f"--model_paths {path!r} is not a Hugging Face model folder (no config.json)")
        found.append({"policy": path, **trained_to(path)})
    if not found:
        common.fail("nothing to evaluate: give --run_dir (a training run) or --model_paths")
    by_update = {}  # the final policy of a run whose last update was also snapshotted is evaluated once
    for entry in found:
        key = (entry["update"], entry["episode"]) if entry["update"] is not None and args.run_dir else entry["policy"]
        by_update.setdefault(key, entry)
    return list(by_update.values())


def trained_to(path: str) -> dict:
    """The update and episode a saved policy was trained to (its trained.json), None for both without one."""
    recorded = os.path.join(path, "trained.json")
    if not os.path.isfile(recorded):
        return {"update": None, "episode": None}
    with open(recorded) as f:
        return json.load(f)


def write_table(output_dir: str, rows: list[dict]):
    """eval.jsonl (what a resumed evaluation reads), eval.csv and eval.png, all replaced atomically."""
    import csv
    import io

    common.write_atomically(os.path.join(output_dir, "eval.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    columns = list(dict.fromkeys(name for row in rows for name in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, columns)
    writer.writeheader()
    writer.writerows(rows)
    common.write_atomically(os.path.join(output_dir, "eval.csv"), text.getvalue())
    plot_table(output_dir, rows)


def plot_table(output_dir: str, rows: list[dict]):
    """eval.png: the headline (gold win-rate, else gold score, else accuracy, else proxy reward), perplexity
    under the SFT policy and KL, against episodes (against the row number when a policy has none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    headline = next(name for name in ("eval/gold_win_rate", "eval/gold_score", "eval/accuracy", "eval/proxy_score")
                    if name in rows[0])
    by_episode = all(row["episode"] is not None for row in rows)
    x = [row["episode"] if by_episode else i for i, row in enumerate(rows)]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8), constrained_layout=True)
    for axis, name in zip(axes, (headline, "eval/ref_perplexity", "eval/kl")):
        axis.plot(x, [row[name] for row in rows], marker="o", markersize=3)
        axis.set_xlabel("episode" if by_episode else "policy (table row)")
        axis.set_ylabel(name.removeprefix("eval/"))
        axis.grid(alpha=0.3)
    partial = os.path.join(output_dir, ".eval.partial.png")
    figure.savefig(partial, dpi=80)
    plt.close(figure)
    os.replace(partial, os.path.join(output_dir, "eval.png"))


@contextlib.contextmanager
def engine_kernels():
    """Deterministic algorithms off while the engine runs: vLLM's GPU kernels have no deterministic variants,
    and torch raises on them in this process, which evaluates deterministically otherwise."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


def start_engine(args: Args):
    """A vLLM engine for the SFT policy's architecture in this process, on this process's device (its GPU, or
    all its cores), as the RL scripts' `--vllm_device shared` places it."""
    import vllm_generator

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: no other process to place
    if not torch.cuda.is_available():
        os.environ.update(vllm_generator.cpu_engine_environment(sorted(os.sched_getaffinity(0)),
                                                                args.vllm_cpu_kv_cache_gib))

    with engine_kernels():
        return vllm_generator.start_vllm(args, args.vllm_gpu_memory_utilization)


def engine_completions(args: Args, llm, policy, task, update: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The near-greedy and the sampled completions of every evaluation prompt by `policy`'s weights in the
    engine, each row with its own seed from (--seed, `update`, row).  -> (prompts, response_length) each"""
    import dataclasses

    import vllm_generator

    prompts = task.eval_prompts["input_ids"]
    seeds = [hash((args.seed, update, row)) % 2**63 for row in range(len(prompts))]
    near_greedy = dataclasses.replace(args, temperature=args.eval_temperature, top_p=1.0)
    with engine_kernels():
        vllm_generator.load_engine_weights(llm, policy)  # and the prefix cache of the last policy's KV cleared
        return tuple(vllm_generator.vllm_generate(llm, prompts, seeds, sampling, task.eos_ids,
                                                  task.tokenizer.pad_token_id)[0] for sampling in (near_greedy, args))


def main(args: Args):
    rank, world_size = common.init_distributed()
    if args.vllm and world_size != 1:  # an in-process engine would build its world on the ranks' group, and hang
        common.fail(f"--vllm evaluates in one process, not {world_size}; leave out the launcher, or --vllm")
    common.seed_everything(args.seed + rank, torch_deterministic=True)  # as the training runs are
    if args.output_dir is None:
        if args.run_dir is None:
            common.fail("--model_paths without --run_dir needs --output_dir, where the table goes")
        args.output_dir = os.path.join(args.run_dir, "eval")
    to_evaluate = policies_to_evaluate(args)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    task = data.load_task(args, rank, dtype, evaluation=True)
    table = os.path.join(args.output_dir, "eval.jsonl")
    rows = []
    if os.path.isfile(table):  # a resumed evaluation keeps what it measured
        with open(table) as f:
            rows = [json.loads(line) for line in f]
    done = {row["policy"] for row in rows}
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(to_evaluate)} policies, {len(done & {e['policy'] for e in to_evaluate})} evaluated already")

    from transformers import AutoModelForCausalLM

    device = common.local_device()
    ref_policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype).to(device).eval()
    reward_model = None if args.reward_fn else data.load_reward_model(args.reward_model_path, dtype).to(device).eval()
    llm = start_engine(args) if args.vllm else None
    for entry in to_evaluate:
        if entry["policy"] in done:
            continue
        policy = AutoModelForCausalLM.from_pretrained(entry["policy"], dtype=dtype).to(device).eval()
        if not data.same_vocabulary(task.tokenizer, data.load_tokenizer(entry["policy"])):
            common.fail(f"policy {entry['policy']!r} has another vocabulary than the SFT policy "
                        f"{args.model_name_or_path!r}; KL and perplexity need the same one")
        update = entry["update"] or 0
        generated = engine_completions(args, llm, policy, task, update) if llm is not None else None
        metrics = evaluation.evaluate(args, task, policy, ref_policy, reward_model, update, generated=generated)
        rows.append({**entry, **metrics})
        if rank == 0:
            write_table(args.output_dir, rows)
            print(" ".join(f"{name.removeprefix('eval/')}={value:.4g}" if isinstance(value, float) else
                           f"{name}={value}" for name, value in rows[-1].items()), flush=True)
    if llm is not None:  # shut the engine down now, not at exit, after the process group it leans on has gone
        del llm
        gc.collect()
    if rank == 0:
        print(f"wrote {table} ({len(rows)} rows), eval.csv and eval.png beside it")


if __name__ == "__main__":
    main(cli.parse(Args, run_fields=RUN_FIELDS))
