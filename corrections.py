"""The off-policy corrections of the scripts with a policy ratio (PPO, RLOO, GRPO and their vLLM twins), and
their flags (CorrectionArgs; TokenCorrectionArgs where the loss is per token, with --correction_level):
--off_policy_correction none, decoupled, pure_is, tis, mask or m2po makes the ratio's denominator, each policy
term's weight and the tokens that count from the sampling, start-of-update and current log-probs, and every
update logs the same diagnostics (ALGORITHMS.md, "Off-policy corrections")."""

import statistics
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

import common

DEFAULT_IS_CAP = {"none": 2.0, "decoupled": 5.0, "pure_is": 5.0, "tis": 2.0, "mask": 5.0,  # none: what
                  "m2po": 5.0}  # async/is_truncated_frac counts against
ESS_SUMS = "ess_sums"  # a micro-batch's (sum w, sum w^2, count), which merge_diagnostics turns into async/ess
# the diagnostics of samples drawn by the weights that train them, and of a micro-batch with no real token
NOTHING_STALE = {"async/mismatch_kl": 0.0, "async/is_ratio_mean": 1.0, "async/is_ratio_max": 1.0,
                 "async/is_truncated_frac": 0.0, "async/seq_log_ratio_mean": 0.0, "async/seq_log_ratio_peak": 0.0,
                 "async/seq_log_ratio_peak_max": 0.0}


@dataclass
class CorrectionArgs(common.FlagGroup):
    """Off-policy corrections: how the loss treats samples drawn with other weights than those it trains"""

    off_policy_correction: Literal["none", "decoupled", "pure_is", "tis", "mask", "m2po"] = "none"
    """(ALGORITHMS.md, "Off-policy corrections") none, the ratio against the sampling weights' log-probs;
    decoupled (AReaL's decoupled PPO), against the trainer's weights at the start of the update (the clip binds
    on later epochs and mini-batches), each term weighted by pi_start / pi_sampling, terms above --is_cap dropped;
    pure_is, against the weights just before each optimizer step (the ratio is 1: no clip binds, no trust
    region), weighted by min(pi_step / pi_sampling, --is_cap); tis (truncated importance sampling), against the
    start of the update, weighted by min(pi_start / pi_sampling, --is_cap); mask (IcePop), the same, but terms
    whose weight lies outside [--is_mask_low, --is_cap] are dropped; m2po (M2PO), decoupled without the epsilon
    clip, dropping the tokens of largest (log pi_start / pi_sampling)^2 until their mean is below --m2_threshold"""
    is_cap: float | None = None
    """upper bound of the importance weight: default 5 with decoupled, pure_is and m2po (AReaL's), 2 with tis
    (verl's, slime's), 5 with mask (IcePop's); with none, the bound that async/is_truncated_frac counts against (2)"""
    is_mask_low: float = 0.5
    """with --off_policy_correction mask, the smallest weight kept (IcePop's 0.5)"""
    m2_threshold: float = 0.04
    """with --off_policy_correction m2po, the bound on the mean squared log-ratio of the tokens kept (M2PO's and
    AReaL's 0.04)"""

    @property
    def cap(self) -> float:
        """--is_cap, or its default for --off_policy_correction."""
        return DEFAULT_IS_CAP[self.off_policy_correction] if self.is_cap is None else self.is_cap

    @property
    def reads_start_logprobs(self) -> bool:
        """Whether the correction reads the trainer's log-probs at the start of the update (a forward pass)."""
        return self.off_policy_correction in ("decoupled", "tis", "mask", "m2po")

    def check(self):
        if self.is_cap is not None and self.is_cap <= 0:
            common.fail(f"--is_cap must be positive (an importance weight's upper bound), got {self.is_cap}")
        if not 0 <= self.is_mask_low < self.cap:
            common.fail(f"--is_mask_low {self.is_mask_low} must be at least 0 and below --is_cap {self.cap:g} "
                        "(mask keeps the weights between the two)")
        if self.m2_threshold <= 0:
            common.fail(f"--m2_threshold must be positive (a mean squared log-ratio), got {self.m2_threshold}")


