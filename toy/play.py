"""Playing an embedded environment's episodes, every episode's turn at once: how the builds of the credit
environments (probe.py, lake.py) make their SFT episodes (a rule plays) and measure their SFT policies (the policy
plays, its turns in one batched generate). An episode's tokens are built as the multi-turn scripts build them
without a chat template: the first message, then each turn's tokens up to its stop token (added when a turn runs out
of tokens) and the environment's message after it."""

import random
from typing import NamedTuple

import torch

from toy.builder import masked_sft_loss


class Played(NamedTuple):
    ids: list[int]  # the episode's tokens
    by_policy: list[int]  # 1 for each token the policy wrote (its turns and their stop tokens), 0 for the environment's
    turns: int
    episode_return: float
    done: bool  # the environment said done (else the turns ran out)


def play(envs: list, rows: list[dict], seeds: list[int], max_turns: int, act, tokenizer) -> list[Played]:
    """envs[i] plays rows[i] from reset seed seeds[i] for at most `max_turns` turns; act(each playing episode's
    ids, its env) -> each one's turn as (ids, text)."""
    encode = lambda message: tokenizer(message, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, by_policy = [[] for _ in envs], [[] for _ in envs]
    messages = [env.reset(row, seed) for env, row, seed in zip(envs, rows, seeds)]
    returns, turns, done = [0.0] * len(envs), [0] * len(envs), [False] * len(envs)
    for _ in range(max_turns):
        playing = [i for i in range(len(envs)) if not done[i]]
        if not playing:
            break
        for i in playing:  # the first message, or the reply to the turn before
            message = encode(messages[i])
            ids[i], by_policy[i] = ids[i] + message, by_policy[i] + [0] * len(message)
        for i, (turn, text) in zip(playing, act([ids[i] for i in playing], [envs[i] for i in playing])):
            ids[i], by_policy[i] = ids[i] + turn, by_policy[i] + [1] * len(turn)
            messages[i], reward, done[i] = envs[i].step(text)
            returns[i] += reward
            turns[i] += 1
    return [Played(*episode) for episode in zip(ids, by_policy, turns, returns, done)]


def policy_turns(policy, tokenizer, max_new_tokens: int, temperature: float = 0.0):
    """The act of play(): the policy's turns, sampled at `temperature` (0: greedy), left-padded into one batch."""

    def act(histories: list[list[int]], envs: list) -> list[tuple[list[int], str]]:
        width = max(map(len, histories))
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(h)) + h for h in histories])
        attention_mask = (torch.arange(width) >= torch.tensor([[width - len(h)] for h in histories])).long()
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature else dict(do_sample=False)
        with torch.no_grad():
            output = policy.generate(input_ids=input_ids, attention_mask=attention_mask,
                                     max_new_tokens=max_new_tokens, **sampling)
        turns = []
        for new in output[:, width:].tolist():
            if tokenizer.eos_token_id in new:
                new = new[:new.index(tokenizer.eos_token_id)]
            turns.append((new + [tokenizer.eos_token_id], tokenizer.decode(new, skip_special_tokens=True)))
        return turns

    return act


def rule_turns(tokenizer, rule):
    """The act of play(): rule(env) -> the turn's text, a rule that reads the environment's state."""
    return lambda histories, envs: [(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                                     text) for text in map(rule, envs)]


def sft_loss_of_batch(make_env, rows: list[dict], max_turns: int, habit, policy, tokenizer, rng: random.Random):
    """builder.train's loss for an SFT policy of an environment: each call plays 32 episodes by `habit` (the act of
    play()) from rows drawn with `rng`, reset seed 0, and returns the policy's next-token loss on its tokens."""
    def loss_of_batch(batch_size: int = 32) -> torch.Tensor:
        episodes = play([make_env() for _ in range(batch_size)], rng.sample(rows, batch_size), [0] * batch_size,
                        max_turns, habit, tokenizer)
        return masked_sft_loss(policy, [e.ids for e in episodes], [e.by_policy for e in episodes],
                               tokenizer.pad_token_id)

    return loss_of_batch


def rates(episodes: list[Played]) -> dict:
    """The episodes' mean return, mean turns, and share cut off by the turns (never done)."""
    return {"return": sum(e.episode_return for e in episodes) / len(episodes),
            "turns": sum(e.turns for e in episodes) / len(episodes),
            "truncated": sum(not e.done for e in episodes) / len(episodes)}
