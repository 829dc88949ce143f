"""Policy losses: ``impl(logprobs, old_logprobs, advantages, mask, agg, **params) -> (loss, metrics)``.

``logprobs`` are the current policy's (differentiable), ``old_logprobs`` those of the policy that the
advantages were computed for (detached), all ``[B, R]``; ``agg`` is an
:class:`~milehpc.algorithms.aggregation.Aggregator` (mode, global counts, DP scale and the off-policy weights
already set). ``metrics`` are plain floats. Formulas and clamps follow verl's ``core_algos.py``
(``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``, ``compute_value_loss``); in particular the
log-ratio is clamped to [-20, 20] before ``exp`` in PPO, and to at most 10 in GSPO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from milehpc.algorithms.aggregation import Aggregator, masked_mean

if TYPE_CHECKING:
    import torch

Metrics = dict[str, float]


def _fraction(flags: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> float:
    """The masked fraction of ``flags``, counted in ``like``'s dtype (a float64 batch's metric stays exact)."""
    return float(masked_mean(flags.to(like.dtype), mask))


def _ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor, prefix: str = "actor") -> Metrics:
    if not bool(mask.any()):
        return {f"{prefix}/ratio_mean": 1.0, f"{prefix}/ratio_max": 1.0, f"{prefix}/ratio_min": 1.0}
    r = ratio.detach()
    keep = mask > 0
    return {
        f"{prefix}/ratio_mean": float(masked_mean(r, mask)),
        f"{prefix}/ratio_max": float(r[keep].max()),
        f"{prefix}/ratio_min": float(r[keep].min()),
    }


def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, agg: Aggregator, clip_low: float = 0.2, clip_high: float = 0.2,
             clip_ratio_c: float = 3.0) -> tuple[torch.Tensor, Metrics]:
    """PPO clip with separate low/high ranges (``1 - clip_low <= r <= 1 + clip_high``, DAPO's clip-higher) and
    dual clip (https://arxiv.org/abs/1912.09729): for negative advantages the loss is capped at
    ``-A * clip_ratio_c``. ``clip_ratio_c = 0`` turns dual clip off (verl always applies it, default 3)."""
    import torch

    if clip_ratio_c and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or 0 = off), got {clip_ratio_c}")
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    metrics: Metrics = {
        "actor/clip_frac": _fraction(loss2 > loss1, mask, ratio),
        "actor/approx_kl": float(masked_mean(-log_ratio.detach(), mask)),
    }
    if clip_ratio_c:
        loss3 = -advantages * clip_ratio_c
        dual = torch.minimum(loss3, clipped)
        metrics["actor/clip_frac_lower"] = _fraction((clipped > loss3) & (advantages < 0), mask, ratio)
        per_token = torch.where(advantages < 0, dual, clipped)
    else:
        metrics["actor/clip_frac_lower"] = 0.0
        per_token = clipped
    metrics.update(_ratio_metrics(ratio, mask))
    return agg(per_token, mask), metrics


def policy_gradient(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, agg: Aggregator) -> tuple[torch.Tensor, Metrics]:
    """Vanilla (importance-weighted) policy gradient ``-A * pi/pi_old``, no clipping: at ``pi = pi_old`` its
    gradient is ``-A * grad log pi`` (REINFORCE)."""
    import torch

    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    metrics = {"actor/approx_kl": float(masked_mean(-log_ratio.detach(), mask)), "actor/clip_frac": 0.0}
    metrics.update(_ratio_metrics(ratio, mask))
    return agg(-advantages * ratio, mask), metrics


def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         agg: Aggregator, clip_low: float = 3e-4, clip_high: float = 4e-4) -> tuple[torch.Tensor, Metrics]:
    """GSPO (https://arxiv.org/abs/2507.18071): the sequence-level ratio
    ``s_i = exp(mean_t log(pi/pi_old))`` (geometric mean over the sequence's tokens), clipped at the sequence
    level; per token ``s_it = sg[s_i] * pi_t / sg[pi_t]`` so every token gets the sequence's weight. As in
    verl, the log-ratio is clamped to at most 10 and the loss is always aggregated seq-mean-token-mean
    (whatever ``loss_agg_mode`` says). Default clip ranges are the paper's (3e-4, 4e-4)."""
    import torch

    m = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).masked_fill(m == 0, 0.0)
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    log_s = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_s, max=10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss1, loss2)
    metrics: Metrics = {
        "actor/clip_frac": _fraction(loss2 > loss1, mask, ratio),
        "actor/clip_frac_lower": 0.0,
        "actor/approx_kl": float(masked_mean(-log_ratio.detach(), mask)),
    }
    metrics.update(_ratio_metrics(ratio, mask))
    return agg.with_mode("seq-mean-token-mean")(per_token, mask), metrics


def sft(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
        agg: Aggregator) -> tuple[torch.Tensor, Metrics]:
    """Supervised fine-tuning: the negative log-likelihood of the response tokens (advantages ignored)."""
    nll = -logprobs
    return agg(nll, mask), {"actor/nll": float(masked_mean(nll.detach(), mask))}


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor,
               agg: Aggregator, clip: float = 0.5) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss for the critic (verl ``compute_value_loss``):
    ``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``. ``clip = 0`` disables clipping."""
    import torch

    loss1 = (values - returns).square()
    if clip:
        clipped = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
        loss2 = (clipped - returns).square()
        per_token = torch.maximum(loss1, loss2)
        frac = _fraction(loss2 > loss1, mask, values)
    else:
        per_token, frac = loss1, 0.0
    metrics: dict[str, Any] = {"critic/clip_frac": frac,
                               "critic/value_mean": float(masked_mean(values.detach(), mask))}
    return 0.5 * agg(per_token, mask), metrics
