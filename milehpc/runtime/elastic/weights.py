"""Weights to elastic engines: one gloo group of two (trainer rank 0, the engine) per join, on a fresh prefix of the
store trainer rank 0 hosts, and one broadcast of the whole model packed into a byte buffer (a dropped engine's
group is abandoned with it; nothing else is rebuilt)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure

if TYPE_CHECKING:
    import torch

    from milehpc.weights.converters import NamedTensors

Meta = list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, bytes) in buffer order


def pack(named: NamedTensors) -> tuple[Meta, torch.Tensor]:
    """Every tensor's bytes, one after the other, in one CPU buffer; and how to cut it again."""
    import torch

    meta: Meta = []
    parts = []
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        flat = t.reshape(-1).view(torch.uint8)
        meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), flat.numel()))
        parts.append(flat)
    return meta, (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))


def unpack(meta: Meta, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    import torch

    out, at = [], 0
    for name, dtype, shape, nbytes in meta:
        out.append((name, buf[at:at + nbytes].view(getattr(torch, dtype)).reshape(shape)))
        at += nbytes
    return out


def make_group(store: Any, prefix: str, rank: int, timeout: float) -> Any:
    """The two-member gloo group of one join (rank 0: the trainer); blocks until both joined or ``timeout``."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timedelta(seconds=timeout))


def start_broadcast(pg: Any, buf: torch.Tensor) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([buf], opts)


def wait(work: Any, timeout: float, what: str) -> None:
    """Wait for a broadcast with a deadline (polling: a dead peer must not hold the caller longer)."""
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"{what}: not complete after {timeout:.0f} s")
        time.sleep(0.002)
    try:
        work.wait()
    except RuntimeError as err:
        raise RuntimeFailure(f"{what}: {str(err).splitlines()[0] if str(err) else err!r}") from None
