"""The GRPO scripts (grpo.py, grpo_vllm.py, grpo_multiturn.py, grpo_multiturn_vllm.py, each with its own copy):
every loss type, the clipping variants, GSPO's sequence ratio, the KL estimators, the entropy bonus and the
advantages against numbers computed by hand on a tiny batch (two prompts of k=2, completions of 3, 1, 2 and 3
tokens, the first truncated), in value and in gradient. The scripts' bad flags: test_reliability.py."""

import math

import pytest
import torch
from scripts import QUICK, assert_learns, load_policy_weights, read_metrics, run_script, toy_run

import common
import grpo
import grpo_multiturn
import grpo_multiturn_vllm
import grpo_vllm
import toy

PAD = common.INVALID_LOGPROB
# rows 0-1: prompt 1, rows 2-3: prompt 2; row 0 has no stop token (truncated at 3 tokens)
MASK = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
NEW = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, PAD, PAD], [-1.0, -1.5, PAD], [-0.2, -0.4, -0.6]])
LOG_RATIO = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.5), 0, 0], [0, 0, 0], [0, 0, 0]])
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])
# token level, clip [0.8, 1.2]: row 0 -> -1.2 (clipped), -0.5, -1; row 1 (A < 0) -> 1.5; row 2 -> -0.5, -0.5;
# row 3 -> 0.5 x 3. Sums per row -2.7, 1.5, -1.0, 1.5: -0.7 over 9 tokens.


GRPO_SCRIPTS = [grpo, grpo_vllm, grpo_multiturn, grpo_multiturn_vllm]


@pytest.fixture(params=GRPO_SCRIPTS, ids=lambda module: module.__name__)
def script(request):
    """Each GRPO script: its own loss functions, checked on the same numbers."""
    return request.param


MAX_TOKENS = 3  # completions (the multi-turn scripts' episodes) of 3 tokens at most: dr_grpo's denominator


def grpo_args(script, **overrides):
    """`script`'s flags, its defaults but `overrides` (dapo, clip [0.8, 1.2], token ratios, no KL, no entropy
    bonus)."""
    return script.Args(**overrides)


def loss_of(script, mask=MASK, new=NEW, step_tokens=9.0, ref=None, entropy=None, **overrides):
    args = grpo_args(script, **overrides)
    return script.policy_loss(new, new - LOG_RATIO, ADVANTAGES, mask, args, step_tokens, MAX_TOKENS, ref,
                              entropy)[0].item()


def test_the_four_grpo_scripts_hold_the_same_loss():
    """Each GRPO script keeps its algorithm in itself (a script reads alone), and the four copies of its loss are
    the same, byte for byte: a change to one is made to all four (README, "The map")."""
    import ast

    def shared_functions(module) -> dict[str, str]:
        source = open(module.__file__).read()
        return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
                if isinstance(node, ast.FunctionDef) and node.name in SHARED_LOSS}

    reference = shared_functions(grpo)
    assert sorted(reference) == sorted(SHARED_LOSS)
    for module in GRPO_SCRIPTS[1:]:
        assert shared_functions(module) == reference, module.__name__