@dataclass
class TokenCorrectionArgs(CorrectionArgs):
    """Off-policy corrections: how the loss treats samples drawn with other weights than those it trains"""

    correction_level: Literal["token", "sequence"] = "token"
    """the correction's importance weights per token, or per completion (sequence: exp of its summed log-ratio,
    on every token; RLOO's loss, per completion, always weighs per completion); GRPO's
    --importance_sampling_level is the level of the loss's policy ratio (GSPO), not of these weights"""


class OffPolicyTerms(NamedTuple):
    """What --off_policy_correction makes of a micro-batch (off_policy_terms)."""

    anchor: torch.Tensor  # (n, R) the log-probs the ratio is taken against
    weights: torch.Tensor  # (n, R), or (n, 1) per completion: each policy term's weight, detached (0: dropped)
    kept: torch.Tensor  # (n, R) the real tokens the policy terms keep (all but those m2po drops)
    clip: bool  # whether the loss clips the ratio (every correction but m2po)
    diagnostics: dict

    @property
    def token_weights(self) -> torch.Tensor:
        """(n, R) each token's policy term's weight in a per-token loss: 0 on the tokens m2po drops."""
        return self.weights * self.kept


def off_policy_terms(new_logprobs, sampling_logprobs, start_logprobs, mask, corrections: CorrectionArgs,
                     sequence_level: bool) -> OffPolicyTerms:
    """What --off_policy_correction makes of a micro-batch, all (n, R): the training forward's log-probs (the
    weights just before this optimizer step), the sampling weights', the trainer's at the start of the update
    (start_logprobs), and the mask of real tokens. With rho = pi_base / pi_sampling, per token, or with
    `sequence_level` one per completion (exp of its summed log-ratio over its kept tokens):
      none:      anchor the sampling weights'; weight 1
      decoupled: anchor the start of the update's (AReaL's proximal policy); w = rho (base: the start), 0 above cap
      pure_is:   anchor the weights just before this step (the ratio is 1 in value: no clip binds);
                 w = min(rho, cap) (base: this step)
      tis:       anchor the start of the update's; w = min(rho, cap) (base: the start)
      mask:      anchor the start of the update's; w = rho where it lies in [is_mask_low, cap], else 0
      m2po:      decoupled, unclipped, and only the kept tokens (second_moment_mask) count: a per-token loss
                 weighs the others 0 (token_weights), a per-completion loss sums its log-probs over the kept
    Diagnostics: async/mismatch_kl, the k3 estimate of KL(pi_sampling || pi_step) per token; async/seq_log_ratio_*,
    the same drift per completion (sequence_log_ratios); async/is_ratio_* and async/is_truncated_frac describe rho
    before truncation (base: this step under none); with mask and m2po the share of terms dropped; the sums
    async/ess is made of (merge_diagnostics)."""
    # the weights and the anchor are constants of the loss: no gradient reaches the policy through them, whatever
    # forward the caller computed its log-probs in
    step_logprobs, sampling_logprobs, start_logprobs = (x.detach() for x in (new_logprobs, sampling_logprobs,
                                                                               start_logprobs))
    correction, cap = corrections.off_policy_correction, corrections.cap
    base = start_logprobs if corrections.reads_start_logprobs else step_logprobs
    anchor = sampling_logprobs if correction == "none" else base
    kept = mask
    if correction == "m2po":
        kept = mask * second_moment_mask(start_logprobs - sampling_logprobs, mask, corrections.m2_threshold)
    # (n, R); exp stays finite; per completion the sum runs over the kept tokens (m2po's drop out of it)
    log_weights = torch.clamp(base - sampling_logprobs, -20, 20) * (kept if sequence_level else mask)
    real = mask.bool()
    if sequence_level:
        log_weights, real = log_weights.sum(dim=1, keepdim=True), torch.ones_like(real[:, :1])  # (n, 1)
    raw = torch.exp(log_weights)
    weights = torch.ones_like(raw)
    if correction in ("pure_is", "tis"):
        weights = torch.clamp(raw, max=cap)
    elif correction in ("decoupled", "m2po"):  # AReaL's behav_imp_weight_cap: a token above it drops out
        weights = torch.where(raw <= cap, raw, 0.0)
    elif correction == "mask":
        weights = torch.where((raw >= corrections.is_mask_low) & (raw <= cap), raw, 0.0)
    step_log_ratio = step_logprobs - sampling_logprobs
    # a micro-batch with no real token (all of it left out: --mask_truncated_completions) describes nothing
    diagnostics = dict(NOTHING_STALE) if not real.any() else {
        "async/mismatch_kl": common.masked_mean(torch.exp(step_log_ratio) - step_log_ratio - 1, mask),
        "async/is_ratio_mean": raw[real].mean().item(), "async/is_ratio_max": raw[real].max().item(),
        "async/is_truncated_frac": (raw[real] > cap).float().mean().item(),
        **sequence_log_ratios(step_log_ratio, mask)}
    diagnostics[ESS_SUMS] = (raw[real].sum().item(), (raw[real] ** 2).sum().item(), real.sum().item())
    if correction == "mask":
        diagnostics["async/is_masked_frac"] = (weights[real] == 0).float().mean().item() if real.any() else 0.0
    if correction == "m2po":
        diagnostics["async/m2po_masked_frac"] = 1 - kept.sum().item() / max(mask.sum().item(), 1)
    return OffPolicyTerms(anchor, weights, kept, correction != "m2po", diagnostics)


