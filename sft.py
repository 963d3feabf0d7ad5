"""Supervised fine-tuning: the next-token loss on the completion tokens of (prompt, completion) pairs. The
first step of the paper's pipeline (sft.py -> reward_model.py -> an RL script -> eval_checkpoints.py): the
SFT policy that the reward model and RL start from.

    python sft.py                                          # toy world: its untrained policy on its SFT data
    deepspeed --num_gpus 8 sft.py --preset tldr-1b-8gpu    # Pythia 1B on TL;DR
"""

import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import cli
import common
import data
import toy


@dataclass
class Args:
    # Configuration
    preset: str | None = None
    """start from configs/sft/NAME.yaml, a named configuration (the README lists them); flags override it"""
    config: str | None = None
    """a YAML file of these flags' values (`learning_rate: 3.0e-6` per line), or a run's args.json to repeat
    that run; applied after --preset, and the flags given override it"""

    # Model and data
    model_name_or_path: str = toy.BASE_POLICY
    """pretrained causal LM to fine-tune (a local directory or hub id); a tokenizer without a pad token pads
    with its stop token, and the saved policy keeps that"""
    dataset_name: str = toy.SFT_DATASET
    """(prompt, completion) examples: a hub id (owner/name, or owner/name:configuration), a `save_to_disk`
    directory, a data directory, or a .json/.jsonl/.parquet file"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "validation"
    """split of the evaluation loss; if the dataset has none, the last --eval_num_examples train examples (at
    most a fifth of them) are held out of training for it"""
    prompt_column: str = "prompt"
    """column holding the prompt text (no loss on its tokens)"""
    prompt_template: str | None = None
    """a format string over the dataset's columns that makes the prompt, as in the RL scripts (default: the
    --prompt_column text as it is)"""
    completion_column: str = "completion"
    """column holding the target completion; the stop token is appended unless it already ends with it"""
    chat_template: bool = False
    """wrap each prompt as a user message in the tokenizer's chat template (as the RL scripts then must too)"""
    max_prompt_length: int = 64
    """examples whose prompt is longer than this many tokens are dropped (the count is printed)"""
    max_completion_length: int = 16
    """examples whose completion, with its stop token, is longer than this many tokens are dropped (cutting
    them would teach the policy not to stop)"""

    # Optimisation
    num_epochs: int = 5
    """passes over the train split"""
    per_device_train_batch_size: int = 32
    """examples per micro-batch on each rank"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    learning_rate: float = 3e-3
    """peak learning rate (the toy's policy is small and untrained; Pythia's SFT uses 3e-6)"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up, before the linear decay to 0"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""

    # Evaluation, logging, checkpoints
    eval_every: int = 100
    """compute the evaluation loss every this many optimizer steps (and before the first and after the
    last); 0: never"""
    eval_num_examples: int = 512
    """evaluation examples"""
    eval_batch_size: int = 64
    """examples per evaluation forward pass on each rank"""
    save_every: int = 0
    """write a resumable checkpoint every this many optimizer steps (0: only on preemption)"""
    output_dir: str | None = None
    """run directory (metrics.jsonl, checkpoints, policy); default runs/<exp_name>__<seed>__<time>"""
    resume: bool = False
    """continue the run in --output_dir from its latest complete checkpoint, with the same arguments and ranks"""
    exp_name: str = os.path.splitext(os.path.basename(__file__))[0]
    """experiment name, used for the run directory and wandb"""
    seed: int = 1
    """seed of the data order"""
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
    """DeepSpeed ZeRO stage (2 on a single rank runs as stage 0: nothing to partition)"""
    bf16: bool = False
    """train in bfloat16 (GPU runs)"""
    local_rank: int = -1
    """set by the deepspeed launcher"""


def check_args(args: Args) -> int:
    """The examples per optimizer step on this rank."""
    common.check_signs(args, ("num_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                              "learning_rate", "eval_num_examples", "eval_batch_size", "max_prompt_length",
                              "max_completion_length"), ("eval_every", "save_every", "warmup_steps"))
    return args.per_device_train_batch_size * args.gradient_accumulation_steps


def batch_inputs(args: Args, rows: dict, pad_token_id: int, device):
    """Prompt + completion, left-padded, and which target tokens are completion tokens.
    -> input_ids, attention_mask: (batch, length); is_target: (batch, length - 1), 1 where input_ids[:, 1:]
    is a completion token"""
    completions = rows[f"{args.completion_column}_ids"]
    sequences = [p + c for p, c in zip(rows["input_ids"], completions)]
    input_ids, attention_mask = common.left_pad(sequences, pad_token_id, device)
    completion_masks = [[0] * len(p) + [1] * len(c) for p, c in zip(rows["input_ids"], completions)]
    is_completion, _ = common.left_pad(completion_masks, 0, device)
    return input_ids, attention_mask, is_completion[:, 1:]


