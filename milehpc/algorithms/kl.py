"""Per-token KL estimators between the policy and a reference policy (J. Schulman, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html), with verl's names and clamps (``kl_penalty`` in
``verl/trainer/ppo/core_algos.py``)::

    k1 | kl          log p - log q
    k2 | mse         0.5 * (log p - log q)^2
    k3 | low_var_kl  exp(d) - d - 1 with d = clamp(log q - log p, -20, 20), the result clamped to [-10, 10]
    abs              |log p - log q|

where ``p`` is the policy and ``q`` the reference. Used in the loss (``kl_in_reward = false``, a KL-loss term
``kl_coef * agg(kl)``) or in the reward (``kl_in_reward = true``: ``r_t -= kl_coef * kl_t``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KL_TYPES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "k3") -> torch.Tensor:
    """``[B, R]`` per-token KL estimate of the policy from the reference."""
    import torch

    if kl_type in ("k1", "kl"):
        return logprobs - ref_logprobs
    if kl_type == "abs":
        return (logprobs - ref_logprobs).abs()
    if kl_type in ("k2", "mse"):
        return 0.5 * (logprobs - ref_logprobs).square()
    if kl_type in ("k3", "low_var_kl"):
        d = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
        return torch.clamp(d.exp() - d - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown kl_type {kl_type!r} (expected one of: {', '.join(KL_TYPES)})")
