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

import torch
import torch.nn.functional as F

import cli
import common
import data
import outputs
import toy
from cli import ConfigFiles
from common import DistributedArgs, OptimizerArgs
from data import DataArgs
from outputs import RunArgs


@dataclass
class Args:
    """SFT's own flags; the groups below hold those it shares with other scripts, each declared in the module
    that reads it"""

    completion_column: str = "completion"
    """column holding the target completion; the stop token is appended unless it already ends with it"""
    max_completion_length: int = 16
    """examples whose completion, with its stop token, is longer than this many tokens are dropped (cutting
    them would teach the policy not to stop)"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up, before the linear decay to 0"""
    eval_num_examples: int = 512
    """evaluation examples"""
    eval_batch_size: int = 64
    """examples per evaluation forward pass on each rank"""

    # the flags it shares with other scripts, by kind (flat names on the command line: --learning_rate)
    data: DataArgs = cli.group(DataArgs(model_name_or_path=toy.BASE_POLICY, dataset_name=toy.SFT_DATASET,
                                        prompt_column="prompt"))
    optimizer: OptimizerArgs = cli.group(OptimizerArgs(per_device_train_batch_size=32, gradient_accumulation_steps=1,
                                                       num_epochs=5, learning_rate=3e-3))
    run: RunArgs = cli.group(RunArgs(eval_every=100))
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def check_args(args: Args) -> int:
    """The examples per optimizer step on this rank."""
    common.check_signs(args, ("eval_num_examples", "eval_batch_size", "max_completion_length"), ("warmup_steps",))
    return args.optimizer.per_device_train_batch_size * args.optimizer.gradient_accumulation_steps


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
    outputs.resolve_output_dir(args.run)
    common.seed_everything(args.run.seed + rank, args.run.torch_deterministic)
    data.build_named_toys([args.data.model_name_or_path, args.data.dataset_name])
    tokenizer = data.load_tokenizer(args.data.model_name_or_path, base_model=True)
    train_examples, eval_examples = data.load_examples(args.data, tokenizer, rank, [args.completion_column],
                                                       args.max_completion_length, args.eval_num_examples)
    sampler = data.PromptSampler(len(train_examples), local_batch_size, rank, world_size, args.run.seed)
    num_steps = args.optimizer.num_epochs * sampler.batches_per_epoch
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        outputs.prepare_output_dir(args.run, cli.flag_values(args))
    torch.distributed.barrier()

    from transformers import AutoModelForCausalLM, get_scheduler

    model = AutoModelForCausalLM.from_pretrained(args.data.model_name_or_path,
                                                 dtype=torch.bfloat16 if args.distributed.bf16 else torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id  # the RL scripts' generate uses it
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.optimizer.learning_rate)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=num_steps)
    model = common.prepare_deepspeed(model, args.distributed, args.optimizer, optimizer, scheduler)

    state = outputs.OnlineTrainerState()
    if args.run.resume:
        state = outputs.load_checkpoint(args.run.output_dir, model)
        sampler.position = state.data_position
    logger = outputs.MetricsLogger(args.run, cli.flag_values(args), num_steps, state.update,
                                  ("train/loss", "eval/perplexity"))
    if state.update == 0 and args.run.eval_every:
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
        scale = args.optimizer.gradient_accumulation_steps * world_size
        summed_nll = 0.0
        for micro_batch in torch.arange(local_batch_size).split(args.optimizer.per_device_train_batch_size):
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
        if args.run.eval_every and (step % args.run.eval_every == 0 or step == num_steps):
            logger.log(step, {**evaluation_loss(args, model, eval_examples, tokenizer.pad_token_id),
                              "episode": state.episode})
        preempted = common.preemption_requested()
        if preempted or (args.run.save_every and step % args.run.save_every == 0):
            outputs.save_checkpoint(args.run.output_dir, model, state)
        if preempted:
            common.exit_preempted(step, logger)

    outputs.save_model(os.path.join(args.run.output_dir, "policy"), model, tokenizer, state)
    logger.close()
    if rank == 0:
        print(f"saved the SFT policy to {os.path.join(args.run.output_dir, 'policy')}")


if __name__ == "__main__":
    main(cli.parse(Args))
