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
    """The reward model's own flags; the groups below hold those it shares with other scripts, each declared in
    the module that reads it"""

    chosen_column: str = "chosen"
    """column holding the preferred completion"""
    rejected_column: str = "rejected"
    """column holding the other completion"""
    max_completion_length: int = 16
    """pairs with a completion longer than this many tokens (a decoder's with its stop token) are dropped"""
    relabel_with: str | None = None
    """a gold scorer ("toy": the toy world's; or a gold reward model's path): before training, swap chosen
    and rejected of every pair (train and evaluation) that it scores the other way round, and train on that;
    the relabelled dataset is written to OUTPUT_DIR/relabelled_dataset, and the share swapped is printed"""
    eval_num_examples: int = 512
    """validation pairs"""
    eval_batch_size: int = 64
    """pairs per validation forward pass on each rank"""

    # the flags it shares with other scripts, by kind (flat names on the command line: --learning_rate)
    data: DataArgs = cli.group(DataArgs(dataset_name=toy.PREFERENCE_DATASET, prompt_column="prompt"))
    optimizer: OptimizerArgs = cli.group(OptimizerArgs(per_device_train_batch_size=32, gradient_accumulation_steps=1,
                                                       num_epochs=2, learning_rate=1e-3))
    run: RunArgs = cli.group(RunArgs(eval_every=50))
    distributed: DistributedArgs = cli.group(DistributedArgs())
    config_files: ConfigFiles = cli.group(ConfigFiles())


def check_args(args: Args) -> int:
    """The pairs per optimizer step on this rank."""
    common.check_signs(args, ("eval_num_examples", "eval_batch_size", "max_completion_length"))
    if args.chosen_column == args.rejected_column:
        common.fail(f"--chosen_column and --rejected_column are both {args.chosen_column!r}; they must differ")
    return args.optimizer.per_device_train_batch_size * args.optimizer.gradient_accumulation_steps


def relabelled_dataset(args: Args, rank: int, tokenizer, dtype) -> str:
    """Write OUTPUT_DIR/relabelled_dataset: the train and evaluation splits with chosen and rejected swapped
    where the gold scorer (--relabel_with) scores them the other way round (ties keep their label), and
    return its path. Each rank scores its share of the pairs; a resumed run reads what its first run wrote."""
    from datasets import DatasetDict

    path = os.path.join(args.run.output_dir, "relabelled_dataset")
    if os.path.isdir(path):
        return path
    world_size = torch.distributed.get_world_size()
    gold_score = data.load_gold_scorer(args.relabel_with, dtype, tokenizer)
    splits = {}
    existing = data.split_names(args.data.dataset_name)
    for split in dict.fromkeys(s for s in (args.data.train_split, args.data.eval_split) if s in existing):
        rows = data.load_split(args.data.dataset_name, split)
        mine = rows.select(range(rank, len(rows), world_size))
        prompts = [data.prompt_text(args.data, row) for row in mine]
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
        prompts = [data.prompt_text(args.data, dict(zip(rows, values))) for values in zip(*rows.values())]
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
        totals += torch.stack([torch.tensor(float(len(margin)), device=margin.device), -F.logsigmoid(margin).sum(),
                               pair_accuracy(margin).sum(), chosen.sum(),
                               rejected.sum()]).to(totals)
    torch.distributed.all_reduce(totals)
    count, *sums = totals.tolist()
    return dict(zip(("eval/loss", "eval/accuracy", "eval/chosen_score", "eval/rejected_score"),
                    (value / count for value in sums)))


def main(args: Args):
    rank, world_size = common.init_distributed()
    local_batch_size = check_args(args)
    outputs.resolve_output_dir(args.run)
    common.seed_everything(args.run.seed + rank, args.run.torch_deterministic)
    dtype = torch.bfloat16 if args.distributed.bf16 else torch.float32
    data.build_named_toys([args.data.model_name_or_path, args.data.dataset_name])
    tokenizer = data.load_tokenizer(args.data.model_name_or_path, policy=False, base_model=True)
    if args.relabel_with == "toy":
        first = data.load_split(args.data.dataset_name, args.data.train_split)[0]
        try:
            toy.parse_query(data.prompt_text(args.data, first))
        except (ValueError, KeyError):
            common.fail(f"--relabel_with toy scores the embedded toy world's posts only, and "
                        f"{args.data.dataset_name!r} holds others; give a gold reward model's path")
    if args.relabel_with and args.relabel_with != "toy":
        data.check_reward_model(args.relabel_with)
    from transformers import AutoModelForSequenceClassification, get_scheduler

    model = AutoModelForSequenceClassification.from_pretrained(args.data.model_name_or_path, num_labels=1, dtype=dtype)
    model.config.pad_token_id = tokenizer.pad_token_id  # so that HF's own pooling works on the saved model too
    common.disable_dropout(model)
    # a decoder's score is read at its stop token, as the RL scripts read it; an encoder has no stop token
    columns, append_eos = [args.chosen_column, args.rejected_column], common.is_decoder_classifier(model)
    train_pairs, eval_pairs = data.load_examples(args.data, tokenizer, rank, columns, args.max_completion_length,
                                                 args.eval_num_examples, append_eos)
    if rank == 0:  # only now, so that bad input leaves no output directory behind
        outputs.prepare_output_dir(args.run, cli.flag_values(args))
    torch.distributed.barrier()
    if args.relabel_with:
        args.data.dataset_name = relabelled_dataset(args, rank, tokenizer, dtype)
        train_pairs, eval_pairs = data.load_examples(args.data, tokenizer, rank, columns, args.max_completion_length,
                                                     args.eval_num_examples, append_eos)
    sampler = data.PromptSampler(len(train_pairs), local_batch_size, rank, world_size, args.run.seed)
    num_steps = args.optimizer.num_epochs * sampler.batches_per_epoch

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.optimizer.learning_rate)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=num_steps)
    model = common.prepare_deepspeed(model, args.distributed, args.optimizer, optimizer, scheduler)

    state = outputs.OnlineTrainerState()
    if args.run.resume:
        state = outputs.load_checkpoint(args.run.output_dir, model)
        sampler.position = state.data_position
    logger = outputs.MetricsLogger(args.run, cli.flag_values(args), num_steps, state.update,
                                  ("train/loss", "eval/accuracy"))
    if state.update == 0 and args.run.eval_every:
        logger.log(0, {**validation(args, model, tokenizer, eval_pairs), "episode": 0})
    start_time, start_episode = time.time(), state.episode
    for step in range(state.update + 1, num_steps + 1):
        rows = train_pairs[sampler.next_indices()]  # {column: values}, this rank's share of the step
        losses, margins = [], []
        for start in range(0, local_batch_size, args.optimizer.per_device_train_batch_size):
            end = start + args.optimizer.per_device_train_batch_size
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
        if args.run.eval_every and (step % args.run.eval_every == 0 or step == num_steps):
            logger.log(step, {**validation(args, model, tokenizer, eval_pairs), "episode": state.episode})
        preempted = common.preemption_requested()
        if preempted or (args.run.save_every and step % args.run.save_every == 0):
            outputs.save_checkpoint(args.run.output_dir, model, state)
        if preempted:
            common.exit_preempted(step, logger)

    outputs.save_model(os.path.join(args.run.output_dir, "reward_model"), model, tokenizer, state)
    logger.close()
    if rank == 0:
        print(f"saved the reward model to {os.path.join(args.run.output_dir, 'reward_model')}")


if __name__ == "__main__":
    main(cli.parse(Args))
