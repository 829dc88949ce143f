"""Samples to padded tensors and back, without re-tokenising anything.

Layout of a :class:`Batch` of ``B`` samples with prompt width ``P`` and response width ``R`` (``T = P + R``)::

    input_ids[i]     = [pad] * (P - p_i) + prompt_i + response_i + [pad] * (R - r_i)
    attention_mask   = 1 on the prompt and response tokens, 0 on padding
    position_ids     = cumsum(attention_mask) - 1 (0 on left padding), so left padding changes no position
    response_mask[i] = the sample's loss mask on its r_i response tokens; all 0 for a FAILED sample

Per-token tensors over the response are ``[B, R]`` and aligned with ``input_ids[:, P:]``: the logits that
predict response token ``j`` sit at position ``P + j - 1`` (see :meth:`Batch.response_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from milehpc.samples import Sample, Status

if TYPE_CHECKING:
    import torch

# Optional [B, R] float tensors that later stages fill in (and that select/split/to carry along).
OPTIONAL_TOKEN_FIELDS = (
    "old_logprobs", "ref_logprobs", "values", "teacher_logprobs", "advantages", "returns", "token_rewards",
)


@dataclass
class Batch:
    """Padded tensors for a list of samples (see the module docstring for the layout)."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    position_ids: torch.Tensor  # [B, T] long
    response_mask: torch.Tensor  # [B, R] float: 1 = this token is trained on
    rollout_logprobs: torch.Tensor | None  # [B, R] float, the engine's logprobs (None if no sample had any)
    rewards: torch.Tensor  # [B] float: Sample.scalar_reward (0 for a FAILED sample)
    group_ids: torch.Tensor  # [B] long
    prompt_lengths: torch.Tensor  # [B] long
    response_lengths: torch.Tensor  # [B] long
    prompt_width: int  # P
    pad_id: int = 0
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # Per-token rewards (process rewards); None = the scalar reward sits on the last response token.
    token_rewards: torch.Tensor | None = None
    # [B] bool: FAILED samples (engine or reward); they train on nothing and join no group statistics.
    failed: torch.Tensor | None = None
    # [B, R, layers, top_k] long, -1 on padding: the experts the engine routed each response token to
    # (MoE routing replay); None when no sample carries them.
    routed_experts: torch.Tensor | None = None
    samples: list[Sample] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def __len__(self) -> int:
        return self.size

    @property
    def response_width(self) -> int:
        return int(self.input_ids.shape[1]) - self.prompt_width

    @property
    def responses(self) -> torch.Tensor:
        """``[B, R]`` response token ids (padded with ``pad_id``)."""
        return self.input_ids[:, self.prompt_width:]

    @property
    def num_tokens(self) -> int:
        """Tokens trained on (the local count to sum over DP ranks for ``global_tokens``)."""
        return int(self.response_mask.sum().item())

    @property
    def num_seqs(self) -> int:
        """Sequences with at least one trained token (verl counts no fully masked row)."""
        return int((self.response_mask.sum(-1) > 0).sum().item())

    def select(self, index: Sequence[int] | torch.Tensor) -> Batch:
        """The rows ``index`` (a list or a 1-D long tensor), every tensor and the samples list alike."""
        import torch

        idx = torch.as_tensor(index, dtype=torch.long)
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = value.index_select(0, idx.to(value.device))
        if self.samples is not None:
            changes["samples"] = [self.samples[i] for i in idx.tolist()]
        return replace(self, **changes)

    def split(self, micro_batch_size: int) -> list[Batch]:
        """Consecutive micro-batches of at most ``micro_batch_size`` rows (same P and R)."""
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1")
        return [self.select(range(s, min(s + micro_batch_size, self.size)))
                for s in range(0, self.size, micro_batch_size)]

    def to(self, device: torch.device | str) -> Batch:
        import torch

        changes = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **changes)

    def response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, R, V]``: the logits that predict each response token, from full-sequence ``[B, T, V]`` logits."""
        p = self.prompt_width
        return logits[:, p - 1 : p - 1 + self.response_width]

    def response_logprobs(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``[B, R]`` logprobs of the response tokens under ``logits`` (``[B, T, V]``), at the sampling
        temperature so they are comparable with the engine's. Padding positions hold garbage; mask them."""
        import torch

        sliced = self.response_logits(logits).float()
        if temperature != 1.0:
            sliced = sliced / temperature
        logp = torch.log_softmax(sliced, dim=-1)
        return logp.gather(-1, self.responses.unsqueeze(-1).clamp(min=0)).squeeze(-1)

    def response_entropy(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``[B, R]`` entropy of the next-token distribution at each response position."""
        import torch

        sliced = self.response_logits(logits).float()
        if temperature != 1.0:
            sliced = sliced / temperature
        logp = torch.log_softmax(sliced, dim=-1)
        return -(logp.exp() * logp).sum(-1)


def to_batch(samples: Sequence[Sample], pad_id: int, *, prompt_width: int | None = None,
             response_width: int | None = None) -> Batch:
    """Pad ``samples`` into a :class:`Batch`. ``prompt_width``/``response_width`` fix P and R (e.g. the
    rollout's ``max_new_tokens``, so that every DP rank gets the same shapes); by default the longest."""
    import torch

    if not samples:
        raise ValueError("to_batch needs at least one sample")
    p_lens = [len(s.prompt_ids) for s in samples]
    r_lens = [len(s.response_ids) for s in samples]
    big_p, big_r = max(p_lens), max(r_lens)
    p_width = big_p if prompt_width is None else prompt_width
    r_width = big_r if response_width is None else response_width
    if p_width < big_p or r_width < big_r:
        raise ValueError(f"to_batch: a sample is longer than the widths given (prompt {big_p} > {p_width} "
                         f"or response {big_r} > {r_width})")
    if p_width < 1:
        raise ValueError("to_batch: every sample needs at least one prompt token")

    any_logprobs = any(s.rollout_logprobs for s in samples)
    # Rows built as Python lists, then one tensor per field: per-sample tensor slices cost ~1000 small ops a step.
    ids_rows, att_rows, mask_rows, lp_rows = [], [], [], []
    for i, s in enumerate(samples):
        p, r = p_lens[i], r_lens[i]
        if len(s.loss_mask) != r:
            raise ValueError(f"sample {s.index}: loss_mask has {len(s.loss_mask)} entries for {r} response tokens")
        pad_r = r_width - r
        ids_rows.append([pad_id] * (p_width - p) + list(s.prompt_ids) + list(s.response_ids) + [pad_id] * pad_r)
        att_rows.append([0] * (p_width - p) + [1] * (p + r) + [0] * pad_r)
        mask_rows.append(([0.0] * r if s.status is Status.FAILED else list(s.loss_mask)) + [0.0] * pad_r)
        if any_logprobs:
            if s.rollout_logprobs and len(s.rollout_logprobs) != r:
                raise ValueError(f"sample {s.index}: {len(s.rollout_logprobs)} rollout logprobs for {r} tokens")
            lp_rows.append((list(s.rollout_logprobs) if s.rollout_logprobs else [0.0] * r) + [0.0] * pad_r)
    input_ids = torch.tensor(ids_rows, dtype=torch.long)
    attention = torch.tensor(att_rows, dtype=torch.long)
    response_mask = torch.tensor(mask_rows, dtype=torch.float32)
    rollout_logprobs = torch.tensor(lp_rows, dtype=torch.float32) if any_logprobs else None
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    routed = _routed_experts(samples, r_width)
    rewards = torch.tensor([0.0 if s.status is Status.FAILED else s.scalar_reward for s in samples],
                           dtype=torch.float32)
    return Batch(
        input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
        response_mask=response_mask, rollout_logprobs=rollout_logprobs, rewards=rewards,
        group_ids=torch.tensor([s.group for s in samples], dtype=torch.long),
        prompt_lengths=torch.tensor(p_lens, dtype=torch.long),
        response_lengths=torch.tensor(r_lens, dtype=torch.long),
        prompt_width=p_width, pad_id=pad_id,
        failed=torch.tensor([s.status is Status.FAILED for s in samples], dtype=torch.bool),
        routed_experts=routed, samples=list(samples),
    )


def _routed_experts(samples: Sequence[Sample], r_width: int) -> torch.Tensor | None:
    import torch

    shapes = {(len(s.routed_experts[0]), len(s.routed_experts[0][0]))
              for s in samples if s.routed_experts and s.routed_experts[0]}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"to_batch: routed_experts of different shapes (layers, top_k): {sorted(shapes)}")
    (layers, top_k), = shapes
    out = torch.full((len(samples), r_width, layers, top_k), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        if s.routed_experts:
            if len(s.routed_experts) != len(s.response_ids):
                raise ValueError(f"sample {s.index}: routed_experts has {len(s.routed_experts)} entries for "
                                 f"{len(s.response_ids)} response tokens")
            out[i, : len(s.routed_experts)] = torch.tensor(s.routed_experts, dtype=torch.long)
    return out


def from_batch(batch: Batch) -> list[Sample]:
    """Samples back from the tensors: token ids, rollout logprobs and loss masks come from the tensors;
    everything else (status, label, text, metadata, ...) from ``batch.samples`` when the batch has them.
    A FAILED sample gets its original loss mask back from its Sample (its response_mask row is all 0)."""
    out = []
    p_width = batch.prompt_width
    ids = batch.input_ids.cpu()
    mask = batch.response_mask.cpu()
    logprobs = batch.rollout_logprobs.cpu() if batch.rollout_logprobs is not None else None
    for i in range(batch.size):
        p, r = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        base = batch.samples[i] if batch.samples is not None else None
        loss_mask = [int(v) for v in mask[i, :r].tolist()]
        if base is not None and base.status is Status.FAILED:
            loss_mask = list(base.loss_mask)
        tokens: dict[str, Any] = dict(
            prompt_ids=ids[i, p_width - p : p_width].tolist(),
            response_ids=ids[i, p_width : p_width + r].tolist(),
            rollout_logprobs=logprobs[i, :r].tolist() if logprobs is not None else [],
            loss_mask=loss_mask,
        )
        if batch.routed_experts is not None and (base is None or base.routed_experts):
            tokens["routed_experts"] = batch.routed_experts[i, :r].tolist()
        if base is not None:
            out.append(replace(base, **tokens))
        else:
            out.append(Sample(reward=float(batch.rewards[i]), group=int(batch.group_ids[i]), **tokens))
    return out
