"""Off-policy correction against the rollout engine's logprobs (the training/inference mismatch and stale
samples): importance weights ``w = pi_old / pi_rollout`` that multiply the policy-gradient term.

``pi_old`` is the trainer's probability of the sampled token under the weights that generated it
(``batch.old_logprobs``, or the current logprobs detached when the loop does one optimizer step per batch) and
``pi_rollout`` the engine's (``batch.rollout_logprobs``). As in verl's ``rollout_corr_helper.py``, the log-ratio
is clamped to [-20, 20] before ``exp``, and the sequence level uses the product of the token ratios
(``exp(sum_t m_t * log_ratio_t)``), broadcast to every token of the sequence.

- ``tis`` (truncated importance sampling): ``w = min(ratio, cap)``.
- ``mis`` (masked importance sampling): ``w = ratio`` where ``ratio <= cap``, else 0: the token (or the whole
  sequence) drops out of the gradient but still counts in the aggregation denominator.

The weights are detached: they rescale the gradient, they are not differentiated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from milehpc.algorithms.aggregation import masked_mean

if TYPE_CHECKING:
    import torch

SAFETY_BOUND = 20.0


def importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = "tis", level: str = "token", cap: float = 2.0,
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """``([B, R] weights, metrics)`` for ``mode`` in {tis, mis} at ``level`` in {token, sequence}."""
    import torch

    if mode not in ("tis", "mis"):
        raise ValueError(f"unknown off-policy correction {mode!r} (expected tis or mis)")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown off-policy level {level!r} (expected token or sequence)")
    mask = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs - rollout_logprobs).detach().masked_fill(mask == 0, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    over = ratio > cap
    weights = ratio.clamp(max=cap) if mode == "tis" else ratio.masked_fill(over, 0.0)
    weights = weights * mask
    metrics = {
        "off_policy/ratio_mean": float(masked_mean(ratio, mask)),
        "off_policy/ratio_max": float(ratio.masked_fill(mask == 0, float("-inf")).max()) if mask.any() else 0.0,
        "off_policy/ratio_min": float(ratio.masked_fill(mask == 0, float("inf")).min()) if mask.any() else 0.0,
        "off_policy/capped_fraction": float(masked_mean(over.to(mask.dtype), mask)),
        "off_policy/weight_mean": float(masked_mean(weights, mask)),
        # The mismatch itself: k1 estimate of KL(rollout || old) on the sampled tokens.
        "off_policy/mismatch_kl": float(masked_mean((rollout_logprobs - old_logprobs).detach(), mask)),
    }
    return weights.detach(), metrics
