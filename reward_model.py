"""Reward modelling: a Bradley-Terry reward model from (prompt, chosen, rejected) pairs, on a decoder (Llama,
Qwen2, Pythia, GPT-2: the score head read at the last real token, as the RL scripts read it) or an encoder
(BERT, RoBERTa, DeBERTa) backbone. With --relabel_with, a gold scorer first re-orders every pair where it
disagrees with the label (the paper's "gold-relabelled" proxy reward model data). The second step of the
pipeline: sft.py -> reward_model.py -> an RL script -> eval_checkpoints.py.

    python reward_model.py --relabel_with toy               # toy world: from its SFT policy, relabelled pairs
    deepspeed --num_gpus 8 reward_model.py --preset tldr-1b-8gpu --model_name_or_path OUT/policy
"""

import os
import shutil
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
    """start from configs/reward_model/NAME.yaml, a named configuration (the README lists them); flags override it"""
    config: str | None = None
    """a YAML file of these flags' values (`learning_rate: 3.0e-6` per line), or a run's args.json to repeat
    that run; applied after --preset, and the flags given override it"""

    # Model and data
    model_name_or_path: str = toy.SFT_POLICY
    """backbone to start from, usually the SFT policy (a local directory or hub id); loaded as a one-label
    AutoModelForSequenceClassification, whose score head starts fresh"""
    dataset_name: str = toy.PREFERENCE_DATASET
    """preference pairs: a hub id (owner/name, or owner/name:configuration), a `save_to_disk` directory, a
    data directory, or a .json/.jsonl/.parquet file"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "validation"
    """split of the validation accuracy; if the dataset has none, the last --eval_num_examples train pairs (at
    most a fifth of them) are held out of training for it"""
    prompt_column: str = "prompt"
    """column holding the prompt text"""
    prompt_template: str | None = None
    """a format string over the dataset's columns that makes the prompt, as in the RL scripts (default: the
    --prompt_column text as it is)"""
    chosen_column: str = "chosen"
    """column holding the preferred completion"""
    rejected_column: str = "rejected"
    """column holding the other completion"""
    chat_template: bool = False
    """wrap each prompt as a user message in the tokenizer's chat template (as the RL scripts then must too)"""
    max_prompt_length: int = 64
    """pairs whose prompt is longer than this many tokens are dropped (the count is printed)"""
    max_completion_length: int = 16
    """pairs with a completion longer than this many tokens (a decoder's with its stop token) are dropped"""
    relabel_with: str | None = None
    """a gold scorer ("toy": the toy world's; or a gold reward model's path): before training, swap chosen
    and rejected of every pair (train and evaluation) that it scores the other way round, and train on that;
    the relabelled dataset is written to OUTPUT_DIR/relabelled_dataset, and the share swapped is printed"""

    # Optimisation
    num_epochs: int = 2
    """passes over the train split"""
    per_device_train_batch_size: int = 32
    """pairs per micro-batch on each rank"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    learning_rate: float = 1e-3
    """peak learning rate, decayed linearly to 0 (the toy's backbone is small; Pythia's uses 3e-6)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""

    # Evaluation, logging, checkpoints
    eval_every: int = 50
    """compute the validation loss and accuracy every this many optimizer steps (and before the first and after
    the last); 0: never"""
    eval_num_examples: int = 512
    """validation pairs"""
    eval_batch_size: int = 64
    """pairs per validation forward pass on each rank"""
    save_every: int = 0
    """write a resumable checkpoint every this many optimizer steps (0: only on preemption)"""
    output_dir: str | None = None
    """run directory (metrics.jsonl, checkpoints, reward_model); default runs/<exp_name>__<seed>__<time>"""
    resume: bool = False
    """continue the run in --output_dir from its latest complete checkpoint, with the same arguments and ranks"""
    exp_name: str = os.path.splitext(os.path.basename(__file__))[0]
    """experiment name, used for the run directory and wandb"""
    seed: int = 1
    """seed of the data order and of the fresh score head"""
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
    """The pairs per optimizer step on this rank."""
    common.check_signs(args, ("num_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                              "learning_rate", "eval_num_examples", "eval_batch_size", "max_prompt_length",
                              "max_completion_length"), ("eval_every", "save_every"))
    if args.chosen_column == args.rejected_column:
        common.fail(f"--chosen_column and --rejected_column are both {args.chosen_column!r}; they must differ")
    return args.per_device_train_batch_size * args.gradient_accumulation_steps


