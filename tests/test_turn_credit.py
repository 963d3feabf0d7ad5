"""Credit per turn (--turn_advantage in grpo_multiturn.py and grpo_multiturn_vllm.py, each with its own copy): every
estimator on a tiny group computed by hand, each turn's advantage on its own tokens, the missing-EOS penalty per
turn, and the bias that normalising per turn index brings where the policy decides when to stop, against the
closed-form gradient of a stop-or-continue process that `unbiased` estimates without bias."""

import ast
import math
import types

import pytest
import torch

import grpo_multiturn
import grpo_multiturn_vllm

SCRIPTS = [grpo_multiturn, grpo_multiturn_vllm]
TURN_CREDIT = ("returns_to_go", "turn_advantages", "step_advantages", "token_advantages", "final_turn_rewards")
# one group of k=2: episode A took 3 turns (rewards 1, 0, 2; states 10, 20, 30), B took 2 (rewards 0, 1; states
# 10, 30); gamma 0.5: A's returns-to-go 1.5, 1, 2; B's 0.5, 1
TURN_REWARDS = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]])
TURNS = torch.tensor([3.0, 2.0])
STATES = torch.tensor([[10, 20, 30], [10, 30, -1]])
SCORES = torch.tensor([3.0, 1.0])
HALF = 0.5 / (math.sqrt(0.5) + 1e-4)  # +-0.5 about a mean, over the std of two values 1 apart
EPISODE = 1.0 / (math.sqrt(2.0) + 1e-4)  # returns 3 and 1 against their mean, over their std


@pytest.fixture(params=SCRIPTS, ids=lambda module: module.__name__)
def script(request):
    return request.param


def test_the_two_multiturn_scripts_hold_the_same_turn_credit():
    """Each multi-turn script keeps its estimators in itself, the two copies the same, byte for byte."""
    def functions(module) -> dict[str, str]:
        source = open(module.__file__).read()
        return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
                if isinstance(node, ast.FunctionDef) and node.name in TURN_CREDIT}

    assert sorted(functions(grpo_multiturn)) == sorted(TURN_CREDIT)
    assert functions(grpo_multiturn_vllm) == functions(grpo_multiturn)


