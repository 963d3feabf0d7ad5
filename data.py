"""What a run loads: the policy's tokenizer and stop tokens, the reward (a reward model or a Python
function), PPO's value model, the prompt datasets, the gold scorer of the evaluation, and the resumable
order of the prompts. data.load_task gathers them into the Task every script starts from
(common.Task); the embedded toy tasks (the toy package) are built here, on first use.

Every check that can fail on a user's input runs here, before a run writes anything, and fails with
one line that names the bad value.
"""

import contextlib
import json
import os
from dataclasses import dataclass

import torch

import common
import evaluation
import lora
import toy


@dataclass
class DatasetArgs(common.FlagGroup):
    """Model and data: the policy to start from, and the dataset"""

    model_name_or_path: str = toy.SFT_POLICY
    """the policy to start from (a local directory or hub id): in the RL scripts the SFT policy, also the frozen
    reference policy; sft.py's a pretrained causal LM (a tokenizer without a pad token pads with its stop
    token, and the saved policy keeps that); reward_model.py's the backbone of the reward model"""
    dataset_name: str = toy.DATASET
    """the prompts (sft.py: with completions; reward_model.py: preference pairs; grpo_multiturn.py: the rows
    episodes start from): a hub id (owner/name, or owner/name:configuration), a `save_to_disk` directory, a data
    directory, or a .json/.jsonl/.parquet file"""
    train_split: str = "train"
    """split to train on"""
    eval_split: str = "validation"
    """split to evaluate on; if the dataset has none, the last --eval_num_prompts train prompts (sft.py and
    reward_model.py: --eval_num_examples examples; at most a fifth of them) are held out of training for
    evaluation (with --eval_every 0 too)"""
    chat_template: bool = False
    """wrap each prompt (grpo_multiturn.py: each message of the environment) as a user message in the tokenizer's
    chat template (a policy trained so by sft.py is then trained so by the RL scripts too)"""


@dataclass
class DataArgs(DatasetArgs):
    """Model and data: the policy to start from, and the prompts"""

    prompt_column: str = "query"
    """column holding the prompt text"""
    prompt_template: str | None = None
    """a format string over the dataset's columns that makes the prompt, e.g. "Problem: {question} Solution:"
    (default: the --prompt_column text as it is)"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens are dropped (the count is printed)"""

    def check(self):
        common.check_signs(self, ("max_prompt_length",))


@dataclass
class RewardArgs(common.FlagGroup):
    """The reward that RL optimises"""

    reward_model_path: str = toy.REWARD_MODEL
    """proxy reward model: any one-label AutoModelForSequenceClassification, decoder (read at the last real
    token) or encoder (BERT, RoBERTa, DeBERTa), with its own tokenizer if need be"""
    reward_fn: str | None = None
    """a Python function as the reward instead of a reward model: path/to/file.py:name or module:name, called
    as fn(prompts, completions, **columns) -> one float per completion, where columns are the prompts' other
    dataset columns (e.g. a gold answer)"""


def load_tokenizer(path: str, policy: bool = True, base_model: bool = False):
    """A tokenizer with a pad token. The policy's is left-padded and needs a stop token; a reward
    model's keeps the padding side it was saved with, and needs no stop token. A `base_model`'s (a
    pretrained model that SFT or reward modelling starts from) may have no pad token: its stop token pads,
    and the model saved from it keeps that."""
    from transformers import AutoTokenizer

    if not os.path.exists(path) and path.count("/") != 1:
        common.fail(f"model path {path!r} does not exist (give a local directory or an owner/name hub id)")
    tokenizer = AutoTokenizer.from_pretrained(path, **({"padding_side": "left"} if policy else {}))
    if tokenizer.pad_token_id is None and base_model and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        common.fail(f"tokenizer of {path!r} has no pad token; save it with one "
                    "(e.g. tokenizer.add_special_tokens({'pad_token': '[PAD]'}) and resize the model)")
    if policy and tokenizer.eos_token_id is None:
        common.fail(f"tokenizer of {path!r} has no eos token; the policy's stop token is needed for truncation")
    return tokenizer


