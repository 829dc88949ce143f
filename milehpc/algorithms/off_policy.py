"""Off-policy correction against the rollout engine's logprobs (the training/inference mismatch and stale
samples): importance weights ``w = pi_old / pi_rollout`` that multiply the policy-gradient term.

``pi_old`` is the trainer's probability of the sampled token under the weights that generated it
(``batch.old_logprobs``, or the current logprobs detached when the loop does one optimizer step per batch) and
``pi_rollout`` the engine's (``batch.rollout_logprobs``). The formulas are those of verl's
``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``; Liu, Li et al., "When Speed Kills Stability", https://richardli.xyz/rl-collapse):

- the log-ratio ``log pi_old - log pi_rollout`` is taken on the masked-in tokens only (a padding token's garbage
  logprob, even inf or NaN, never enters) and clamped to [-20, 20] before ``exp`` (verl's ``SAFETY_BOUND``);
- the sequence level uses the product of the token ratios, ``exp(clamp(sum_t m_t * log_ratio_t, -20, 20))``
  (the clamp on the *sum*), broadcast to every token of the sequence;
- ``tis`` (truncated importance sampling; verl's Token-TIS / Seq-TIS): ``w = min(ratio, cap)``;
- ``mis`` (masked importance sampling; verl's ``rollout_rs = token_k1 / seq_sum_k1`` with Token-/Seq-TIS):
  ``w = ratio`` where ``lower <= ratio <= cap`` (both bounds kept), else 0. verl's single-threshold rejection
  uses ``lower = 1 / cap``; ``lower = 0`` (the default) rejects on the upper bound only, as the MIS paper.
  A rejected token (or sequence) keeps its place in the aggregation's denominator with weight 0 (the paper's
  estimator); verl instead removes it from the response mask before the step, which needs ``pi_old`` before
  the step's token counts are fixed (here it is known only in the loss's own forward with one epoch).

The weights are detached: they rescale the gradient, they are not differentiated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from milehpc.algorithms.aggregation import masked_mean

if TYPE_CHECKING:
    import torch

SAFETY_BOUND = 20.0


def importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = "tis", level: str = "token", cap: float = 2.0, lower: float = 0.0,
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """``([B, R] weights, metrics)`` for ``mode`` in {tis, mis} at ``level`` in {token, sequence}; ``lower`` is
    MIS's lower ratio bound (0 = none)."""
    import torch

    if mode not in ("tis", "mis"):
        raise ValueError(f"unknown off-policy correction {mode!r} (expected tis or mis)")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown off-policy level {level!r} (expected token or sequence)")
    if not 0.0 <= lower < cap:
        raise ValueError(f"expected 0 <= lower < cap for the off-policy ratio bounds, got {lower} and {cap}")
    mask = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs - rollout_logprobs).detach().masked_fill(mask == 0, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    # Outside the accepted range: above the cap (both modes), or below MIS's lower bound.
    out = (ratio > cap) | (ratio < lower) if mode == "mis" else ratio > cap
    weights = ratio.clamp(max=cap) if mode == "tis" else ratio.masked_fill(out, 0.0)
    weights = weights * mask
    metrics = {
        "off_policy/ratio_mean": float(masked_mean(ratio, mask)),
        "off_policy/ratio_max": float(ratio.masked_fill(mask == 0, float("-inf")).max()) if mask.any() else 0.0,
        "off_policy/ratio_min": float(ratio.masked_fill(mask == 0, float("inf")).min()) if mask.any() else 0.0,
        "off_policy/capped_fraction": float(masked_mean(out.to(mask.dtype), mask)),
        "off_policy/weight_mean": float(masked_mean(weights, mask)),
        # The mismatch itself: k1 estimate of KL(rollout || old) on the sampled tokens.
        "off_policy/mismatch_kl": float(masked_mean((rollout_logprobs - old_logprobs).detach(), mask)),
    }
    return weights.detach(), metrics
