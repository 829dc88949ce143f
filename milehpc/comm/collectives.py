"""Small collectives the trainers share, with their tensors on the device the backend needs.

NCCL/RCCL only reduce GPU tensors; gloo (CPU CI) reduces either. Code that builds a tensor with ``torch.tensor(...)``
(on the CPU) and all-reduces it therefore passes every CPU test and fails on the first GPU step with DP > 1. The
helpers here put the tensor on :func:`collective_device` of the group; :mod:`milehpc.comm.devcheck` makes the CPU
tests fail when something does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def collective_device(group: Any = None) -> torch.device:
    """The device a collective on ``group`` (None = the default group) needs its tensors on."""
    import torch

    from milehpc.comm import devcheck

    if devcheck.needs_accelerator(group):
        return devcheck.compute_device()
    return torch.device("cpu")


def reduce_floats(values: list[float], op: str = "sum", group: Any = None) -> list[float]:
    """All-reduce a few python floats (sum or max) over ``group``, in float64 on the group's device."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return t.tolist()


def combine_rank_metrics(metrics: dict[str, float], size: int, group: Any = None) -> dict[str, float]:
    """Per-rank metrics of each rank's share of the batch, combined over the ``size`` ranks of ``group``: keys
    ending in ``max`` by their maximum, in ``min`` by their minimum, every other key as the mean over ranks."""
    keys = sorted(metrics)
    if size == 1:
        return {k: float(metrics[k]) for k in keys}
    highs = [k for k in keys if k.endswith("max")]
    lows = [k for k in keys if k.endswith("min")]
    means = [k for k in keys if k not in highs and k not in lows]
    sums = reduce_floats([float(metrics[k]) for k in means], "sum", group)
    # One MAX reduction serves both: the minimum is minus the maximum of the negated values.
    peaks = reduce_floats([float(metrics[k]) for k in highs] + [-float(metrics[k]) for k in lows], "max", group)
    out = {k: v / size for k, v in zip(means, sums, strict=True)}
    out.update(zip(highs, peaks[:len(highs)], strict=True))
    out.update({k: -v for k, v in zip(lows, peaks[len(highs):], strict=True)})
    return out