@pytest.mark.parametrize(("estimator", "expected"), [
    # G_t against the group's mean G_t at turn t (A's third turn alone: its own mean)
    ("reward_to_go", [[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]),
    # against the other episode's G_t at turn t, 0 where no other episode took a turn t
    ("unbiased", [[1.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]),
    # each turn's reward normalised among the group's at its index (A's third alone: 0), then its return-to-go
    ("turn_index_norm", [[HALF - 0.5 * HALF, -HALF, 0.0], [-HALF + 0.5 * HALF, HALF, 0.0]]),
    # the episode's advantage plus the turn's G_t among the turns from the same state (state 20: A's alone, 0)
    ("gigpo", [[EPISODE + HALF, EPISODE, EPISODE + HALF], [-EPISODE - HALF, -EPISODE - HALF, 0.0]]),
])
def test_each_turn_advantage_on_hand_computed_numbers(script, estimator, expected):
    args = script.Args(turn_advantage=estimator, gamma=0.5)
    advantages = script.turn_advantages(TURN_REWARDS, TURNS, STATES, SCORES, 2, args)
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", ["reward_to_go", "turn_index_norm", "unbiased", "gigpo"])
def test_each_ranks_share_of_whole_groups_takes_the_advantages_of_the_whole_batch(script, estimator):
    """Two ranks = one for every estimator: each looks only within a group (gigpo's episode level with
    --scale_rewards group; batch is all-reduced across ranks, tests/test_multiturn_vllm.py), so two shares of whole
    groups get what the whole batch gets. Random groups of 4 episodes of 1-4 turns, states from 3 values."""
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(16, 4, generator=generator)
    turns = torch.randint(1, 5, (16,), generator=generator).float()
    states = torch.randint(0, 3, (16, 4), generator=generator)
    args = script.Args(turn_advantage=estimator, gamma=0.9, scale_rewards="group")
    whole = script.turn_advantages(rewards, turns, states, rewards.sum(dim=1), 4, args)
    shares = [script.turn_advantages(rewards[rows], turns[rows], states[rows], rewards[rows].sum(dim=1), 4, args)
              for rows in (slice(0, 8), slice(8, 16))]
    assert whole.abs().sum() > 0
    torch.testing.assert_close(torch.cat(shares), whole, atol=0, rtol=0)


def test_each_policy_token_takes_its_turns_advantage(script):
    """Turn 0's two tokens, the environment's reply (-1), turn 1's token, then padding."""
    token_turns = torch.tensor([[0, 0, -1, 1, -1]])
    assert script.token_advantages(torch.tensor([[2.0, -3.0]]), token_turns).tolist() == [[2, 2, 0, -3, 0]]


def test_the_missing_eos_penalty_is_the_last_turns_reward(script):
    """With --missing_eos_penalty an episode with a turn that missed its stop token has --penalty_reward_value at its
    last turn and 0 before (its return is the penalty, as final_scores takes it); the others keep their rewards."""
    episodes = types.SimpleNamespace(turn_rewards=TURN_REWARDS, turns=TURNS, contains_eos=torch.tensor([True, False]))
    generation = types.SimpleNamespace(missing_eos_penalty=True, penalty_reward_value=-1.0)
    penalised = script.final_turn_rewards(episodes, types.SimpleNamespace(generation=generation))
    assert penalised.tolist() == [[1.0, 0.0, 2.0], [0.0, -1.0, 0.0]]


def stop_or_continue(theta: torch.Tensor, stop_rewards: torch.Tensor, go_rewards: torch.Tensor, episodes: int,
                     generator: torch.Generator):
    """Episodes of a process where at each turn t the policy stops with probability sigmoid(theta_t) (reward
    stop_rewards[t], the episode ends) or goes on (reward go_rewards[t]); the last turn ends it either way. Returns
    each episode's turn rewards (N, T), turns (N,) and the score d log pi(a_t) / d theta_t of its actions (N, T)."""
    width, stop_probability = theta.shape[0], torch.sigmoid(theta)
    stops = torch.rand(episodes, width, generator=generator) < stop_probability
    last = torch.where(stops.any(dim=1), stops.float().argmax(dim=1), torch.full((episodes,), width - 1))
    turn = torch.arange(width)
    played = turn < last[:, None] + 1
    stopped = (turn == last[:, None]) & stops.gather(1, last[:, None])
    rewards = torch.where(stopped, stop_rewards, go_rewards) * played
    score = torch.where(stopped, 1 - stop_probability, -stop_probability) * played
    return rewards, (last + 1).float(), score


def test_normalising_per_turn_index_biases_the_stopping_gradient_and_unbiased_does_not(script):
    """The stop-or-continue process's expected return has a closed form, J = sum_t P(reach t) (p_t s_t +
    (1 - p_t) c_t), and so its gradient (autograd on it). The policy gradient of groups of 4 episodes with each
    turn's advantage (sum over turns of A_t d log pi(a_t)) estimates it: `unbiased` within 4 standard errors of
    the Monte Carlo mean on every parameter; turn_index_norm more than 20 away on one (measured: its gradient on the
    second turn's parameter is about 0, the true one -0.11)."""
    theta, stop_rewards, go_rewards = torch.tensor([0.3, -0.2, 0.1]), torch.tensor([0.0, 1.0, 2.0]), torch.ones(3)
    go_rewards[2] = 0.0
    estimated = theta.clone().requires_grad_()
    p = torch.sigmoid(estimated)
    reach = torch.cumprod(torch.cat([torch.ones(1), 1 - p[:-1]]), dim=0)
    (reach * (p * stop_rewards + (1 - p) * go_rewards)).sum().backward()
    true_gradient, k = estimated.grad, 4

    def gradient_estimates(estimator: str) -> torch.Tensor:  # (repeats, T)
        args = script.Args(turn_advantage=estimator)
        generator = torch.Generator().manual_seed(0)
        estimates = []
        for _ in range(10):
            rewards, turns, score = stop_or_continue(theta, stop_rewards, go_rewards, 4000 * k, generator)
            advantages = script.turn_advantages(rewards, turns, torch.zeros_like(rewards, dtype=torch.long),
                                                rewards.sum(dim=1), k, args)
            estimates.append((advantages * score).mean(dim=0))
        return torch.stack(estimates)

    for estimator, unbiased in (("unbiased", True), ("turn_index_norm", False)):
        estimates = gradient_estimates(estimator)
        z = (estimates.mean(dim=0) - true_gradient) / (estimates.std(dim=0) / math.sqrt(len(estimates)))
        if unbiased:
            assert z.abs().max() < 4, (estimator, z)
        else:
            assert z.abs().max() > 20, (estimator, z)