def relabelled_dataset(args: Args, rank: int, tokenizer, dtype) -> str:
    """Write OUTPUT_DIR/relabelled_dataset: the train and evaluation splits with chosen and rejected swapped
    where the gold scorer (--relabel_with) scores them the other way round (ties keep their label), and
    return its path. Each rank scores its share of the pairs; a resumed run reads what its first run wrote."""
    from datasets import DatasetDict

    path = os.path.join(args.output_dir, "relabelled_dataset")
    if os.path.isdir(path):
        return path
    world_size = torch.distributed.get_world_size()
    gold_score = data.load_gold_scorer(args.relabel_with, dtype, tokenizer)
    splits = {}
    existing = data.split_names(args.dataset_name)
    for split in dict.fromkeys(s for s in (args.train_split, args.eval_split) if s in existing):
        rows = data.load_split(args.dataset_name, split)
        mine = rows.select(range(rank, len(rows), world_size))
        prompts = [data.prompt_text(args, row) for row in mine]
        swap_mine = []
        for start in range(0, len(mine), 256):
            window = slice(start, start + 256)
            chosen_gold = gold_score(prompts[window], mine[args.chosen_column][window])
            rejected_gold = gold_score(prompts[window], mine[args.rejected_column][window])
            swap_mine += [c < r for c, r in zip(chosen_gold, rejected_gold)]
        swaps = [None] * world_size
        torch.distributed.all_gather_object(swaps, swap_mine)
        swap = [swaps[i % world_size][i // world_size] for i in range(len(rows))]  # back in the dataset's order
        chosen, rejected = rows[args.chosen_column], rows[args.rejected_column]
        splits[split] = rows.remove_columns([args.chosen_column, args.rejected_column]).add_column(
            args.chosen_column, [r if s else c for c, r, s in zip(chosen, rejected, swap)]).add_column(
            args.rejected_column, [c if s else r for c, r, s in zip(chosen, rejected, swap)])
        if rank == 0:
            print(f"relabelled {split}: {sum(swap)} of {len(swap)} pairs ({sum(swap) / len(swap):.1%}) swapped, "
                  f"where {args.relabel_with} prefers the rejected completion")
    if rank == 0:
        partial = path + ".partial"
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while writing it
        DatasetDict(splits).save_to_disk(partial)
        os.rename(partial, path)
    torch.distributed.barrier()
    return path


def pair_scores(args: Args, model, tokenizer, rows: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the chosen and of the rejected completions, as the RL scripts read them.  -> (pairs,), (pairs,)

    A decoder reads its score head at the last real token (the stop token) of prompt + completion tokens,
    left-padded; an encoder scores the text, prompt + completion, with its own special tokens and padding
    (common.score_texts)."""
    columns = (args.chosen_column, args.rejected_column)
    if common.is_decoder_classifier(model):
        sequences = [p + c for column in columns for p, c in zip(rows["input_ids"], rows[f"{column}_ids"])]
        scores = common.reward_scores(model, *common.left_pad(sequences, tokenizer.pad_token_id, device))
    else:
        prompts = [data.prompt_text(args, dict(zip(rows, values))) for values in zip(*rows.values())]
        texts = [p + c for column in columns for p, c in zip(prompts, rows[column])]
        scores = common.score_texts(model, tokenizer, texts, [True] * len(texts))
    return scores.chunk(2)


def pair_accuracy(margin: torch.Tensor) -> torch.Tensor:
    """1 where the model orders a pair as labelled (chosen above rejected), 0 where the other way, 1/2 on a tie.
    margin: (pairs,) chosen score - rejected score"""
    return (margin > 0).float() + 0.5 * (margin == 0).float()


@torch.no_grad()
def validation(args: Args, model, tokenizer, examples) -> dict[str, float]:
    """Loss, accuracy (the share of pairs the model orders as labelled; a tie counts half) and mean scores
    over every evaluation pair (each rank takes its share)."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rows = examples.select(range(rank, len(examples), world_size))
    # pairs, summed loss, accuracy, chosen and rejected scores
    totals = torch.zeros(5, dtype=torch.float64, device=common.local_device())
    for start in range(0, len(rows), args.eval_batch_size):
        chosen, rejected = pair_scores(args, model, tokenizer, rows[start:start + args.eval_batch_size], totals.device)
        margin = chosen - rejected
        totals += torch.stack([torch.tensor(float(len(margin))), -F.logsigmoid(margin).sum(),
                               pair_accuracy(margin).sum(), chosen.sum(),
                               rejected.sum()]).to(totals)
    torch.distributed.all_reduce(totals)
    count, *sums = totals.tolist()
    return dict(zip(("eval/loss", "eval/accuracy", "eval/chosen_score", "eval/rejected_score"),
                    (value / count for value in sums)))


def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size = check_args(args)
    common.resolve_output_dir(args)
    common.seed_everything(args.seed + rank, args.torch_deterministic)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    data.build_named_toys([args.model_name_or_path, args.dataset_name])
    tokenizer = data.load_tokenizer(args.model_name_or_path, policy=False, base_model=True)
    if args.relabel_with == "toy":
        first = data.load_split(args.dataset_name, args.train_split)[0]
        try:
            toy.parse_query(data.prompt_text(args, first))
        except (ValueError, KeyError):
            common.fail(f"--relabel_with toy scores the embedded toy world's posts only, and {args.dataset_name!r} "
                        "holds others; give a gold reward model's path")
    if args.relabel_with and args.relabel_with != "toy":
        data.check_reward_model(args.relabel_with)
    from transformers import AutoModelForSequenceClassification, get_scheduler

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=1, dtype=dtype)
    model.config.pad_token_id = tokenizer.pad_token_id  # so that HF's own pooling works on the saved model too
    common.disable_dropout(model)
    # a decoder's score is read at its stop token, as the RL scripts read it; an encoder has no stop token
    columns, append_eos = [args.chosen_column, args.rejected_column], common.is_decoder_classifier(model)
    train_pairs, eval_pairs = data.load_examples(args, tokenizer, rank, columns, args.eval_num_examples, append_eos)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        common.prepare_output_dir(args)
    torch.distributed.barrier()
    if args.relabel_with:
        args.dataset_name = relabelled_dataset(args, rank, tokenizer, dtype)
        train_pairs, eval_pairs = data.load_examples(args, tokenizer, rank, columns, args.eval_num_examples,
                                                     append_eos)
    sampler = data.PromptSampler(len(train_pairs), local_batch_size, rank, world_size, args.seed)
    num_steps = args.num_epochs * sampler.batches_per_epoch

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=num_steps)
    model = common.prepare_deepspeed(model, args, optimizer, scheduler)

    state = common.OnlineTrainerState()
    if args.resume:
        state = common.load_checkpoint(args.output_dir, model)
        sampler.position = state.data_position
    logger = common.MetricsLogger(args, os.path.basename(args.output_dir), num_steps, state.update,
                                  ("train/loss", "eval/accuracy"))
    if state.update == 0 and args.eval_every:
        logger.log(0, {**validation(args, model, tokenizer, eval_pairs), "episode": 0})
    start_time, start_episode = time.time(), state.episode
    for step in range(state.update + 1, num_steps + 1):
        rows = train_pairs[sampler.next_indices()]  # {column: values}, this rank's share of the step
        losses, margins = [], []
        for start in range(0, local_batch_size, args.per_device_train_batch_size):
            end = start + args.per_device_train_batch_size
            micro_batch = {name: values[start:end] for name, values in rows.items()}
            chosen, rejected = pair_scores(args, model, tokenizer, micro_batch, model.device)  # (pairs,) each
            loss = -F.logsigmoid(chosen - rejected).mean()  # Bradley-Terry: P(chosen > rejected) = sigmoid(margin)
            model.backward(loss)
            model.step()  # DeepSpeed steps the optimizer after the step's last micro-batch
            losses.append(loss.item())
            margins.append((chosen - rejected).detach())
        margin = torch.cat(margins)
        state.update, state.episode, state.data_position = step, state.episode + local_batch_size * world_size, \
            sampler.position
        logger.log(step, {**common.all_reduce_mean({
            "train/loss": sum(losses) / len(losses),
            "train/accuracy": pair_accuracy(margin).mean().item(),
            "train/margin": margin.mean().item()}),
            "lr": model.get_lr()[0], "episode": state.episode,
            "eps": (state.episode - start_episode) / (time.time() - start_time)})
        if args.eval_every and (step % args.eval_every == 0 or step == num_steps):
            logger.log(step, {**validation(args, model, tokenizer, eval_pairs), "episode": state.episode})
        preempted = common.preemption_requested()
        if preempted or (args.save_every and step % args.save_every == 0):
            common.save_checkpoint(args.output_dir, model, state)
        if preempted:
            common.exit_preempted(step, logger)

    common.save_model(os.path.join(args.output_dir, "reward_model"), model, tokenizer, state)
    logger.close()
    if rank == 0:
        print(f"saved the reward model to {os.path.join(args.output_dir, 'reward_model')}")


if __name__ == "__main__":
    main(cli.parse(Args))