def eos_token_ids(path: str, tokenizer) -> list[int]:
    """Every stop token the tokenizer or the model's generation config declares."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id}
    with contextlib.suppress(OSError):
        declared = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(declared if isinstance(declared, list) else [declared] if declared is not None else [])
    return sorted(ids)


def check_reward_model(path: str):
    """Fail early (before any output exists) when `path` is not a one-label sequence classifier."""
    from transformers import AutoConfig

    if not os.path.exists(path) and path.count("/") != 1:
        common.fail(f"reward model {path!r} does not exist (give a local directory or an owner/name hub id)")
    num_labels = AutoConfig.from_pretrained(path).num_labels
    if num_labels != 1:
        common.fail(f"reward model {path!r} has {num_labels} labels; a reward model has exactly 1")


def load_reward_model(path: str, dtype):
    """A one-label AutoModelForSequenceClassification, dropout off (a reward, gold or value model)."""
    from transformers import AutoModelForSequenceClassification

    check_reward_model(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    common.disable_dropout(model)
    return model


def load_python_object(spec: str, flag: str, kind: str):
    """The `kind` ("function", "class") a flag names, `path/to/file.py:name` or `module:name`; fails (one line)
    when it does not resolve."""
    import importlib
    import importlib.util

    location, _, name = spec.rpartition(":")
    if not location or not name:
        common.fail(f"{flag} {spec!r} must be path/to/file.py:{kind} or module:{kind}")
    if location.endswith(".py"):
        if not os.path.isfile(location):
            common.fail(f"{flag} {spec!r}: no file {location!r}")
        module_spec = importlib.util.spec_from_file_location(os.path.basename(location)[:-3], location)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            common.fail(f"{flag} {spec!r}: importing {location!r} raised {type(error).__name__}: {error}")
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            common.fail(f"{flag} {spec!r}: cannot import module {location!r} ({error})")
    found = getattr(module, name, None)
    if not (isinstance(found, type) if kind == "class" else callable(found)):
        common.fail(f"{flag} {spec!r}: {location!r} has no {kind} {name!r}")
    return found


def value_model_path(value_model: str | None, policy: str, reward: RewardArgs) -> str:
    """Where PPO's value model starts: --value_model_path, else the reward model, else (--reward_fn) the policy."""
    return value_model or (policy if reward.reward_fn else reward.reward_model_path)


def check_value_model(path: str, task: common.Task, policy: str):
    """Fail before any output when the value model at `path` cannot give a value at every token of the
    `policy`: it must share the policy's vocabulary and be a decoder (a `score` head at every position), with
    one label if it is a classifier already."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if not os.path.exists(path) and path.count("/") != 1:
        common.fail(f"value model {path!r} does not exist (give a local directory or an owner/name hub id)")
    config = AutoConfig.from_pretrained(path)
    if any(a.endswith("ForSequenceClassification") for a in config.architectures or []) and config.num_labels != 1:
        common.fail(f"value model {path!r} has {config.num_labels} labels; a value model has exactly 1")
    if not same_vocabulary(task.tokenizer, load_tokenizer(path, policy=False)):
        common.fail(f"the value model {path!r} must share the policy's vocabulary; give --value_model_path with the "
                    f"tokenizer of {policy!r} (the policy itself, with a fresh head, will do)")
    with torch.device("meta"):  # the architecture alone, no weights
        model = AutoModelForSequenceClassification.from_config(config)
    if not common.is_decoder_classifier(model):
        common.fail(f"the value model {path!r} is an encoder classifier, with no value per token; give a decoder "
                    "as --value_model_path (the policy itself, with a fresh head, will do)")


def load_value_model(path: str, dtype):
    """The value model with one label: the reward model's head as it is, or a fresh scalar head on a
    causal LM such as the policy."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    common.disable_dropout(model)
    return model


def same_vocabulary(tokenizer_a, tokenizer_b) -> bool:
    return tokenizer_a.get_vocab() == tokenizer_b.get_vocab()


