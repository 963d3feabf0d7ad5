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
import outputs
import vllm_placement
from cli import ConfigFiles
from common import GenerationArgs
from data import DataArgs, RewardArgs
from evaluation import EvalArgs
from vllm_placement import EngineSettings


@dataclass
class Args:
    """What to evaluate and where, and whether a vLLM engine samples; the groups below hold the evaluation's
    settings and the engine's, the RL scripts' flags of the same names"""

    run_dir: str | None = None
    """a training run's output directory: its policies/update-N snapshots, its final policy and its SFT start
    (update 0) are evaluated, and every field below that the run recorded defaults to the run's value"""
    model_paths: list[str] = field(default_factory=list)
    """Hugging Face policies to evaluate, besides (or instead of) the run's"""
    output_dir: str | None = None
    """where the table (eval.jsonl, eval.csv) and plot (eval.png) go; default RUN_DIR/eval; an existing table
    is continued: policies already in it are not evaluated again"""
    bf16: bool = False
    """evaluate in bfloat16 (GPU runs)"""
    vllm: bool = False
    """generate the completions with a vLLM engine in this process (one engine, each policy's weights loaded
    into it) instead of HF `generate`: faster, and the same numbers in distribution (not the run's own
    samples); one process only, and the policies must have the SFT policy's architecture"""
    seed: int = 1
    """seed of the sampling (with --run_dir, the run's); each policy samples with the seed its run's evaluation
    of the same update had, so a run's own numbers come out again (on as many ranks)"""
    local_rank: int = -1
    """set by the deepspeed launcher"""

    # the RL scripts' flags of the same names (with --run_dir, the run's values)
    data: DataArgs = cli.group(DataArgs())
    reward: RewardArgs = cli.group(RewardArgs())
    evaluation: EvalArgs = cli.group(EvalArgs())
    generation: GenerationArgs = cli.group(GenerationArgs())

    # the engine of --vllm, on this process's device (the vLLM scripts' flags of the same names, not the run's)
    engine: EngineSettings = cli.group(EngineSettings())

    config_files: ConfigFiles = cli.group(ConfigFiles())


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
        found.append({"policy": args.data.model_name_or_path, "update": 0, "episode": 0})
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

    outputs.write_atomically(os.path.join(output_dir, "eval.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    columns = list(dict.fromkeys(name for row in rows for name in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, columns)
    writer.writeheader()
    writer.writerows(rows)
    outputs.write_atomically(os.path.join(output_dir, "eval.csv"), text.getvalue())
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
    os.environ.update(vllm_placement.shared_device_environment(args.engine.vllm_cpu_kv_cache_gib))
    with engine_kernels():
        return vllm_placement.start_vllm(args.data.model_name_or_path, args.bf16, args.seed,
                                         args.data.max_prompt_length + args.generation.response_length,
                                         args.engine.vllm_enforce_eager,
                                         args.engine.gpu_memory_utilization(shares_gpu=True))  # with the HF models


def engine_completions(args: Args, llm, policy, task, update: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The near-greedy and the sampled completions of every evaluation prompt by `policy`'s weights in the
    engine, each row with its own seed from (--seed, `update`, row).  -> (prompts, response_length) each"""
    import vllm_generator
    import weight_transport

    with engine_kernels():
        weight_transport.load_engine_weights(llm, policy)  # and the prefix cache of the last policy's KV cleared
        return vllm_generator.evaluation_completions(llm, task.eval_prompts["input_ids"], args.seed, update,
                                                     args.generation, args.evaluation.eval_temperature, task.eos_ids,
                                                     task.tokenizer.pad_token_id)


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
    task = data.load_task(args.data, args.reward, args.evaluation, None, rank, dtype, evaluate=True)
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
    ref_policy = AutoModelForCausalLM.from_pretrained(args.data.model_name_or_path, dtype=dtype).to(device).eval()
    reward_model = None
    if not args.reward.reward_fn:
        reward_model = data.load_reward_model(args.reward.reward_model_path, dtype).to(device).eval()
    llm = start_engine(args) if args.vllm else None
    for entry in to_evaluate:
        if entry["policy"] in done:
            continue
        policy = AutoModelForCausalLM.from_pretrained(entry["policy"], dtype=dtype).to(device).eval()
        if not data.same_vocabulary(task.tokenizer, data.load_tokenizer(entry["policy"])):
            common.fail(f"policy {entry['policy']!r} has another vocabulary than the SFT policy "
                        f"{args.data.model_name_or_path!r}; KL and perplexity need the same one")
        update = entry["update"] or 0
        generated = engine_completions(args, llm, policy, task, update) if llm is not None else None
        metrics = evaluation.evaluate(args.evaluation, args.generation, args.seed, task, policy, ref_policy,
                                      reward_model, update, generated=generated)
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
