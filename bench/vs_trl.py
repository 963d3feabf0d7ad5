"""Seconds per optimizer step of the kit's online_dpo.py against TRL's OnlineDPOTrainer, on the same work
(or, with --algorithm grpo, seconds per update of grpo.py against TRL's GRPOTrainer, and the accuracy both
reach on the arithmetic task: see GRPO below).

Both train the toy task's SFT policy (also the frozen reference) against its reward model, on CPU in
fp32, one optimizer step per batch of 8 prompts x 2 completions x at most 32 new tokens, with the same
temperature, beta and learning rate, no evaluation and no checkpoints. Three arms, interleaved
(kit, TRL tuned, TRL default, kit, ...) so that load on the machine hits them alike:

- kit: `online_dpo.py` (its seconds per update from the `time` field of its metrics.jsonl);
- TRL tuned: OnlineDPOTrainer with gradient checkpointing off;
- TRL default: OnlineDPOTrainer as its config comes, gradient checkpointing on (OnlineDPOConfig's default,
  inherited from TRL's base config), which also makes it generate without a KV cache (use_cache=False).

Each run is its own process; the first --warmup steps of each are not timed. The table gives, per arm, the
median over runs of each run's median seconds per step, the ratios TRL / kit (> 1: the kit is faster), the
mean per-step breakdown (generate; score = reference forward and reward model, plus, in the kit, a no-grad
policy forward of the samples its optimizer step leaves out, those of prompts whose two samples tie, for the
logged KL; train = the rest of the step: policy forward, backward, optimizer step), and the work done per
step: completions and how many stopped (same policy, so the same length distribution), and TRL's generated
tokens and decoding steps. The learning rate is small so that neither
policy drifts in the run: the completions, and so the work, stay those of the SFT policy on both sides.

GRPO (--algorithm grpo): both train the arithmetic task's SFT policy (toy-math) with its reward function,
as its preset does without DAPO's extras: 64 prompts x 4 completions x at most 24 new tokens per update, the
dapo loss, beta 0 (no reference model), group-scaled advantages, clip 0.2, and each update 4 epochs of one
optimizer step over the whole batch in 4 micro-batches (TRL: num_iterations 4, gradient accumulation 4,
weight decay 0.01 as the kit's AdamW). The timed arms run --steps updates each at the small learning rate;
then each side trains --accuracy_updates updates at the preset's learning rate (3e-5) and eval_checkpoints.py
scores both final policies the same way (near-greedy accuracy on the task's test split).

TRL is a benchmark-only dependency (requirements-bench.txt); the kit never imports it. Both sides run
with this interpreter:

    pip install -r requirements-bench.txt     # TRL and accelerate; keeps the pinned torch and transformers
    python bench/vs_trl.py                    # 5 repeats x 30 steps per arm, about 7 minutes on 2 cores
    python bench/vs_trl.py --quick            # a smoke test, under 2 minutes: 1 repeat x 4 steps (not a result)
    python bench/vs_trl.py --threads 1        # on a busy machine (see --threads)
    python bench/vs_trl.py --algorithm grpo   # grpo.py against GRPOTrainer: 5 x 8 updates per arm + accuracy
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("kit", "TRL tuned", "TRL default")
# local models and data only; TRL's experimental-API notice is noise in every run
ENVIRONMENT = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


@dataclass
class Args:
    algorithm: Literal["online_dpo", "grpo"] = "online_dpo"
    """online_dpo: online_dpo.py against OnlineDPOTrainer (seconds per optimizer step); grpo: grpo.py against
    GRPOTrainer (seconds per update, and accuracy)"""
    repeats: int = 5
    """runs of each arm, interleaved"""
    steps: int | None = None
    """optimizer steps per run (default 30); with --algorithm grpo, updates per run (default 8)"""
    warmup: int = 3
    """first steps of each run left out of the timings (at least 1: a step is timed from the end of the one before)"""
    prompts_per_step: int = 8
    """online DPO: prompts per optimizer step, 2 completions each (TRL's per_device_train_batch_size counts
    prompts)"""
    response_length: int = 32
    """online DPO: most new tokens per completion (both stop generating when every completion has stopped)"""
    temperature: float = 0.7
    """sampling temperature"""
    beta: float = 0.1
    """online DPO's beta"""
    accuracy_updates: int = 32
    """GRPO: updates of the runs whose final accuracy is compared (the preset's 32)"""
    learning_rate: float = 1e-6
    """small, so that the policy, and with it the length of its completions, stays the SFT policy's"""
    threads: int | None = None
    """torch threads of every run (OMP_NUM_THREADS); default torch's own, one per core. Use 1 on a busy
    machine, where OpenMP threads spin-waiting for a descheduled sibling can make a step 10x slower"""
    quick: bool = False
    """smoke test: 1 repeat x 4 steps, 1 warm-up step; results go to --output or runs/, never to bench/results"""
    output: str | None = None
    """results JSON (default bench/results/vs_trl.json, or runs/bench-vs-trl-quick.json with --quick)"""