def load_split(name_or_path: str, split: str):
    """A split from a hub dataset, a `save_to_disk` directory, a data directory, or one json/jsonl/parquet file."""
    import datasets

    if os.path.isfile(name_or_path):
        builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(os.path.splitext(name_or_path)[1])
        if builder is None:
            common.fail(f"dataset file {name_or_path!r} is not .json, .jsonl or .parquet")
        if split != "train":
            common.fail(f"dataset file {name_or_path!r} has one split, 'train', not {split!r}; "
                        "give a directory with one file per split (train.jsonl, validation.jsonl)")
        try:
            return datasets.load_dataset(builder, data_files=name_or_path, split="train")
        except (datasets.exceptions.DatasetGenerationError, StopIteration):  # how datasets reports 0 rows
            common.fail(f"dataset {name_or_path!r} split {split!r} is empty or unreadable")
    if os.path.isfile(os.path.join(name_or_path, "dataset_dict.json")):
        with open(os.path.join(name_or_path, "dataset_dict.json")) as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            common.fail(f"dataset {name_or_path!r} has no split {split!r}; it has {sorted(splits)}")
        try:
            return datasets.load_from_disk(os.path.join(name_or_path, split))
        except IndexError:  # how datasets reports a split saved with no rows
            common.fail(f"dataset {name_or_path!r} split {split!r} is empty")
    name, _, config = name_or_path.partition(":")  # owner/name:configuration, as openai/gsm8k:main
    if not os.path.exists(name_or_path) and name.count("/") != 1:
        common.fail(f"dataset {name_or_path!r} does not exist (give a directory, a .json/.jsonl/.parquet file, "
                    "or an owner/name hub id, with :configuration if it has several)")
    try:
        return datasets.load_dataset(name, config or None, split=split)
    except ValueError as error:  # datasets says which splits exist
        common.fail(f"dataset {name_or_path!r}: {str(error).splitlines()[0]}")
    except datasets.exceptions.DataFilesNotFoundError:
        common.fail(f"dataset directory {name_or_path!r} holds no data files (.jsonl, .json, .parquet, .csv) and no "
                    "save_to_disk dataset")
    except datasets.exceptions.DatasetGenerationError as error:  # files that are no table of one schema
        cause = error.__cause__ or error
        common.fail(f"dataset {name_or_path!r} split {split!r} could not be read: {' '.join(str(cause).split())[:300]}")


def split_names(name_or_path: str) -> list[str]:
    """The splits of a dataset (a single file has one, "train")."""
    import datasets

    if os.path.isfile(name_or_path):
        return ["train"]
    if os.path.isfile(os.path.join(name_or_path, "dataset_dict.json")):
        with open(os.path.join(name_or_path, "dataset_dict.json")) as f:
            return json.load(f)["splits"]
    name, _, config = name_or_path.partition(":")
    try:
        return datasets.get_dataset_split_names(name, config or None)
    except Exception:  # whatever datasets raises: load_split then says what is wrong
        return []


def prompt_text(data: DataArgs, row: dict) -> str:
    """The prompt of a dataset row, as text: --prompt_template filled with the row's columns, or its
    --prompt_column (before any chat template)."""
    return data.prompt_template.format(**row) if data.prompt_template else row[data.prompt_column]


def load_prompts(data: DataArgs, tokenizer, split: str):
    """Tokenized prompts of one split ("input_ids"), with every column of the dataset; prompts longer
    than `max_prompt_length` are dropped."""
    dataset = load_split(data.dataset_name, split)
    import string

    template_columns = [field for _, field, _, _ in string.Formatter().parse(data.prompt_template or "") if field]
    for column in [data.prompt_column, *template_columns]:
        if column not in dataset.column_names:
            common.fail(f"dataset {data.dataset_name!r} split {split!r} has no column {column!r}; "
                        f"it has {dataset.column_names}")
    if len(dataset) == 0:
        common.fail(f"dataset {data.dataset_name!r} split {split!r} is empty")
    if data.chat_template and tokenizer.chat_template is None:
        common.fail(f"--chat_template was given but the tokenizer of {data.model_name_or_path!r} has no chat template")

    def tokenize(batch: dict) -> dict:
        """A batch of rows, column by column: the tokenizer takes all its prompts at once."""
        prompts = [prompt_text(data, dict(zip(batch, values))) for values in zip(*batch.values())]
        if data.chat_template:
            return {"input_ids": [tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                                add_generation_prompt=True, tokenize=True,
                                                                return_dict=False) for prompt in prompts]}
        return {"input_ids": tokenizer(prompts, add_special_tokens=False)["input_ids"]}

    # In memory: datasets' on-disk cache would add new files next to the dataset on every run (the
    # closures' fingerprints differ between runs), piling up without bound.
    dataset = dataset.map(tokenize, batched=True, desc=f"tokenizing {split}", keep_in_memory=True)
    kept = dataset.filter(lambda ids: [0 < len(row) <= data.max_prompt_length for row in ids],
                          input_columns="input_ids", batched=True, keep_in_memory=True)
    if len(kept) < len(dataset):
        print(f"{split}: dropped {len(dataset) - len(kept)} of {len(dataset)} prompts longer than "
              f"max_prompt_length={data.max_prompt_length} tokens")
    if len(kept) == 0:
        common.fail(f"every prompt of {data.dataset_name!r} split {split!r} is longer than "
                    f"max_prompt_length={data.max_prompt_length}; raise --max_prompt_length")
    return kept


