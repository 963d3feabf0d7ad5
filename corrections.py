"""The off-policy corrections of the scripts with a policy ratio (PPO, RLOO, GRPO and their vLLM twins), and
their flags (CorrectionArgs; TokenCorrectionArgs where the loss is per token, with --is_level):
--off_policy_correction none, decoupled, tis or mask makes the ratio's denominator and each policy term's
weight from the sampling, start-of-update and current log-probs, and every update logs the same diagnostics
(ALGORITHMS.md, "Off-policy corrections")."""

import statistics
from dataclasses import dataclass
from typing import Literal

import torch

import common

DEFAULT_IS_CAP = {"none": 2.0, "decoupled": 5.0, "tis": 2.0, "mask": 5.0}  # none: what is_truncated_frac counts


@dataclass
class CorrectionArgs(common.FlagGroup):
    """Off-policy corrections: how the loss treats samples drawn with other weights than those it trains"""

    off_policy_correction: Literal["none", "decoupled", "tis", "mask"] = "none"
    """(ALGORITHMS.md, "Off-policy corrections") none, the ratio against the sampling weights' log-probs;
    decoupled (AReaL's decoupled PPO, the kit's variant), against the weights just before each optimizer step,
    each term weighted by min(pi_those / pi_sampling, --is_cap); tis (truncated importance sampling), against the
    weights at the start of the update, weighted by min(pi_start / pi_sampling, --is_cap); mask (IcePop), the
    same ratio and weight, but terms whose weight lies outside [--is_mask_low, --is_cap] are dropped"""
    is_cap: float | None = None
    """upper bound of the importance weight: default 5 with decoupled (AReaL's), 2 with tis (verl's, slime's), 5
    with mask (IcePop's); with none, the bound that async/is_truncated_frac counts against (2)"""
    is_mask_low: float = 0.5
    """with --off_policy_correction mask, the smallest weight kept (IcePop's 0.5)"""

    @property
    def cap(self) -> float:
        """--is_cap, or its default for --off_policy_correction."""
        return DEFAULT_IS_CAP[self.off_policy_correction] if self.is_cap is None else self.is_cap

    def check(self):
        if self.is_cap is not None and self.is_cap <= 0:
            common.fail(f"--is_cap must be positive (an importance weight's upper bound), got {self.is_cap}")
        if not 0 <= self.is_mask_low < self.cap:
            common.fail(f"--is_mask_low {self.is_mask_low} must be at least 0 and below --is_cap {self.cap:g} "
                        "(mask keeps the weights between the two)")


@dataclass
class TokenCorrectionArgs(CorrectionArgs):
    """Off-policy corrections: how the loss treats samples drawn with other weights than those it trains"""

    is_level: Literal["token", "sequence"] = "token"
    """importance weights per token, or per completion (sequence: exp of its summed log-ratio, on every token;
    RLOO's loss, per completion, always weighs per completion)"""


def off_policy_terms(new_logprobs, sampling_logprobs, start_logprobs, mask, corrections: CorrectionArgs,
                     sequence_level: bool):
    """What --off_policy_correction makes of a micro-batch, all (n, R): the training forward's log-probs (the
    weights just before this optimizer step), the sampling weights', the trainer's at the start of the update
    (start_logprobs), and the mask of real tokens. Returns the log-probs the ratio is taken against (n, R),
    each term's weight (n, R), or (n, 1) with `sequence_level` (one per completion, from its summed log-ratio),
    detached, and the diagnostics (floats):
      none:      the sampling weights'; weight 1
      decoupled: the weights just before this step (the ratio is 1 in value: no clip binds); w = min(pi_step /
                 pi_sampling, cap)
      tis:       the start of the update's; w = min(pi_start / pi_sampling, cap)
      mask:      the start of the update's; w = pi_start / pi_sampling where it lies in [is_mask_low, cap], else 0
    async/mismatch_kl is the k3 estimate of KL(pi_sampling || pi_step) per token; async/is_ratio_* and
    async/is_truncated_frac describe the weight before truncation, pi_step / pi_sampling under none."""
    step_logprobs = new_logprobs.detach()
    correction, cap = corrections.off_policy_correction, corrections.cap
    anchor = {"none": sampling_logprobs, "decoupled": step_logprobs}.get(correction, start_logprobs)
    base = start_logprobs if correction in ("tis", "mask") else step_logprobs
    log_weights = torch.clamp(base - sampling_logprobs, -20, 20) * mask  # (n, R); exp stays finite
    real = mask.bool()
    if sequence_level:
        log_weights, real = log_weights.sum(dim=1, keepdim=True), torch.ones_like(real[:, :1])  # (n, 1)
    raw = torch.exp(log_weights)
    weights = torch.ones_like(raw)
    if correction in ("decoupled", "tis"):
        weights = torch.clamp(raw, max=cap)
    elif correction == "mask":
        weights = torch.where((raw >= corrections.is_mask_low) & (raw <= cap), raw, 0.0)
    step_log_ratio = step_logprobs - sampling_logprobs
    diagnostics = {"async/mismatch_kl": common.masked_mean(torch.exp(step_log_ratio) - step_log_ratio - 1, mask),
                   "async/is_ratio_mean": raw[real].mean().item(), "async/is_ratio_max": raw[real].max().item(),
                   "async/is_truncated_frac": (raw[real] > cap).float().mean().item()}
    if correction == "mask":
        diagnostics["async/is_masked_frac"] = (weights[real] == 0).float().mean().item()
    return anchor, weights, diagnostics


def merge_diagnostics(diagnostics: list[dict]) -> dict[str, float]:
    """The micro-batches' off_policy_terms diagnostics as one update's: the largest async/is_ratio_max, the
    mean of the others."""
    return {name: (max if name.endswith("_max") else statistics.mean)([d[name] for d in diagnostics])
            for name in diagnostics[0]}
