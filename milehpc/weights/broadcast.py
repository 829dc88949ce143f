"""Weight sync from the trainer to the rollout engines: named tensors in buckets over a weight-sync group.

Protocol (one call on the source and every rollout rank of a ``WeightSyncGroup``):

1. metadata over MPI: version, and per tensor its name, dtype, shape, bucket and byte offset;
2. the bytes by broadcast on the group's torch backend (NCCL/RCCL on GPUs, gloo on CPU), bucket by bucket. Small
   tensors of any dtype are packed, as bytes, into one flat ``uint8`` bucket (each at a 64-byte aligned offset so
   the receiver can view it back as its dtype without copying) of at most ``bucket_bytes`` (default 512 MiB); a
   tensor of at least ``min(bucket_bytes, 1 MiB)`` is sent on its own, zero-copy (packing it would only add a copy:
   bench/weight_sync.py). The source packs bucket k+1 while bucket k is on the wire; the receiver posts bucket k+1
   before handing the tensors of bucket k to the engine. Both sides reuse two byte buffers per group (bounded
   memory, no fresh pages on every sync).

A converter (plugin kind ``converter``) maps trainer names/layout to the engine's first (identity when the formats
agree). Colocated runs skip all of this and load the trainer's tensors into the engine in place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure
from milehpc.faults import maybe_fail
from milehpc.weights.converters import Converter, NamedTensors

if TYPE_CHECKING:
    import torch

    from milehpc.comm.world import WeightSyncGroup

MiB = 1 << 20
DEFAULT_BUCKET_BYTES = 512 * MiB
ALIGN = 64
# Tensors this big are broadcast as themselves (no copy); packing only pays for small ones (latency-bound).
DIRECT_BYTES = 1 * MiB


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    nbytes: int
    bucket: int
    offset: int  # byte offset inside the bucket


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int
    direct: bool  # a single tensor sent as itself (no packing)
    tensors: tuple[int, ...]  # indices into the metadata list


@dataclass(frozen=True)
class SyncHeader:
    """What goes first: everything the receiver needs to allocate and name what follows."""

    kind: str  # "update" | "check"
    version: int
    metas: tuple[TensorMeta, ...]
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeFailure(f"weight sync: unknown dtype {name!r}")
    return dtype


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 direct_bytes: int | None = None) -> tuple[list[TensorMeta], list[Bucket]]:
    """Lay tensors out in buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    direct = min(bucket_bytes, DIRECT_BYTES if direct_bytes is None else direct_bytes)
    metas: list[TensorMeta] = []
    buckets: list[Bucket] = []
    current: list[int] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            index = len(buckets)
            buckets.append(Bucket(index, used, False, tuple(current)))
            for i in current:
                metas[i] = replace(metas[i], bucket=index)
        current, used = [], 0

    seen: set[str] = set()
    for i, (name, tensor) in enumerate(named):
        if name in seen:
            raise ValueError(f"weight sync: tensor name {name!r} appears twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        meta = TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), nbytes, -1, 0)
        if nbytes >= direct:  # big enough to be its own broadcast, sent without a copy
            buckets.append(Bucket(len(buckets), nbytes, True, (i,)))
            metas.append(replace(meta, bucket=buckets[-1].index))
            continue
        offset = -(-used // ALIGN) * ALIGN
        if current and offset + nbytes > bucket_bytes:
            close()
            offset = 0
        metas.append(replace(meta, offset=offset))
        current.append(i)
        used = offset + nbytes
    close()
    return metas, buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _buffer(group: WeightSyncGroup, slot: int, nbytes: int) -> torch.Tensor:
    """Byte buffer ``slot`` (0 or 1) of the group, reused across syncs: fresh memory costs page faults (CPU) or
    allocator churn (GPU) on every sync. Grows to the largest bucket seen; at most two per group."""
    import torch

    while len(group.buffers) <= slot:
        group.buffers.append(torch.empty(0, dtype=torch.uint8, device=group.device))
    if group.buffers[slot].numel() < nbytes:
        group.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    return group.buffers[slot][:nbytes]


def _pack(bucket: Bucket, tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta],
          group: WeightSyncGroup) -> torch.Tensor:
    if bucket.direct:  # zero-copy: the tensor's own bytes
        return _as_bytes(tensors[bucket.tensors[0]].to(group.device))
    buf = _buffer(group, bucket.index % 2, bucket.nbytes)
    for i in bucket.tensors:
        meta = metas[i]
        if meta.nbytes:
            buf[meta.offset:meta.offset + meta.nbytes].copy_(_as_bytes(tensors[i]), non_blocking=True)
    return buf


def _unpack(bucket: Bucket, buf: torch.Tensor, metas: Sequence[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    for i in bucket.tensors:
        meta = metas[i]
        part = buf[meta.offset:meta.offset + meta.nbytes]
        yield meta.name, part.view(_dtype(meta.dtype)).view(meta.shape)


def _recv_buffer(bucket: Bucket, metas: Sequence[TensorMeta], group: WeightSyncGroup) -> torch.Tensor:
    """The (reused) byte buffer a bucket is received into; a direct tensor is viewed back as itself."""
    return _buffer(group, bucket.index % 2, bucket.nbytes)


# ---- sending / receiving ------------------------------------------------------
@dataclass
class SyncStats:
    version: int
    tensors: int
    buckets: int
    nbytes: int
    seconds: float


def send_weights(group: WeightSyncGroup, named_tensors: NamedTensors, version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, converter: Converter | None = None,
                 kind: str = "update", direct_bytes: int | None = None, timeout: float | None = None) -> SyncStats:
    """Source side: send ``named_tensors`` (after ``converter``) to every rollout rank of ``group``."""
    import time

    if not group.is_source:
        raise ValueError(f"rank {group.rank} is not the source of weight-sync group {group.stage}")
    if kind == "update" and version < group.version:
        raise ValueError(f"weight version went backwards: {version} after {group.version}")
    start = time.perf_counter()
    named = list(converter(named_tensors) if converter else named_tensors)
    metas, buckets = plan_buckets(named, bucket_bytes, direct_bytes)
    header = SyncHeader(kind, version, tuple(metas), tuple(buckets))
    comms = group.comms
    comms.bcast(header, group.source, group.ranks, what=f"weight sync (stage {group.stage}) metadata",
                timeout=timeout)
    tensors = [t for _, t in named]
    maybe_fail("broadcast", version)  # the receivers have the header and wait for the buckets
    in_flight: tuple[Any, torch.Tensor, int] | None = None
    for bucket in buckets:
        buf = _pack(bucket, tensors, metas, group)  # overlaps the previous bucket's broadcast
        if in_flight is not None:
            group.wait(in_flight[0], _what(group, in_flight[2], len(buckets)), timeout)
        in_flight = (group.broadcast(buf), buf, bucket.index)
    if in_flight is not None:
        group.wait(in_flight[0], _what(group, in_flight[2], len(buckets)), timeout)
    if kind == "update":
        group.version = version
    return SyncStats(version, len(metas), len(buckets), header.nbytes, time.perf_counter() - start)


def _what(group: WeightSyncGroup, index: int, total: int) -> str:
    return f"weight sync (stage {group.stage}) bucket {index + 1}/{total}"


class WeightStream:
    """Rollout side: the header is already received; iterating receives the buckets and yields (name, tensor).

    The tensors are views of the group's two reused receive buffers (no copy, bounded memory): load (copy) each
    one before asking for the next, as ``Engine.update_weights`` does; ``recv_weights`` returns copies. Iterate to
    the end exactly once (``drain`` finishes an abandoned stream so the group stays in step).
    """

    def __init__(self, group: WeightSyncGroup, header: SyncHeader, timeout: float | None) -> None:
        self.group = group
        self.header = header
        self.version = header.version
        self.timeout = timeout
        self._iter = self._receive()
        self.done = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iter

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        group, metas, buckets = self.group, self.header.metas, self.header.buckets

        def post(bucket: Bucket) -> tuple[Any, torch.Tensor, Bucket]:
            buf = _recv_buffer(bucket, metas, group)
            return group.broadcast(buf), buf, bucket

        nxt = post(buckets[0]) if buckets else None
        while nxt is not None:
            work, buf, bucket = nxt
            group.wait(work, _what(group, bucket.index, len(buckets)), self.timeout)
            # Receive the next bucket into the other buffer while the engine loads this one.
            nxt = post(buckets[bucket.index + 1]) if bucket.index + 1 < len(buckets) else None
            yield from _unpack(bucket, buf, metas)
        if self.header.kind == "update":
            group.version = self.version
        self.done = True

    def drain(self) -> None:
        for _ in self._iter:
            pass


def recv_weights_stream(group: WeightSyncGroup, timeout: float | None = None) -> WeightStream:
    """Rollout side: receive the metadata and return a stream that receives the bytes as it is iterated."""
    if group.is_source:
        raise ValueError(f"rank {group.rank} is the source of weight-sync group {group.stage}, not a receiver")
    header: SyncHeader = group.comms.bcast(None, group.source, group.ranks,
                                           what=f"weight sync (stage {group.stage}) metadata", timeout=timeout)
    if header.kind == "update" and header.version < group.version:
        raise group.comms.fail(f"weight sync (stage {group.stage}): version went backwards: {header.version} "
                               f"after {group.version}")
    return WeightStream(group, header, timeout)


def recv_weights(group: WeightSyncGroup, timeout: float | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """Rollout side: receive one whole update; returns (version, [(name, tensor), ...]) (tensors owned, copied out
    of the receive buffers)."""
    stream = recv_weights_stream(group, timeout)
    return stream.version, [(name, tensor.clone()) for name, tensor in stream]
