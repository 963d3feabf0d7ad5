"""Reward functions as a researcher writes them, for --reward_fn tests/reward_fns.py:NAME."""


def says_the_answer(prompts: list[str], completions: list[str], answer: list[str]) -> list[float]:
    """1 when the completion contains the prompt's answer (the dataset's "answer" column), else 0."""
    return [float(gold in completion.split()) for completion, gold in zip(completions, answer)]


def raises(prompts, completions, **columns):
    raise ValueError("a bug in the reward function")


def one_score_short(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)


def nan_scores(prompts, completions, **columns):
    return [float("nan")] * len(completions)