def step_summary(steps: list[dict], warmup: int) -> dict:
    """A run's median seconds per step and mean per-step breakdown over the steps after `warmup`.
    steps: one dict per step, "time" the wall-clock time at its end, plus the breakdown."""
    timed = steps[warmup:]
    seconds = [b["time"] - a["time"] for a, b in zip(steps[warmup - 1:], timed)]
    parts = {name: statistics.mean(step[name] for step in timed) for name in timed[0] if name != "time"}
    return {"seconds_per_step": statistics.median(seconds), "seconds": seconds, **parts}


def run_kit(args: Args, folder: str) -> list[dict]:
    output_dir = os.path.join(folder, "kit")
    command = [sys.executable, os.path.join(ROOT, "online_dpo.py"),
               "--total_episodes", str(args.steps * args.prompts_per_step),
               "--per_device_train_batch_size", str(args.prompts_per_step), "--gradient_accumulation_steps", "1",
               "--num_samples", "2", "--response_length", str(args.response_length),
               "--temperature", str(args.temperature), "--beta", str(args.beta),
               "--learning_rate", str(args.learning_rate), "--eval_every", "0", "--output_dir", output_dir]
    subprocess_or_exit(command, args)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    samples = 2 * args.prompts_per_step  # by construction: sampled, and each scored once, every update
    return [{"time": m["time"], "generate": m["time/generate"], "score": m["time/score"], "train": m["time/train"],
             "completions": samples, "stopped": m["val/num_eos_tokens"], "scored": samples} for m in metrics]


# GRPO: the toy-math preset without DAPO's clip-higher and dynamic sampling (TRL has neither): 64 prompts x 4
# completions per update, 4 epochs of one optimizer step in 4 micro-batches of 16 prompts
GRPO_KIT = ["--preset", "toy-math", "--epsilon_high", "0.2", "--no_dynamic_sampling"]
GRPO_PROMPTS, GRPO_SAMPLES, GRPO_EPOCHS, GRPO_MICRO_BATCHES, GRPO_RESPONSE_LENGTH = 64, 4, 4, 4, 24
GRPO_LEARNING_RATE = 3e-5  # the preset's (grpo.py's default), for the accuracy runs


def run_kit_grpo(args: Args, folder: str, updates: int, learning_rate: float) -> list[dict]:
    """grpo.py for `updates` updates: per update, the time at its end and its breakdown (generate includes the
    reward function; score: the sampling weights' log-probs and the advantages)."""
    output_dir = os.path.join(folder, "kit")
    subprocess_or_exit([sys.executable, os.path.join(ROOT, "grpo.py"), *GRPO_KIT,
                        "--total_episodes", str(updates * GRPO_PROMPTS), "--learning_rate", str(learning_rate),
                        "--eval_every", "0", "--output_dir", output_dir], args)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        metrics = [m for m in map(json.loads, f) if "time/train" in m]
    return [{"time": m["time"], "generate": m["time/generate"], "score": m["time/score"], "train": m["time/train"],
             "completions": GRPO_PROMPTS * GRPO_SAMPLES, "stopped": m["val/num_eos_tokens"]} for m in metrics]


def run_trl_grpo(args: Args, folder: str, gradient_checkpointing: bool, updates: int, learning_rate: float,
                 save_to: str | None = None) -> list[dict]:
    result_path = os.path.join(folder, f"trl-grpo-gc{int(gradient_checkpointing)}.json")
    config = {"gradient_checkpointing": gradient_checkpointing, "output_dir": folder, "updates": updates,
              "learning_rate": learning_rate, "temperature": args.temperature, "save_to": save_to}
    subprocess_or_exit([sys.executable, os.path.abspath(__file__), "--trl-grpo-worker", json.dumps(config),
                        result_path], args)
    with open(result_path) as f:
        return json.load(f)