def load_examples(data: DataArgs, tokenizer, rank: int, completion_columns: list[str], max_completion_length: int,
                  eval_size: int, append_eos: bool = True):
    """Train and evaluation examples of a dataset of prompts and completions (sft.py, reward_model.py):
    "input_ids", the prompt built as the RL scripts build it (load_prompts), and for each of
    `completion_columns` "<column>_ids", its tokens, ending in the stop token with `append_eos` (unless the
    text ends with it); examples with a completion longer than `max_completion_length` are dropped. Without
    an --eval_split in the dataset, the last `eval_size` train examples (at most a fifth) are held out."""
    eos = tokenizer.eos_token_id

    def tokenized(split: str):
        rows = load_prompts(data, tokenizer, split)
        for column in completion_columns:
            if column not in rows.column_names:
                common.fail(f"dataset {data.dataset_name!r} split {split!r} has no column {column!r}; "
                            f"it has {rows.column_names}")

        def tokenize(row):
            completions = {}
            for column in completion_columns:
                ids = tokenizer(row[column], add_special_tokens=False)["input_ids"]
                completions[f"{column}_ids"] = ids + [eos] if append_eos and ids[-1:] != [eos] else ids
            return completions

        rows = rows.map(tokenize, desc=f"tokenizing {split} completions", keep_in_memory=True)
        kept = rows.filter(lambda row: all(0 < len(row[f"{column}_ids"]) <= max_completion_length
                                           for column in completion_columns), keep_in_memory=True)
        if len(kept) < len(rows) and rank == 0:
            print(f"{split}: dropped {len(rows) - len(kept)} of {len(rows)} examples with an empty completion or one "
                  f"longer than max_completion_length={max_completion_length} tokens")
        if len(kept) == 0:
            common.fail(f"every example of {data.dataset_name!r} split {split!r} has an empty completion or one longer "
                        f"than max_completion_length={max_completion_length}; raise --max_completion_length")
        return kept

    train = tokenized(data.train_split)
    if data.eval_split in split_names(data.dataset_name):
        evaluation = tokenized(data.eval_split)
    else:  # held out even when nothing is evaluated: the training data never depends on it
        train, evaluation = held_out_for_evaluation(data, train, eval_size, rank, "examples")
    return train, evaluation.select(range(min(eval_size, len(evaluation))))