SHARED_LOSS = ("upper_clip", "group_advantages", "token_kl", "token_average", "policy_loss")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_a_tokens_own_advantage_equal_to_its_rows_gives_the_rows_loss_bit_for_bit(script, loss_type):
    """Advantages per token (the multi-turn scripts' --turn_advantage: each turn's on its tokens) that are each row's
    advantage on every token: the loss and its gradient are the per-row advantages', bit for bit (so --turn_advantage
    episode, which passes one per row, trains as before)."""
    overrides = {"loss_type": loss_type, **({"epsilon_high": 5.0} if loss_type == "cispo" else {})}
    args = grpo_args(script, **overrides)
    results = []
    for advantages in (ADVANTAGES, ADVANTAGES[:, None].expand_as(MASK).contiguous()):
        new = NEW.clone().requires_grad_()
        loss = script.policy_loss(new, NEW - LOG_RATIO, advantages, MASK, args, 9.0, MAX_TOKENS)[0]
        loss.backward()
        results.append((loss.detach(), new.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize(("loss_type", "expected"), [
    ("grpo", (-2.7 / 3 + 1.5 - 1.0 / 2 + 1.5 / 3) / 4),  # each row's mean, then their mean: 0.15
    ("bnpo", -0.7 / 9),  # over the micro-batch's 9 tokens
    ("dr_grpo", -0.7 / (4 * 3)),  # over rows x --response_length
    ("dapo", -0.7 / 9),  # over the step's tokens (here this micro-batch's)
])
def test_each_loss_type_averages_the_token_losses_as_it_says(script, loss_type, expected):
    assert loss_of(script, loss_type=loss_type) == pytest.approx(expected, abs=1e-6)


def test_dapo_divides_by_the_whole_steps_tokens_not_the_micro_batchs(script):
    assert loss_of(script, step_tokens=18.0) == pytest.approx(-0.7 / 18, abs=1e-6)


@pytest.mark.parametrize(("loss_type", "expected"), [
    ("grpo", (0.0 + 1.5 - 0.5 + 0.5) / 4),  # the truncated row counts as 0 in the mean over rows
    ("bnpo", 2.0 / 6), ("dr_grpo", 2.0 / 12), ("dapo", 2.0 / 6),
])
def test_masking_the_truncated_completion_drops_its_tokens(script, loss_type, expected):
    mask = MASK * torch.tensor([0.0, 1, 1, 1])[:, None]  # what --mask_truncated_completions makes
    assert loss_of(script, mask=mask, step_tokens=6.0, loss_type=loss_type) == pytest.approx(expected, abs=1e-6)


def test_clip_higher_two_sided_clipping_and_the_sequence_ratio(script):
    # clip-higher 0.28: row 0's first token -1.28 instead of -1.2
    assert loss_of(script, epsilon_high=0.28, loss_type="bnpo") == pytest.approx(-0.78 / 9, abs=1e-6)
    # delta 1.4: row 1 (ratio 1.5, A = -1) pays 1.4, not 1.5
    assert loss_of(script, delta=1.4, loss_type="dr_grpo") == pytest.approx(-0.8 / 12, abs=1e-6)
    # GSPO: row 0's ratio is exp(mean log-ratio) = 0.75 ** (1/3) = 0.90856 on each of its tokens (inside the clip)
    row0 = -3 * 0.75 ** (1 / 3)
    expected = (row0 + 1.5 - 1.0 + 1.5) / 9
    assert loss_of(script, importance_sampling_level="sequence") == pytest.approx(expected, abs=1e-6)


def test_cispo_is_reinforce_weighted_by_the_capped_ratio_with_no_gradient_through_it(script):
    # -min(ratio, 1.3) * A * logp: row 0: 0.65 + 0.5 + 2.0; row 1: -0.39; row 2: 0.5 + 0.75; row 3: -0.6
    assert loss_of(script, loss_type="cispo", epsilon_high=1.3) == pytest.approx(3.41 / 9, abs=1e-6)
    new = NEW.clone().requires_grad_()
    args = grpo_args(script, loss_type="cispo", epsilon_high=1.3)
    script.policy_loss(new, (new - LOG_RATIO).detach(), ADVANTAGES, MASK, args, 9.0, MAX_TOKENS)[0].backward()
    # the capped weight, with no derivative of its own: also where the cap does not bind (ratio 0.5, logp -1)
    assert new.grad[0, :2].tolist() == pytest.approx([-1.3 / 9, -0.5 / 9])


def test_the_clipped_tokens_get_no_gradient(script):
    new = NEW.clone().requires_grad_()
    args = grpo_args(script, loss_type="bnpo")
    script.policy_loss(new, (new - LOG_RATIO).detach(), ADVANTAGES, MASK, args, 9.0, MAX_TOKENS)[0].backward()
    assert new.grad[0, 0].item() == 0  # ratio 1.5 > 1.2 with A > 0: clipped
    assert new.grad[0, 1].item() == pytest.approx(-0.5 / 9)  # ratio 0.5, A = 1: d(-ratio A)/dlogp / 9


@pytest.mark.parametrize(("estimator", "kl"), [
    ("k1", -math.log(2)), ("k2", 0.5 * math.log(2) ** 2), ("k3", 2 - math.log(2) - 1)])
def test_the_kl_penalty_adds_beta_times_the_estimator_per_token(script, estimator, kl):
    ref = NEW.clone()
    ref[2, 0] += math.log(2)  # one token where the reference is twice as likely: r = log 2
    expected = (-0.7 + 0.1 * kl) / 9
    loss = loss_of(script, ref=ref, beta=0.1, kl_estimator=estimator, loss_type="bnpo")
    assert loss == pytest.approx(expected, abs=1e-6)


def test_the_entropy_bonus_is_subtracted_averaged_as_the_loss(script):
    entropy = torch.ones_like(NEW)
    loss = loss_of(script, entropy=entropy, entropy_coef=0.1, loss_type="bnpo")
    assert loss == pytest.approx(-0.7 / 9 - 0.1, abs=1e-6)


def loss_gradients(script, ref=None, entropy=None, **overrides) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d loss / d new log-probs (the ratio's old log-probs held fixed), and d loss / d entropy."""
    new = NEW.clone().requires_grad_()
    entropy = None if entropy is None else entropy.clone().requires_grad_()
    args = grpo_args(script, **overrides)
    script.policy_loss(new, NEW - LOG_RATIO, ADVANTAGES, MASK, args, 9.0, MAX_TOKENS, ref, entropy)[0].backward()
    return new.grad, None if entropy is None else entropy.grad


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_penalty_pulls_each_token_towards_the_reference(script, estimator):
    # on top of the policy term's gradient, beta / 9 tokens times d KL / d logp per token, r = ref - logp:
    # k1 (-r) 1, k2 (r^2 / 2) -r, k3 (e^r - r - 1) 1 - e^r; a token more likely under the policy than the
    # reference (r < 0) is pushed down, one less likely (r > 0) up (k2, k3)
    ref = NEW + torch.tensor([[math.log(2), -math.log(2), 0.3], [0.1, 0, 0], [-0.2, 0.5, 0], [0, 0.4, -0.1]])
    r = ref - NEW
    by_hand = {"k1": torch.ones_like(r), "k2": -r, "k3": 1 - torch.exp(r)}[estimator]
    with_kl, _ = loss_gradients(script, ref=ref, beta=0.1, kl_estimator=estimator, loss_type="bnpo")
    without, _ = loss_gradients(script, loss_type="bnpo")
    assert torch.allclose(with_kl - without, 0.1 * by_hand * MASK / 9, atol=1e-7)


def test_the_entropy_bonus_pushes_every_tokens_entropy_up(script):
    _, entropy_gradient = loss_gradients(script, entropy=torch.ones_like(NEW), entropy_coef=0.1, loss_type="bnpo")
    assert torch.allclose(entropy_gradient, -0.1 * MASK / 9)


def test_advantages_by_group_by_batch_and_unscaled(script, monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor: None)  # one rank
    monkeypatch.setattr(common, "local_device", lambda: torch.device("cpu"))
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])  # the second group all equal: no signal
    assert script.group_advantages(rewards, 2, "none").tolist() == [0.5, -0.5, 0.0, 0.0]
    group = script.group_advantages(rewards, 2, "group")
    assert group.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4), 0, 0])
    batch_std = math.sqrt(((1 - 1.25) ** 2 + 1.25 ** 2 + 2 * 0.75 ** 2) / 3)  # all rewards, n - 1
    assert script.group_advantages(rewards, 2, "batch").tolist() == pytest.approx(
        [0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), 0, 0])


