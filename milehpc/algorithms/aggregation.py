"""Loss aggregation: a ``[B, R]`` per-token loss matrix and mask to one scalar, consistent across DP ranks.

Modes (the names and formulas of verl's ``agg_loss``, ``verl/trainer/ppo/core_algos.py``)::

    token-mean               sum_i sum_t m_it l_it / N_tokens
    token-sum                sum_i sum_t m_it l_it                       (no normaliser; verl #7197)
    seq-mean-token-sum       sum_i (sum_t m_it l_it) / N_seqs
    seq-mean-token-mean      sum_i (sum_t m_it l_it / (n_i + 1e-8)) / N_seqs
    seq-mean-token-sum-norm  sum_i (sum_t m_it l_it) / N_seqs / horizon      (Dr. GRPO's constant normaliser)

``N_tokens`` / ``N_seqs`` are the counts of the *global* batch (all DP ranks, all micro-batches of one
optimizer step) when given; a fully masked row is not a sequence (verl). Each rank's loss is multiplied by
``dp_size`` so that DDP's gradient *mean* over ranks gives exactly the gradient of the single-rank loss on the
union of the ranks' data (``sum_r dp * S_r / N / dp = S / N``). With gradient accumulation over micro-batches,
*sum* the micro-batch losses (do not average them): each already carries the global denominator.

Where verl divides by zero (an empty batch), the denominators here are clamped to at least 1, so an all-masked
batch gives a loss of 0 and zero gradients instead of NaN. ``horizon`` defaults to the mask's width like verl;
pass a constant (the rollout's ``max_new_tokens``) so ranks with differently padded batches agree.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Aggregator:
    """``agg(loss_mat, mask) -> scalar``, configured once per optimizer step; losses receive one of these.

    ``weights`` (``[B, R]``, detached) multiply the per-token loss before aggregation: the off-policy
    importance weights. They are set only on the aggregator handed to the policy loss, not on the ones for
    the KL and entropy terms (as verl applies ``rollout_is_weights`` to the policy-gradient term only).
    """

    mode: str = "token-mean"
    global_tokens: float | None = None
    global_seqs: float | None = None
    dp_size: int = 1
    horizon: float | None = None
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown loss_agg_mode {self.mode!r} (expected one of: {', '.join(MODES)})")
        if self.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if self.dp_size > 1 and self.mode != "token-sum":  # a sum needs no global count
            needed = "global_tokens" if self.mode == "token-mean" else "global_seqs"
            if getattr(self, needed) is None:
                raise ValueError(f"{needed} is required when dp_size > 1 ({self.mode})")

    def with_mode(self, mode: str) -> Aggregator:
        return replace(self, mode=mode)

    def with_weights(self, weights: torch.Tensor | None) -> Aggregator:
        return replace(self, weights=weights)

    def __call__(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.to(loss_mat.dtype)
        if self.weights is not None:
            loss_mat = loss_mat * self.weights.to(loss_mat.dtype)
        # where(), not a product: a masked inf/NaN (e.g. a padded logprob) must not leak into the sum.
        masked = loss_mat.masked_fill(mask == 0, 0.0) * mask
        if self.mode == "token-mean":
            total = self.global_tokens if self.global_tokens is not None else mask.sum()
            return masked.sum() / _at_least_one(total, masked) * self.dp_size
        if self.mode == "token-sum":
            return masked.sum() * self.dp_size
        counts = mask.sum(-1)
        seq = masked.sum(-1)
        if self.mode == "seq-mean-token-mean":
            seq = seq / (counts + 1e-8)
        n_seqs = self.global_seqs if self.global_seqs is not None else (counts > 0).sum()
        loss = seq.sum() / _at_least_one(n_seqs, masked) * self.dp_size
        if self.mode == "seq-mean-token-sum-norm":
            loss = loss / (self.horizon if self.horizon is not None else mask.shape[-1])
        return loss


def _at_least_one(count: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1.0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over ``mask``; 0 where nothing is masked in (verl's divides by zero there)."""
    mask = mask.to(values.dtype)
    vals = values.masked_fill(mask == 0, 0.0)
    if dim is None:
        return vals.sum() / mask.sum().clamp(min=1.0)
    return vals.sum(dim) / mask.sum(dim).clamp(min=1.0)


# When the step's batch is split over data-parallel ranks, whitening must use the statistics of the whole batch:
# the trainer sets a reducer (a sum over its DP group) for the duration of compute_advantages.
_DP_SUM: contextvars.ContextVar[Callable[[torch.Tensor], torch.Tensor] | None] = contextvars.ContextVar(
    "milehpc_dp_sum", default=None)


@contextlib.contextmanager
def dp_statistics(dp_sum: Callable[[torch.Tensor], torch.Tensor] | None) -> Iterator[None]:
    """Inside, :func:`masked_whiten` takes its mean and variance over every DP rank's share (``dp_sum`` sums a
    tensor over the DP group, e.g. an all-reduce). ``None`` keeps the statistics local."""
    token = _DP_SUM.set(dp_sum)
    try:
        yield
    finally:
        _DP_SUM.reset(token)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries with the unbiased (Bessel) variance, as verl's
    ``masked_whiten``. With fewer than two masked entries verl divides by zero; here the variance is taken as
    0 then (so one token whitens to 0, not NaN). Under :func:`dp_statistics` the mean and variance are those of
    the union of all DP ranks' entries (so the result equals whitening the whole batch on one rank)."""
    import torch

    mask = mask.to(values.dtype)
    dp_sum = _DP_SUM.get() or (lambda t: t)
    totals = dp_sum(torch.stack([(values * mask).sum(), mask.sum()]).double())
    n = totals[1].to(values.dtype)
    mean = (totals[0] / n.clamp(min=1.0)).to(values.dtype)
    centered = (values - mean).masked_fill(mask == 0, 0.0)
    square_sum = dp_sum((centered.square() * mask).sum().double().reshape(1))[0].to(values.dtype)
    var = square_sum / (n - 1).clamp(min=1.0)
    return (values - mean) * (var + eps).rsqrt()