def sequence_log_ratios(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The drift per completion, of the per-token log_ratio = log pi_step / pi_sampling over each completion's real
    tokens (`mask`), both (n, R): async/seq_log_ratio_mean, the mean over completions of each one's mean log-ratio
    (a drift spread over many tokens); async/seq_log_ratio_peak, the mean over completions of each one's largest
    |log-ratio| (one token moved far: a per-token mean hides it); async/seq_log_ratio_peak_max, the largest of
    those. Completions with no real token count for nothing."""
    real = mask.bool()
    counted = real.any(dim=1)  # (n,)
    means = torch.where(real, log_ratio, 0.0).sum(dim=1)[counted] / real.sum(dim=1)[counted]  # (completions,)
    peaks = torch.where(real, log_ratio.abs(), 0.0).max(dim=1).values[counted]  # (completions,)
    return {"async/seq_log_ratio_mean": means.mean().item(), "async/seq_log_ratio_peak": peaks.mean().item(),
            "async/seq_log_ratio_peak_max": peaks.max().item()}


def second_moment_mask(log_ratios: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's trust region (Zheng et al., 2025; AReaL's _apply_m2po_masking): of the real tokens (`mask`), the
    ones with the largest m2 = log_ratio^2 (log pi_start / pi_sampling) are dropped, largest first, until the mean
    m2 of the rest is below `threshold`; at least one token stays. Returns the kept tokens (n, R), 0 or 1."""
    real = mask.bool()
    m2 = log_ratios[real].float() ** 2  # (T,) one per real token
    if m2.numel() == 0:
        return mask
    ordered, order = torch.sort(m2, descending=True)
    # the mean of each suffix: the tokens that stay when all before it are dropped
    suffix_means = ordered.flip(0).cumsum(0).flip(0) / torch.arange(len(ordered), 0, -1, device=m2.device)
    below = torch.nonzero(suffix_means < threshold)
    dropped = below[0].item() if len(below) else len(ordered) - 1
    kept_real = torch.zeros_like(m2, dtype=torch.bool)  # (T,)
    kept_real[order[dropped:]] = True
    kept = torch.zeros_like(mask)
    kept[real] = kept_real.to(mask.dtype)
    return kept


def merge_diagnostics(diagnostics: list[dict]) -> dict[str, float]:
    """The micro-batches' off_policy_terms diagnostics as one update's: the largest async/is_ratio_max, the
    mean of the others (over the micro-batches with real tokens), and async/ess = (sum w)^2 / (N sum w^2), the
    effective sample size's share, of every weight before truncation (rho; 1 when nothing is stale, or no token
    counts)."""
    counted = [d for d in diagnostics if d[ESS_SUMS][2]] or diagnostics  # those with real tokens, if any
    merged = {name: (max if name.endswith("_max") else statistics.mean)([d[name] for d in counted])
              for name in counted[0] if name != ESS_SUMS}
    total, squares, count = map(sum, zip(*(d[ESS_SUMS] for d in diagnostics)))
    merged["async/ess"] = total ** 2 / max(count * squares, 1e-30) if count else 1.0
    return merged
