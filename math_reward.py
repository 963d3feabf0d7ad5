"""The reward of the paper's math runs (GSM8k), and the template for a reward function of your own.

Any script takes a Python function as its reward instead of a reward model:

    python online_dpo.py --reward_fn math_reward:gsm8k_reward ...      # module:function (on the path)
    python online_dpo.py --reward_fn path/to/my_reward.py:score ...      # or file:function

The scripts call it on every training batch, and on the evaluation's near-greedy completions, as
`function(prompts, completions, **columns)`, where

- `prompts` are the prompt texts (the dataset's --prompt_column, before any --prompt_template or chat
  template), one per completion: a prompt sampled k times appears k times, its samples adjacent;
- `completions` are the sampled texts, cut after the first stop token and decoded without it;
- `columns` are the prompts' other dataset columns, by name, aligned the same way (here `answer`);
  take the ones you need by name and leave the rest in **columns;

and it must return one number per completion. It runs on every rank, in the trainer's process, on
that rank's share of the batch; an exception or a wrong count stops the run with a one-line error,
and so does a NaN or infinite reward in training. Copy this file to start your own.
"""

import re

FINAL_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def final_answer(text: str) -> float | None:
    """The number after the first `####` of `text` (GSM8k's answer format), commas removed; None without one."""
    match = FINAL_ANSWER.search(text)
    return float(match.group(1).replace(",", "")) if match else None


def same_final_answer(completion: str, solution: str) -> bool:
    """Whether `completion` has a final answer (`#### N`) and it equals that of `solution`."""
    return final_answer(completion) is not None and final_answer(completion) == final_answer(solution)


def gsm8k_reward(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """`--reward_fn math_reward:gsm8k_reward`: 1 where the completion's final answer (`#### N`) equals that of
    its solution in the dataset's `answer` column (GSM8k's solutions end with one), else 0; a completion
    without `#### N` scores 0."""
    return [float(same_final_answer(c, solution)) for c, solution in zip(completions, answer, strict=True)]