def test_the_batch_std_is_exact_with_large_rewards_and_a_small_spread(monkeypatch, script):
    """Rewards near 100 with a spread of 0.01: a sum of squares in fp32 loses the spread entirely."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor: None)  # one rank
    monkeypatch.setattr(common, "local_device", lambda: torch.device("cpu"))
    rewards = 100 + 0.01 * torch.randn(64, generator=torch.Generator().manual_seed(0))  # fp32
    per_prompt = rewards.view(-1, 4)
    centred = (per_prompt - per_prompt.mean(dim=1, keepdim=True)).flatten()
    expected = centred.double() / (rewards.double().std().item() + 1e-4)
    assert script.group_advantages(rewards, 4, "batch").tolist() == pytest.approx(expected.tolist(), rel=1e-5)


def test_the_entropy_bonus_has_finite_gradients_under_top_p():
    """Outside the nucleus log p = -inf: its p log p is 0 in value and must be in gradient too (it was NaN)."""
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0)).requires_grad_()
    tokens = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    logprobs, entropy = common.logprobs_from_logits(logits, tokens, 1.0, top_p=0.5, entropy=True)
    (logprobs.sum() - 0.1 * entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    # the entropy of the first position's nucleus (its sampled token kept in it), renormalized
    probs = torch.softmax(logits[0, 0].detach(), dim=-1)
    ascending, order = probs.sort()
    outside = set(order[ascending.cumsum(0) <= 0.5].tolist()) - {tokens[0, 0].item(), order[-1].item()}
    nucleus = [token for token in range(11) if token not in outside]
    assert 1 < len(nucleus) < 11
    kept = probs[nucleus] / probs[nucleus].sum()
    assert entropy[0, 0].item() == pytest.approx(-(kept * kept.log()).sum().item(), rel=1e-5)


def test_dapos_soft_overlong_punishment():
    assert grpo.soft_overlong_punishment(torch.tensor([6, 7, 10]), 10, 4).tolist() == [0.0, -0.25, -1.0]


def test_dynamic_sampling_trains_on_the_groups_with_unequal_rewards_first_in_sampling_order():
    scores = torch.tensor([1.0, 1, 0, 1, 2, 2, 0, 3])  # k = 2: equal, unequal, equal, unequal
    has_signal = common.groups_with_signal(scores, 2)
    assert has_signal.tolist() == [False, True, False, True]
    assert common.groups_to_train(has_signal, 2).tolist() == [1, 3]
    assert common.groups_to_train(has_signal, 1).tolist() == [1]
    assert common.groups_to_train(has_signal, 3).tolist() == [0, 1, 3]  # too few: the first equal group fills in


def test_grpo_learns_the_toy_task(tmp_path):
    """The toy run (10 updates of 32 prompts at 1e-4: dapo, no reference policy) gains far more than a broken loss
    could (measured: +0.41 to +0.44 over seeds 1-3)."""
    run_script(*toy_run("grpo.py"), "--output_dir", tmp_path / "toy", script="grpo.py")
    assert_learns(tmp_path / "toy")
    assert not any("eval/kl" in m or "objective/kl" in m for m in read_metrics(tmp_path / "toy"))  # beta 0
    # one epoch of one optimizer step: its own forward gave the sampling weights' log-probs, so every ratio is 1
    train = [m for m in read_metrics(tmp_path / "toy") if "val/ratio" in m]
    assert all(m["val/ratio"] == 1 and m["val/ratio_var"] == 0 and m["policy/clipfrac_avg"] == 0 for m in train)
    # and nothing is stale: the off-policy diagnostics read 0 and 1
    assert all(m["async/mismatch_kl"] == 0 and m["async/is_ratio_mean"] == m["async/is_ratio_max"] == 1
               and m["async/is_truncated_frac"] == 0 and m["async/ess"] == 1 for m in train)
    assert all(m["async/seq_log_ratio_mean"] == m["async/seq_log_ratio_peak_max"] == 0 for m in train)
    # the entropy is logged with no entropy bonus in the loss
    assert all(0 < m["policy/entropy_avg"] < math.log(len(toy.WORDS)) for m in train)


@pytest.mark.slow
def test_grpo_learns_the_arithmetic_with_dapo(tmp_path):
    """The arithmetic task's preset, DAPO's clip-higher and dynamic sampling (here at most 2 rounds of prompts, 12
    updates): accuracy 0.34 -> 0.92 measured."""
    run_script("--preset", "toy-math", "--max_sampling_rounds", "2", "--total_episodes", "768", "--eval_every", "12",
               "--output_dir", tmp_path / "math", script="grpo.py")
    metrics = read_metrics(tmp_path / "math")
    accuracy = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert accuracy[0] < 0.5 and accuracy[-1] >= 0.8, accuracy
    train = [m for m in metrics if "dynamic_sampling/rounds" in m]
    assert 2 in {m["dynamic_sampling/rounds"] for m in train} <= {1, 2}  # never more than --max_sampling_rounds
    # the batch (64 prompts) holds equal-reward groups only where the rounds found too few others
    assert all(m["objective/zero_std_groups"] * 64 == m["dynamic_sampling/unfilled"] for m in train)
    assert train[0]["dynamic_sampling/dropped_groups"] > 0


@pytest.mark.slow
def test_mask_truncated_completions_leaves_the_truncated_completions_out_of_the_loss(tmp_path):
    """Two tokens a completion at temperature 2: the toy's SFT policy, which lists key words before it stops, stops
    in none of the first update's, and most groups' rewards differ (scored by the reward model: no missing-EOS
    penalty, which would make every reward equal). With
    --mask_truncated_completions no gradient is left: the update only decays the weights (AdamW's decoupled weight
    decay, 0.01); without it the same samples train (the same seed and weights sample them). A mask that kept
    them, or kept only the others, fails. (The loss's value is 0 either way: completions of equal length, whose
    advantages sum to 0 in each group.)"""
    from transformers import AutoModelForCausalLM

    sft = AutoModelForCausalLM.from_pretrained(toy.SFT_POLICY).state_dict()
    decayed = {name: value * (1 - grpo.Args().optimizer.learning_rate * 0.01) for name, value in sft.items()}
    for flag in ([], ["--mask_truncated_completions"]):
        out = tmp_path / ("masked" if flag else "unmasked")
        run_script(*QUICK, "--total_episodes", "16", "--response_length", "2", "--temperature", "2",
                   "--no_missing_eos_penalty", "--eval_every", "0", *flag, "--output_dir", out, script="grpo.py")
        [update] = [m for m in read_metrics(out) if "loss/policy_avg" in m]
        assert update["val/num_eos_tokens"] == 0 and update["objective/zero_std_groups"] < 0.5
        trained = load_policy_weights(out)
        only_decayed = all(torch.allclose(trained[name], decayed[name], rtol=1e-6, atol=1e-9) for name in sft)
        assert only_decayed == bool(flag), flag
