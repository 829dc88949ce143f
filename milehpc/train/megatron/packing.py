"""Packed sequences (THD) for the Megatron trainer: a micro-batch's samples laid end to end in one row, no padding.

Why: Megatron's transformer-engine layer spec declares ``AttnMaskType.causal``, and TE applies plain causal attention
without reading any attention mask, so in a left-padded ``[B, T]`` batch real tokens would attend to the pads (issue
12, fault 7). The large RL stacks (slime, Miles) feed packed sequences instead: each sample is a segment of one
``[1, L]`` row, delimited by ``cu_seqlens`` in a ``PackedSeqParams(qkv_format="thd")``, which TE's attention and
Megatron's RoPE honour (causal within a segment, positions restarting per segment).

The local layer spec's attention refuses ``PackedSeqParams``; it runs the same packed row with the equivalent mask
(block-diagonal causal, :func:`block_causal_mask`), so the packing and unpacking code is the same on both paths and
is tested on the CPU against the padded layout.

``L`` is fixed per optimizer step (the longest micro-batch, rounded up): pipeline stages exchange fixed shapes. The
unused tail is one more segment of pad tokens whose outputs are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ALIGN = 8  # packed length multiple (tensor-core friendly; segments themselves are not padded)


@dataclass
class Packed:
    """One micro-batch, packed. ``index[b, t]`` is the packed position of padded position ``(b, t)`` (for pads:
    the first position of the tail, whose output is never used)."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], restarting at 0 in every segment
    cu_seqlens: torch.Tensor  # int32 [segments + 1], the tail segment included when L > tokens
    index: torch.Tensor  # long [B, T]
    rows: torch.Tensor  # long [tokens]: the padded row of each packed position (tail excluded)
    cols: torch.Tensor  # long [tokens]: the padded column of each packed position
    max_seqlen: int
    length: int


def packed_length(valid: torch.Tensor) -> int:
    """The packed length of a micro-batch (its real tokens, rounded up to :data:`ALIGN`)."""
    n = int(valid.sum())
    return -(-n // ALIGN) * ALIGN


def pack(input_ids: torch.Tensor, valid: torch.Tensor, *, length: int | None = None, pad_id: int = 0) -> Packed:
    """Pack the real tokens (``valid`` = 1) of each row of ``input_ids`` [B, T] into one row of ``length`` (default
    :func:`packed_length`)."""
    import torch

    mask = valid.bool()
    lengths = mask.sum(1)
    tokens = int(lengths.sum())
    length = packed_length(valid) if length is None else int(length)
    if length < tokens:
        raise ValueError(f"packed length {length} < {tokens} tokens in the micro-batch")
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: each row's tokens in order
    ids = torch.full((1, length), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[0, :tokens] = input_ids[rows, cols]
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(length, device=input_ids.device)
    pos[:tokens] = pos[:tokens] - starts[rows]
    pos[tokens:] -= tokens
    bounds = [0, *torch.cumsum(lengths, 0).tolist()]
    if length > tokens:
        bounds.append(length)
    cu = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    index = torch.full(mask.shape, min(tokens, length - 1), dtype=torch.long, device=input_ids.device)
    index[rows, cols] = torch.arange(tokens, device=input_ids.device)
    seg = cu[1:] - cu[:-1]
    return Packed(ids, pos[None], cu, index, rows, cols, int(seg.max()) if len(seg) else 0, length)


def unpack(packed_out: torch.Tensor, p: Packed) -> torch.Tensor:
    """``[1, L, ...]`` model output -> ``[B, T, ...]`` in the padded layout (pad positions hold a tail output)."""
    return packed_out[0][p.index]


def block_causal_mask(p: Packed) -> torch.Tensor:
    """The mask TE's THD attention amounts to, in Megatron's local convention: bool [1, 1, L, L], True = masked
    (a query attends to earlier-or-same positions of its own segment)."""
    import torch

    seg = torch.repeat_interleave(torch.arange(len(p.cu_seqlens) - 1, device=p.cu_seqlens.device),
                                  (p.cu_seqlens[1:] - p.cu_seqlens[:-1]).long())
    pos = torch.arange(p.length, device=seg.device)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def thd_params(p: Packed) -> Any:
    """Megatron's ``PackedSeqParams`` for the packed row (what TE's attention and the THD RoPE read)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=p.cu_seqlens, cu_seqlens_kv=p.cu_seqlens,
                           max_seqlen_q=p.max_seqlen, max_seqlen_kv=p.max_seqlen)