def trl_grpo_worker(config: dict, result_path: str):
    """One TRL GRPOTrainer run (this file with --trl-grpo-worker): writes, per update (a generation and its
    GRPO_EPOCHS optimizer steps), the wall-clock time at its end and what it did; saves the policy to
    config["save_to"] if given."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, ROOT)
    import math_reward
    import toy

    dataset = load_from_disk(toy.MATH_DATASET)["train"].rename_column("question", "prompt")

    def gsm8k_reward(prompts, completions, answer, **columns):  # TRL passes more columns than the kit
        return math_reward.gsm8k_reward(prompts, completions, answer)

    tokenizer = AutoTokenizer.from_pretrained(toy.MATH_POLICY)
    training_config = GRPOConfig(
        output_dir=config["output_dir"], max_steps=config["updates"] * GRPO_EPOCHS, seed=1,
        per_device_train_batch_size=GRPO_PROMPTS * GRPO_SAMPLES // GRPO_MICRO_BATCHES,  # completions
        gradient_accumulation_steps=GRPO_MICRO_BATCHES, num_generations=GRPO_SAMPLES,
        num_iterations=GRPO_EPOCHS, max_completion_length=GRPO_RESPONSE_LENGTH, temperature=config["temperature"],
        loss_type="dapo", beta=0.0, learning_rate=config["learning_rate"], weight_decay=0.01,
        gradient_checkpointing=config["gradient_checkpointing"], use_vllm=False, use_cpu=True, bf16=False,
        report_to="none", logging_strategy="no", eval_strategy="no", save_strategy="no", disable_tqdm=True)

    class UpdateClock(TrainerCallback):
        def __init__(self):
            self.updates, self.parts, self.begin = [], defaultdict(float), None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.begin is None:
                self.begin = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % GRPO_EPOCHS == 0:
                end = time.time()
                train = end - self.begin - self.parts["generate"] - self.parts["score"]
                self.updates.append({"time": end, **self.parts, "train": train})
                self.parts, self.begin = defaultdict(float), None

    clock = UpdateClock()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(toy.MATH_POLICY, dtype=torch.float32),
                          reward_funcs=gsm8k_reward, args=training_config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    generate, generate_and_score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(*call, **keywords):
        start = time.time()
        output = generate(*call, **keywords)
        clock.parts["generate"] += time.time() - start
        return output

    def timed_generate_and_score(*call, **keywords):  # score: the rest (rewards, old log-probs, advantages)
        start, generated = time.time(), clock.parts["generate"]
        output = generate_and_score(*call, **keywords)
        clock.parts["score"] += time.time() - start - (clock.parts["generate"] - generated)
        clock.parts["completions"] += len(output["completion_ids"])
        clock.parts["tokens"] += output["completion_mask"].sum().item()
        return output

    trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_generate_and_score
    trainer.train()
    if config["save_to"]:
        trainer.save_model(config["save_to"])
        tokenizer.save_pretrained(config["save_to"])
    with open(result_path, "w") as f:
        json.dump(clock.updates, f)


def grpo_accuracy(args: Args, folder: str) -> dict[str, float]:
    """Both sides trained --accuracy_updates updates at the preset's learning rate; their final policies'
    accuracy on the test split, from eval_checkpoints.py (the kit's evaluation, the same for both)."""
    run_kit_grpo(args, folder, args.accuracy_updates, GRPO_LEARNING_RATE)
    trl_policy = os.path.join(folder, "trl_policy")
    run_trl_grpo(args, folder, False, args.accuracy_updates, GRPO_LEARNING_RATE, save_to=trl_policy)
    policies = {"kit": os.path.join(folder, "kit", "policy"), "TRL tuned": trl_policy}
    subprocess_or_exit([sys.executable, os.path.join(ROOT, "eval_checkpoints.py"), "--model_paths",
                        *policies.values(), "--output_dir", os.path.join(folder, "eval"),
                        "--model_name_or_path", "toy:math_policy", "--reward_fn", "math_reward:gsm8k_reward",
                        "--dataset_name", "toy:math_dataset", "--eval_split", "test", "--prompt_column", "question",
                        "--answer_column", "answer", "--max_prompt_length", "16",
                        "--response_length", str(GRPO_RESPONSE_LENGTH)], args)
    with open(os.path.join(folder, "eval", "eval.jsonl")) as f:
        rows = {row["policy"]: row for row in map(json.loads, f)}
    return {arm: rows[path]["eval/accuracy"] for arm, path in policies.items()}


def run_trl(args: Args, folder: str, gradient_checkpointing: bool) -> list[dict]:
    result_path = os.path.join(folder, f"trl-gc{int(gradient_checkpointing)}.json")
    config = {**asdict(args), "gradient_checkpointing": gradient_checkpointing, "output_dir": folder}
    subprocess_or_exit([sys.executable, os.path.abspath(__file__), "--trl-worker", json.dumps(config), result_path],
                       args)
    with open(result_path) as f:
        return json.load(f)


def subprocess_or_exit(command: list[str], args: Args):
    environment = ENVIRONMENT | ({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=environment)
    if result.returncode:
        sys.exit(f"this run failed (exit {result.returncode}): {' '.join(command[1:3])}\n{result.stderr[-3000:]}")


def trl_worker(config: dict, result_path: str):
    """One TRL run (this file with --trl-worker): writes, per optimizer step, the wall-clock time at its end
    and what the step did (seconds in generation and scoring, completions, tokens)."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    sys.path.insert(0, ROOT)
    import toy

    # TRL scores prompt + decoded completion as one string, and the word-level toy tokenizer decodes a
    # completion without a leading space: the trailing space keeps "TL;DR:" apart from the first word
    # (the prompt tokenizes the same with it)
    dataset = load_from_disk(toy.DATASET)["train"].select_columns(["query"])
    dataset = dataset.map(lambda row: {"prompt": row["query"] + " "}, remove_columns=["query"])
    policy = AutoModelForCausalLM.from_pretrained(toy.SFT_POLICY, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(toy.SFT_POLICY, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(toy.REWARD_MODEL, num_labels=1,
                                                                      dtype=torch.float32)
    training_config = OnlineDPOConfig(
        output_dir=config["output_dir"], max_steps=config["steps"], seed=1,
        per_device_train_batch_size=config["prompts_per_step"], gradient_accumulation_steps=1,
        max_new_tokens=config["response_length"], temperature=config["temperature"], beta=config["beta"],
        learning_rate=config["learning_rate"], gradient_checkpointing=config["gradient_checkpointing"],
        use_vllm=False, use_cpu=True, bf16=False,  # bf16 defaults to True in TRL: autocast, even on CPU
        report_to="none", logging_strategy="no", eval_strategy="no", save_strategy="no", disable_tqdm=True)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps, self.parts, self.begin = [], defaultdict(float), 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.time()
            train = end - self.begin - self.parts["generate"] - self.parts["score"]
            self.steps.append({"time": end, **self.parts, "train": train})
            self.parts = defaultdict(float)

    clock = StepClock()
    trainer = OnlineDPOTrainer(model=policy, ref_model=reference, reward_funcs=reward_model, args=training_config,
                               train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(toy.SFT_POLICY),
                               reward_processing_classes=AutoTokenizer.from_pretrained(toy.REWARD_MODEL),
                               callbacks=[clock])
    generate, forward, rewards = trainer._generate, trainer._forward, trainer._calculate_rewards_from_functions
    eos_ids = torch.tensor(trainer.eos_token_ids)

    def timed_generate(*call, **keywords):
        start = time.time()
        output = generate(*call, **keywords)
        clock.parts["generate"] += time.time() - start
        completion_ids, completion_mask = output[2], output[3]
        clock.parts["completions"] += len(completion_ids)
        clock.parts["stopped"] += torch.isin(completion_ids, eos_ids).any(dim=1).sum().item()
        clock.parts["tokens"] += completion_mask.sum().item()
        clock.parts["decoding_steps"] += completion_ids.shape[1]
        return output

    def timed_forward(*call, **keywords):
        start = time.time()
        output = forward(*call, **keywords)
        if not torch.is_grad_enabled():  # the reference's forward; the policy's is part of training
            clock.parts["score"] += time.time() - start
        return output

    def timed_rewards(prompts, *call, **keywords):
        start = time.time()
        output = rewards(prompts, *call, **keywords)
        clock.parts["score"] += time.time() - start
        clock.parts["scored"] += len(prompts)
        return output

    trainer._generate, trainer._forward = timed_generate, timed_forward
    trainer._calculate_rewards_from_functions = timed_rewards
    trainer.train()
    with open(result_path, "w") as f:
        json.dump(clock.steps, f)


def main(args: Args):
    grpo = args.algorithm == "grpo"
    args.steps = args.steps or (8 if grpo else 30)
    if args.quick:
        args.repeats, args.steps, args.warmup, args.accuracy_updates = 1, 4, 1, 4
    if not 1 <= args.warmup < args.steps:
        sys.exit(f"error: --warmup {args.warmup} must be at least 1 and below --steps {args.steps}")
    name = "vs_trl_grpo" if grpo else "vs_trl"
    output = args.output or os.path.join(ROOT, "runs" if args.quick else "bench/results",
                                         f"bench-{name}-quick.json" if args.quick else f"{name}.json")
    unit = "update" if grpo else "step"
    runs = {arm: [] for arm in ARMS}
    for repeat in range(1, args.repeats + 1):
        for arm in ARMS:
            print(f"repeat {repeat}/{args.repeats}: {arm}, {args.steps} {unit}s", flush=True)
            with tempfile.TemporaryDirectory() as folder:
                if grpo:
                    steps = (run_kit_grpo(args, folder, args.steps, args.learning_rate) if arm == "kit" else
                             run_trl_grpo(args, folder, arm == "TRL default", args.steps, args.learning_rate))
                else:
                    steps = (run_kit(args, folder) if arm == "kit" else
                             run_trl(args, folder, gradient_checkpointing=arm == "TRL default"))
            runs[arm].append(step_summary(steps, args.warmup))
    accuracy = None
    if grpo:
        print(f"accuracy: kit and TRL tuned, {args.accuracy_updates} updates each at learning rate "
              f"{GRPO_LEARNING_RATE:g}", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            accuracy = grpo_accuracy(args, folder)

    # per arm: the median over runs of each number of the runs
    table = {arm: {name: statistics.median(run[name] for run in arm_runs) for name in arm_runs[0]
                   if name != "seconds"} for arm, arm_runs in runs.items()}
    kit = table["kit"]["seconds_per_step"]
    ratios = {f"{arm} / kit": table[arm]["seconds_per_step"] / kit for arm in ARMS[1:]}
    work = (f"{GRPO_PROMPTS} prompts x {GRPO_SAMPLES} completions x at most {GRPO_RESPONSE_LENGTH} tokens and "
            f"{GRPO_EPOCHS} optimizer steps per update" if grpo else
            f"{args.prompts_per_step} prompts x 2 completions x at most {args.response_length} tokens per step")
    print(f"\n{work}, {args.repeats} runs x {args.steps} {unit}s per arm ({args.warmup} warm-up), CPU fp32, "
          f"{args.threads or 'default'} torch threads; medians over runs")
    columns = ["seconds_per_step", "generate", "score", "train", "completions", "stopped", "scored", "tokens",
               "decoding_steps"]
    columns = [column for column in columns if any(column in row for row in table.values())]
    print(f"{'arm':12} " + " ".join(f"{column.replace('seconds_per_step', f's/{unit}'):>12}" for column in columns))
    for arm, row in table.items():
        print(f"{arm:12} " + " ".join(f"{row[column]:12.3f}" if column in row else f"{'-':>12}" for column in columns))
    if grpo:
        print("generate: sampling (kit: and the reward function); score: the rewards (TRL), the sampling weights' "
              "log-probs, advantages; train: the rest of the update")
        print("accuracy after", args.accuracy_updates, "updates:", ", ".join(f"{arm} {value:.3f}"
                                                                          for arm, value in accuracy.items()))
    else:
        print("score: reference forward + reward model (kit: + a no-grad policy forward of tied prompts' samples, "
              "for the logged KL); train: the rest of the step")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x seconds per {unit} (> 1: the kit is faster)")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump({"args": asdict(args), "table": table, "ratios": ratios, "accuracy": accuracy, "runs": runs}, f,
                  indent=1)
    print(f"results in {output}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trl-worker"]:  # a TRL run, started by run_trl
        trl_worker(json.loads(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["--trl-grpo-worker"]:  # a TRL GRPO run, started by run_trl_grpo
        trl_grpo_worker(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main(tyro.cli(Args))