def completion_nll(model, input_ids, attention_mask, is_target) -> torch.Tensor:
    """Summed negative log-likelihood of the completion tokens of each row.  -> (batch,)"""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=common.position_ids(attention_mask)).logits[:, :-1]  # (batch, length - 1, vocab)
    token_nll = F.cross_entropy(logits.float().transpose(1, 2), input_ids[:, 1:], reduction="none")
    return (token_nll * is_target).sum(1)


@torch.no_grad()
def evaluation_loss(args: Args, model, examples, pad_token_id: int) -> dict[str, float]:
    """Mean negative log-likelihood per completion token over every evaluation example (each rank takes its
    share), and its perplexity."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = examples.select(range(rank, len(examples), world_size))
    totals = torch.zeros(2, dtype=torch.float64, device=common.local_device())  # summed nll, completion tokens
    for start in range(0, len(rows), args.eval_batch_size):
        batch = rows[start:start + args.eval_batch_size]
        input_ids, attention_mask, is_target = batch_inputs(args, batch, pad_token_id, totals.device)
        totals[0] += completion_nll(model, input_ids, attention_mask, is_target).sum().item()
        totals[1] += is_target.sum().item()
    torch.distributed.all_reduce(totals)
    loss = (totals[0] / totals[1]).item()
    return {"eval/loss": loss, "eval/perplexity": math.exp(loss)}


def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size = check_args(args)
    common.resolve_output_dir(args)
    common.seed_everything(args.seed + rank, args.torch_deterministic)
    data.build_named_toys([args.model_name_or_path, args.dataset_name])
    tokenizer = data.load_tokenizer(args.model_name_or_path, base_model=True)
    train_examples, eval_examples = data.load_examples(args, tokenizer, rank, [args.completion_column],
                                                       args.eval_num_examples)
    sampler = data.PromptSampler(len(train_examples), local_batch_size, rank, world_size, args.seed)
    num_steps = args.num_epochs * sampler.batches_per_epoch
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        common.prepare_output_dir(args)
    torch.distributed.barrier()

    from transformers import AutoModelForCausalLM, get_scheduler

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path,
                                                 dtype=torch.bfloat16 if args.bf16 else torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id  # the RL scripts' generate uses it
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=num_steps)
    model = common.prepare_deepspeed(model, args, optimizer, scheduler)

    state = common.OnlineTrainerState()
    if args.resume:
        state = common.load_checkpoint(args.output_dir, model)
        sampler.position = state.data_position
    logger = common.MetricsLogger(args, os.path.basename(args.output_dir), num_steps, state.update,
                                  ("train/loss", "eval/perplexity"))
    if state.update == 0 and args.eval_every:
        logger.log(0, {**evaluation_loss(args, model, eval_examples, tokenizer.pad_token_id), "episode": 0})
    start_time, start_episode = time.time(), state.episode
    for step in range(state.update + 1, num_steps + 1):
        rows = train_examples[sampler.next_indices()]  # {column: values}, this rank's share of the step
        input_ids, attention_mask, is_target = batch_inputs(args, rows, tokenizer.pad_token_id, model.device)
        # The step's loss is the mean over every completion token of the step, on all ranks (not a mean of
        # micro-batch means, which would weigh the tokens of short completions more): each micro-batch's
        # summed nll over the step's token count, times what DeepSpeed divides by (accumulation, ranks).
        step_tokens = is_target.sum().to(torch.float64)
        torch.distributed.all_reduce(step_tokens)
        scale = args.gradient_accumulation_steps * world_size
        summed_nll = 0.0
        for micro_batch in torch.arange(local_batch_size).split(args.per_device_train_batch_size):
            nll = completion_nll(model, input_ids[micro_batch], attention_mask[micro_batch], is_target[micro_batch])
            model.backward(nll.sum() * scale / step_tokens.item())
            model.step()  # DeepSpeed steps the optimizer after the step's last micro-batch
            summed_nll += nll.sum().item()
        state.update, state.episode, state.data_position = step, state.episode + local_batch_size * world_size, \
            sampler.position
        train_loss = torch.tensor(summed_nll, dtype=torch.float64, device=model.device)
        torch.distributed.all_reduce(train_loss)
        logger.log(step, {"train/loss": train_loss.item() / step_tokens.item(), "lr": model.get_lr()[0],
                          "episode": state.episode, "tokens": step_tokens.item(),
                          "eps": (state.episode - start_episode) / (time.time() - start_time)})
        if args.eval_every and (step % args.eval_every == 0 or step == num_steps):
            logger.log(step, {**evaluation_loss(args, model, eval_examples, tokenizer.pad_token_id),
                              "episode": state.episode})
        preempted = common.preemption_requested()
        if preempted or (args.save_every and step % args.save_every == 0):
            common.save_checkpoint(args.output_dir, model, state)
        if preempted:
            common.exit_preempted(step, logger)

    common.save_model(os.path.join(args.output_dir, "policy"), model, tokenizer, state)
    logger.close()
    if rank == 0:
        print(f"saved the SFT policy to {os.path.join(args.output_dir, 'policy')}")


if __name__ == "__main__":
    main(cli.parse(Args))
