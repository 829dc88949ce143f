"""Advantage estimators: ``impl(batch, **params) -> (advantages [B, R], returns [B, R])``.

Every estimator reads the per-token rewards of :func:`token_level_rewards` (the scalar reward on the last
response token unless the batch carries ``token_rewards``, e.g. after an in-reward KL penalty) and returns
tensors that are 0 outside ``batch.response_mask``, in the batch's float type. Conventions follow verl's
``core_algos.py``:

- a sequence's score is the sum of its token rewards;
- group statistics use the *unbiased* std (``torch.std``), and epsilon is added to the std, not the variance:
  ``(s - mean) / (std + eps)``;
- a group of size 1 has mean 0 and std 1 (so its advantage is its score), RLOO leaves a lone score as is;
- discounted returns (REINFORCE++) and GAE run over the mask-1 tokens only: an observation span (mask 0) inside a
  multi-turn response carries the running return / GAE through unchanged and holds 0 itself;
- batch whitening (REINFORCE++, GAE) is ``(x - mean) * rsqrt(var + 1e-8)`` with the unbiased variance over the
  masked tokens (:func:`~milehpc.algorithms.aggregation.masked_whiten`).

All-equal rewards in a group give advantages of exactly 0, never NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from milehpc.algorithms.aggregation import masked_whiten

if TYPE_CHECKING:
    import torch

    from milehpc.samples.batch import Batch


def _dtype(batch: Batch) -> torch.dtype:
    """The batch's float type: a float64 batch (for checking) keeps every result in float64."""
    import torch

    return torch.promote_types(batch.rewards.dtype, batch.response_mask.dtype)


def outcome_index(batch: Batch) -> torch.Tensor:
    """``[B]`` the response position of each row's outcome: its last token with mask 1 (the model's last token;
    a multi-turn response that ends in an observation span keeps its reward on the model's answer, where the
    returns and GAE can carry it back), or its last token when no token has mask 1 (-1 for an empty response)."""
    import torch

    mask = batch.response_mask
    if mask.shape[1] == 0:
        return batch.response_lengths - 1
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last_trained = torch.where(mask > 0, pos, -1).amax(-1)
    return torch.where(last_trained >= 0, last_trained, batch.response_lengths - 1)