def held_out_for_evaluation(data: DataArgs, train, size: int, rank: int, rows_are: str):
    """(train, held out): the last `size` rows of `train` (at most a fifth of them) held out of training, for
    a dataset without --eval_split."""
    held_out = min(size, len(train) // 5)
    if rank == 0:
        print(f"{data.dataset_name!r} has no {data.eval_split!r} split: the last {held_out} of the "
              f"{data.train_split!r} {rows_are} are held out for evaluation")
    return train.select(range(len(train) - held_out)), train.select(range(len(train) - held_out, len(train)))


def is_toy_dataset(dataset_name: str) -> bool:
    return os.path.abspath(dataset_name) == os.path.abspath(toy.DATASET)


def build_named_toys(paths: list[str]):
    """Build the embedded toy artefacts that any of `paths` lies in, unless they are built: on every rank (the
    first to ask builds them, one build at a time on a machine; the others wait for it)."""
    for folder, build in ((toy.TOY_DIR, toy.build), (toy.MATH_DIR, toy.build_math), (toy.LARGE_DIR, toy.build_large),
                          (toy.PIPELINE_DIR, toy.build_pipeline)):
        if folder in map(os.path.dirname, paths):
            build()


def load_task(data: DataArgs, reward: RewardArgs, evaluation_args: evaluation.EvalArgs, lora_args: lora.LoraArgs | None,
              rank: int, dtype, evaluate: bool) -> common.Task:
    """The task of a run; the embedded toy task is built first when it is the one asked for. `lora_args`: the
    run's LoRA flags, checked against the policy (None: no LoRA). `evaluate`: whether the run evaluates (else
    Task.eval_prompts is None).

    Evaluation prompts come from --eval_split, or, when the dataset has no such split, are the last
    --eval_num_prompts train prompts (at most a fifth of them), held out from training.
    """
    build_named_toys([data.model_name_or_path, data.dataset_name])
    if evaluation_args.gold_model_path == "toy" and not is_toy_dataset(data.dataset_name):
        common.fail(f"--gold_model_path toy scores the embedded toy task only, not {data.dataset_name!r}; give a gold "
                    "reward model, or leave it out (evaluation then reports the proxy reward and KL)")
    tokenizer = load_tokenizer(data.model_name_or_path)
    if lora_args is not None:
        lora.check_targets(lora_args, data.model_name_or_path)
    reward_fn = reward_tokenizer = None
    if reward.reward_fn:
        reward_fn = load_python_object(reward.reward_fn, "--reward_fn", "function")
    else:
        check_reward_model(reward.reward_model_path)
        reward_tokenizer = load_tokenizer(reward.reward_model_path, policy=False)
        if same_vocabulary(tokenizer, reward_tokenizer):
            reward_tokenizer = None
    gold_path = evaluation_args.gold_model_path or ("toy" if is_toy_dataset(data.dataset_name) else None)
    if gold_path not in (None, "toy"):
        check_reward_model(gold_path)
    train_prompts = load_prompts(data, tokenizer, data.train_split)
    eval_prompts = None
    if data.eval_split not in split_names(data.dataset_name):  # held out even with --eval_every 0: the
        # training prompts never depend on it
        train_prompts, eval_prompts = held_out_for_evaluation(data, train_prompts, evaluation_args.eval_num_prompts,
                                                              rank, "prompts")
    elif evaluate:
        eval_prompts = load_prompts(data, tokenizer, data.eval_split)
    if not evaluate:
        eval_prompts = None
    else:
        eval_prompts = eval_prompts.select(range(min(evaluation_args.eval_num_prompts, len(eval_prompts))))
    answers, references = evaluation_args.answer_column, evaluation_args.reference_column
    has_references = eval_prompts is not None and references in eval_prompts.column_names
    if eval_prompts is not None and answers and answers not in eval_prompts.column_names:
        common.fail(f"--answer_column {answers!r} is not a column of the evaluation prompts; they have "
                    f"{eval_prompts.column_names}")
    if eval_prompts is not None and rank == 0:
        print(f"evaluation on {len(eval_prompts)} prompts: "
              + ("gold win-rate against the references, " if gold_path and has_references else "")
              + ("gold score, " if gold_path else "no gold scorer, ")
              + ("accuracy, " if answers else "") + "proxy reward and KL")
    return common.Task(tokenizer=tokenizer, eos_ids=eos_token_ids(data.model_name_or_path, tokenizer),
                       reward_tokenizer=reward_tokenizer, reward_fn=reward_fn, reward_fn_name=reward.reward_fn,
                       prompt_column=data.prompt_column, train_prompts=train_prompts, eval_prompts=eval_prompts,
                       has_references=has_references,
                       gold_score=load_gold_scorer(gold_path, dtype, tokenizer) if gold_path and eval_prompts else None)


class PromptSampler:
    """Endless shuffled prompt batches; each rank takes its own slice of every global batch.

    The order depends only on (seed, epoch), and `position` counts global batches drawn, so a
    resumed run continues with exactly the batches the interrupted run would have seen.
    """

    def __init__(self, num_prompts: int, local_batch_size: int, rank: int, world_size: int, seed: int):
        self.global_batch_size = local_batch_size * world_size
        if num_prompts < self.global_batch_size:
            common.fail(f"the train split has {num_prompts} prompts, fewer than one batch of {self.global_batch_size}")
        self.num_prompts, self.local_batch_size, self.rank, self.seed = num_prompts, local_batch_size, rank, seed
        self.batches_per_epoch = num_prompts // self.global_batch_size
        self.position = 0

    def next_indices(self) -> list[int]:
        epoch, batch = divmod(self.position, self.batches_per_epoch)
        order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + epoch))
        start = batch * self.global_batch_size + self.rank * self.local_batch_size
        self.position += 1
        return order[start:start + self.local_batch_size].tolist()


def load_gold_scorer(path: str, dtype, policy_tokenizer):
    """A function (queries, responses as text) -> gold scores. Responses end with the policy's EOS text
    when they stopped.

    "toy" is the embedded task's programmatic scorer; anything else is a reward model path, scored
    through its own tokenizer (score_texts), which sees its own EOS text where the policy's stood.
    """
    if path == "toy":
        return toy.gold_score
    model = load_reward_model(path, dtype).eval().to(common.local_device())
    tokenizer = load_tokenizer(path, policy=False)
    eos = policy_tokenizer.eos_token

    @torch.no_grad()
    def gold_score(queries: list[str], responses: list[str]) -> list[float]:
        texts, stopped = [q + r.replace(eos, "") for q, r in zip(queries, responses)], [eos in r for r in responses]
        return [score for start in range(0, len(texts), 16) for score in
                common.score_texts(model, tokenizer, texts[start:start + 16], stopped[start:start + 16]).tolist()]

    return gold_score