def outcome_rewards(batch: Batch, values: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` zeros with ``values[i]`` on row ``i``'s :func:`outcome_index` (rows with no response: none)."""
    import torch

    out = torch.zeros_like(batch.response_mask, dtype=_dtype(batch))
    last = outcome_index(batch)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = values[rows].to(out.dtype)
    return out


def token_level_rewards(batch: Batch) -> torch.Tensor:
    """``[B, R]`` rewards per token: ``batch.token_rewards`` if set, else the scalar reward on the outcome token
    (:func:`outcome_index`: the last response token, as verl, unless that one has mask 0)."""
    if batch.token_rewards is not None:
        return batch.token_rewards
    return outcome_rewards(batch, batch.rewards)


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: its group's mean, unbiased std and size over the ``valid`` rows (default: all). A group of one
    (or none) has mean 0 and std 1 (verl). FAILED samples are not valid: a failed reward must not move the
    baseline of the others."""
    import torch

    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    s = scores.to(torch.float64)  # the sums below stay exact enough for hand-checked tests
    w = torch.ones_like(s) if valid is None else valid.to(s.dtype)
    count = torch.zeros(n_groups, dtype=s.dtype, device=s.device).scatter_add_(0, inverse, w)
    total = torch.zeros(n_groups, dtype=s.dtype, device=s.device).scatter_add_(0, inverse, s * w)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(n_groups, dtype=s.dtype, device=s.device).scatter_add_(0, inverse, (s - mean[inverse]).square() * w)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    lone = count <= 1
    mean = torch.where(lone, torch.zeros_like(mean), mean)
    std = torch.where(lone, torch.ones_like(std), std)
    return (mean[inverse].to(scores.dtype), std[inverse].to(scores.dtype), count[inverse].to(scores.dtype))


def _per_token(seq_values: torch.Tensor, batch: Batch) -> torch.Tensor:
    return seq_values.unsqueeze(-1) * batch.response_mask


def _valid(batch: Batch) -> torch.Tensor | None:
    return None if batch.failed is None else ~batch.failed


def grpo(batch: Batch, epsilon: float = 1e-6, norm_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(s - mean_g) / (std_g + epsilon)``; with ``norm_by_std = false`` just ``s - mean_g`` (Dr. GRPO,
    https://arxiv.org/abs/2503.20783). verl: ``compute_grpo_outcome_advantage``."""
    scores = token_level_rewards(batch).sum(-1)
    mean, std, _ = group_stats(scores, batch.group_ids, _valid(batch))
    adv = (scores - mean) / (std + epsilon) if norm_by_std else scores - mean
    adv = _per_token(adv, batch)
    return adv, adv


def rloo(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (https://arxiv.org/abs/2402.14740): ``s_i - mean of the other samples of the group``
    ``= (s_i - mean_g) * n / (n - 1)``; a lone sample keeps its score (verl)."""
    import torch

    scores = token_level_rewards(batch).sum(-1)
    mean, _, n = group_stats(scores, batch.group_ids, _valid(batch))
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    adv = _per_token(adv, batch)
    return adv, adv


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over the mask-1 tokens. A mask-0 token (an observation span inside a
    multi-turn response, or padding) passes the running return through unchanged and stores 0 (verl #7278 /
    #7300): earlier turns keep the outcome reward, the discount counts the model's tokens only, and a reward on a
    mask-0 token is not trained on (like GAE below). Trailing padding stays 0: the scan starts at 0 there."""
    import torch

    keep = mask > 0
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(keep[:, t], running, 0.0)
    return returns


def reinforce_pp(batch: Batch, gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262): discounted returns whitened over the whole batch."""
    mask = batch.response_mask
    returns = discounted_returns(token_level_rewards(batch), mask, gamma)
    adv = masked_whiten(returns, mask) * mask
    return adv, returns


def reinforce_pp_baseline(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch (verl:
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``)."""
    mask = batch.response_mask
    scores = token_level_rewards(batch).sum(-1)
    mean, _, _ = group_stats(scores, batch.group_ids, _valid(batch))
    adv = masked_whiten(_per_token(scores - mean, batch), mask) * mask
    return adv, adv


def gae(batch: Batch, gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with a critic (https://arxiv.org/abs/1506.02438): ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = delta_t + gamma lam A_{t+1}``, masked tokens skipped (an observation span carries ``V_{t+1}`` and the
    running GAE through unchanged, as :func:`discounted_returns` does the return; its own value and TD error do not
    propagate and it holds 0),
    ``returns = A + V``, then ``A`` whitened over the batch (verl: ``compute_gae_advantage_return``)."""
    import torch

    if batch.values is None:
        raise ValueError("the gae estimator needs batch.values (a critic)")
    rewards = token_level_rewards(batch)
    values = batch.values.to(rewards.dtype)
    mask = batch.response_mask.to(rewards.dtype)
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    adv = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_gae = delta + gamma * lam * last_gae
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last_gae = new_gae * m + (1 - m) * last_gae
        adv[:, t] = last_gae
    returns = adv + values
    return masked_whiten(adv, mask) * mask, returns * mask


def distill(batch: Batch, coef: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: the per-token advantage is the negative reverse-KL estimate
    ``coef * (log pi_teacher - log pi_student)`` on the student's own samples (discount 0), where the student's
    logprobs are ``batch.old_logprobs`` if computed, else the rollout engine's."""
    if batch.teacher_logprobs is None:
        raise ValueError("the distill estimator needs batch.teacher_logprobs (a teacher)")
    student = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    if student is None:
        raise ValueError("the distill estimator needs the student's logprobs (old or rollout)")
    adv = coef * (batch.teacher_logprobs - student).detach() * batch.response_mask
    return adv, adv


def none(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """No advantage (zeros): for losses that ignore it, such as SFT."""
    import torch

    zeros = torch.zeros_like(batch.response_mask, dtype=_dtype(batch))
    return zeros, zeros
