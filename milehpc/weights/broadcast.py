"""Weight sync from the trainer to the rollout engines: named tensors in buckets over a weight-sync group.

Protocol (one call on the source and every rollout rank of a ``WeightSyncGroup``), streamed: the source never
holds more than the tensor in hand, a bucket's bytes in flight and its two bucket buffers, so a sync's extra memory
is O(bucket), not O(pipeline stage) (issue 33: a trainer that gathered its whole stage first needed 235 GB on one GPU
for a 235B MoE at pp=2; slime gathers and sends bucket by bucket too):

1. over MPI the opening header (kind, version); then per bucket, as it fills, its header (per tensor its name,
   dtype, shape and byte offset); after the last one an end mark;
2. each bucket's bytes by broadcast on the group's torch backend (NCCL/RCCL on GPUs, gloo on CPU). Small
   tensors of any dtype are copied, as bytes, into one flat ``uint8`` bucket as they arrive (each at a 64-byte
   aligned offset so the receiver can view it back as its dtype without copying) of at most ``bucket_bytes``
   (default 512 MiB); a tensor of at least ``min(bucket_bytes, 1 MiB)`` is sent on its own, zero-copy (packing it
   would only add a copy: bench/weight_sync.py). The source fills bucket k+1 (and produces its tensors: gathers,
   conversions) while bucket k is on the wire, and keeps broadcasts in flight up to ``bucket_bytes`` of them; the
   receiver posts every bucket it has a place for before handing the tensors of the first to the engine: a
   tensor sent on its own goes straight into the engine's parameter when the engine says where
   (:meth:`WeightStream.receive_into`: no receive buffer, no copy-out), the others into two byte buffers. Issue 33
   at Qwen2.5-0.5B's shape on a loaded 2-core CPU: the fresh receive buffer's page faults and the engine's copy
   out of it, then one wake-up of both ends per tensor (290 of them), took the sync from 1.0 to 0.4-0.5 of a flat
   broadcast of the same bytes. Both sides reuse the two byte buffers within a sync and release them after it:
   held between syncs they kept the largest tensor's bytes (an embedding: 544 MB at Qwen2.5-0.5B's shape) on
   every rollout rank through generation, which the memory estimate does not give them.

A converter (plugin kind ``converter``) maps trainer names/layout to the engine's first (identity when the formats
agree). Colocated runs skip all of this and load the trainer's tensors into the engine in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
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
    """What goes first: the kind of sync and the version; the buckets follow, each with its :class:`BucketHeader`."""

    kind: str  # "update" | "check"
    version: int


@dataclass(frozen=True)
class BucketHeader:
    """One bucket's layout, sent just before its bytes: what the receiver needs to allocate and name them."""

    bucket: Bucket
    metas: tuple[TensorMeta, ...]  # of the bucket's tensors, in bucket order


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeFailure(f"weight sync: unknown dtype {name!r}")
    return dtype


class BucketLayout:
    """The bucketing rule, one tensor at a time (both the streamed send and :func:`plan_buckets` use it): a tensor
    of at least ``min(bucket_bytes, direct_bytes)`` is a bucket of its own; smaller ones go at 64-byte aligned
    offsets into the open bucket, which closes when the next one would not fit."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, direct_bytes: int | None = None) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.direct = min(bucket_bytes, DIRECT_BYTES if direct_bytes is None else direct_bytes)
        self.used = 0  # bytes of the open bucket
        self.open = 0  # tensors in the open bucket
        self.seen: set[str] = set()

    def place(self, name: str, nbytes: int) -> tuple[bool, bool, int]:
        """Where tensor ``name`` of ``nbytes`` goes: (its own bucket, the open bucket must close first, its offset
        in the open bucket)."""
        if name in self.seen:
            raise ValueError(f"weight sync: tensor name {name!r} appears twice")
        self.seen.add(name)
        if nbytes >= self.direct:
            return True, False, 0
        offset = -(-self.used // ALIGN) * ALIGN
        close = self.open > 0 and offset + nbytes > self.bucket_bytes
        if close:
            offset = 0
            self.open = 0
        self.used = offset + nbytes
        self.open += 1
        return False, close, offset

    def close(self) -> int:
        """Close the open bucket; returns its bytes (0: it was empty)."""
        used = self.used if self.open else 0
        self.used = self.open = 0
        return used


def _meta(name: str, tensor: Any, bucket: int, offset: int) -> TensorMeta:
    return TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                      tensor.numel() * tensor.element_size(), bucket, offset)


def plan_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 direct_bytes: int | None = None) -> tuple[list[TensorMeta], list[Bucket]]:
    """Lay tensors out in buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own), as the
    streamed send does (a paper model of a sync: :mod:`milehpc.weights.cost`)."""
    layout = BucketLayout(bucket_bytes, direct_bytes)
    metas: list[TensorMeta] = []
    buckets: list[Bucket] = []
    current: list[int] = []

    def close(used: int) -> None:
        if current:
            buckets.append(Bucket(len(buckets), used, False, tuple(current)))
            for i in current:
                metas[i] = replace(metas[i], bucket=buckets[-1].index)
            current.clear()

    for i, (name, tensor) in enumerate(named):
        used = layout.used
        direct, closing, offset = layout.place(name, tensor.numel() * tensor.element_size())
        if direct:
            metas.append(_meta(name, tensor, len(buckets), 0))
            buckets.append(Bucket(len(buckets), metas[-1].nbytes, True, (i,)))
            continue
        if closing:
            close(used)
        metas.append(_meta(name, tensor, -1, offset))
        current.append(i)
    close(layout.close())
    return metas, buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _buffer(group: WeightSyncGroup, slot: int, nbytes: int, *, keep: int = 0, cap: int | None = None,
            ) -> torch.Tensor:
    """Byte buffer ``slot`` (0 or 1) of the group, reused across the buckets of a sync (released after it). Grows to
    the largest bucket seen (doubling up to ``cap`` while a bucket fills, its first ``keep`` bytes kept)."""
    import torch

    while len(group.buffers) <= slot:
        group.buffers.append(torch.empty(0, dtype=torch.uint8, device=group.device))
    old = group.buffers[slot]
    if old.numel() < nbytes:
        size = max(nbytes, min(2 * old.numel(), cap or nbytes))
        group.buffers[slot] = torch.empty(size, dtype=torch.uint8, device=group.device)
        keep = min(keep, old.numel())  # beyond: alignment padding
        if keep:
            group.buffers[slot][:keep].copy_(old[:keep])
    return group.buffers[slot][:nbytes]


def _unpack(header: BucketHeader, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for meta in header.metas:
        part = buf[meta.offset:meta.offset + meta.nbytes]
        yield meta.name, part.view(_dtype(meta.dtype)).view(meta.shape)


# ---- sending / receiving ------------------------------------------------------
@dataclass
class SyncStats:
    version: int
    tensors: int
    buckets: int
    nbytes: int
    seconds: float


class _StreamSender:
    """The source's half of one streamed sync (see the module docstring). Broadcasts stay in flight, oldest waited
    for first, while their bytes fit in ``window`` (one is always allowed): waiting for each before starting the
    next cost both ends a wake-up per tensor, which on a loaded CPU was half of a sync of the 0.5B model's 290
    tensors (issue 33); the extra memory is at most ``window`` of a lazy export's tensors. A packed bucket fills a
    buffer slot only once the broadcast last sent from that slot is over (:meth:`free`)."""

    def __init__(self, group: WeightSyncGroup, timeout: float | None, window: int) -> None:
        self.group, self.timeout, self.window = group, timeout, window
        # (work, bucket index, bytes kept alive, buffer slot or None), oldest first
        self.in_flight: deque[tuple[Any, int, torch.Tensor, int | None]] = deque()
        self.flying = 0  # bytes in flight
        self.buckets = self.nbytes = 0
        self.slot = 0  # the buffer the open packed bucket fills

    def send(self, direct: bool, metas: list[TensorMeta], data: torch.Tensor, slot: int | None = None) -> None:
        group = self.group
        index = self.buckets
        nbytes = int(data.numel())
        bucket = Bucket(index, nbytes, direct, tuple(range(len(metas))))
        header = BucketHeader(bucket, tuple(replace(m, bucket=index) for m in metas))
        group.comms.bcast(header, group.source, group.ranks, what=f"{_what(group, index)} metadata",
                          timeout=self.timeout)  # first: the receivers post their receive early
        while self.in_flight and self.flying + nbytes > self.window:
            self._finish_oldest()
        self.in_flight.append((group.broadcast(data), index, data, slot))
        self.flying += nbytes
        self.buckets += 1
        self.nbytes += nbytes

    def free(self, slot: int) -> None:
        """Wait until no broadcast in flight reads buffer ``slot``."""
        while any(entry[3] == slot for entry in self.in_flight):
            self._finish_oldest()

    def finish(self) -> None:
        while self.in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, index, data, _ = self.in_flight.popleft()
        self.flying -= int(data.numel())
        self.group.wait(work, _what(self.group, index), self.timeout)


def send_weights(group: WeightSyncGroup, named_tensors: NamedTensors, version: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, converter: Converter | None = None,
                 kind: str = "update", direct_bytes: int | None = None, timeout: float | None = None) -> SyncStats:
    """Source side: send ``named_tensors`` (after ``converter``) to every rollout rank of ``group``, streamed: an
    iterator is consumed one tensor at a time (a lazy export gathers each tensor just before it is sent) and no
    tensor is referenced after it went into a bucket or onto the wire."""
    import time

    if not group.is_source:
        raise ValueError(f"rank {group.rank} is not the source of weight-sync group {group.stage}")
    if kind == "update" and version < group.version:
        raise ValueError(f"weight version went backwards: {version} after {group.version}")
    start = time.perf_counter()
    comms = group.comms
    comms.bcast(SyncHeader(kind, version), group.source, group.ranks,
                what=f"weight sync (stage {group.stage}) metadata", timeout=timeout)
    maybe_fail("broadcast", version)  # the receivers have the header and wait for the buckets
    layout = BucketLayout(bucket_bytes, direct_bytes)
    out = _StreamSender(group, timeout, bucket_bytes)
    packed: list[TensorMeta] = []  # of the open bucket, copied into buffer out.slot as they came
    tensors = 0

    def close(used: int) -> None:
        if packed:
            out.send(False, list(packed), group.buffers[out.slot][:used], out.slot)
            packed.clear()
            out.slot ^= 1  # the bucket just sent is in flight from this slot: fill the other

    for name, tensor in (converter(named_tensors) if converter else named_tensors):
        tensors += 1
        nbytes = tensor.numel() * tensor.element_size()
        used = layout.used
        direct, closing, offset = layout.place(name, nbytes)
        meta = _meta(name, tensor, -1, offset)
        if direct:  # zero-copy: the tensor's own bytes (on the group's device)
            out.send(True, [meta], _as_bytes(tensor.to(group.device)))
            continue
        if closing:
            close(used)
        if not packed:  # a new packed bucket: its slot's last broadcast must be over
            out.free(out.slot)
        buf = _buffer(group, out.slot, offset + nbytes, keep=offset, cap=bucket_bytes)
        if nbytes:
            buf[offset:offset + nbytes].copy_(_as_bytes(tensor), non_blocking=True)
        packed.append(meta)
    close(layout.close())
    comms.bcast(None, group.source, group.ranks, what=f"weight sync (stage {group.stage}) end", timeout=timeout)
    out.finish()
    group.buffers.clear()
    if kind == "update":
        group.version = version
    return SyncStats(version, tensors, out.buckets, out.nbytes, time.perf_counter() - start)


def _what(group: WeightSyncGroup, index: int) -> str:
    return f"weight sync (stage {group.stage}) bucket {index + 1}"


# Where the receiver puts a tensor sent on its own: (name, dtype, shape) -> the engine's own storage for it, or None.
Placement = Callable[[str, "torch.dtype", tuple[int, ...]], "torch.Tensor | None"]


class WeightStream:
    """Rollout side: the header is already received; iterating receives the buckets and yields (name, tensor).

    The tensors are views of the group's two reused receive buffers (no copy, bounded memory): load (copy) each
    one before asking for the next, as ``Engine.update_weights`` does; ``recv_weights`` returns copies. An engine
    that can take a tensor where it keeps it calls :meth:`receive_into` first: a tensor sent on its own (most of
    the bytes) is then received straight into that storage and yielded as it (no receive buffer, no copy-out).
    Iterate to the end exactly once (``drain`` finishes an abandoned stream so the group stays in step).
    """

    def __init__(self, group: WeightSyncGroup, header: SyncHeader, timeout: float | None) -> None:
        self.group = group
        self.header = header
        self.version = header.version
        self.timeout = timeout
        self.place: Placement | None = None
        self.in_place_bytes = 0  # received straight into the engine's storage (the rest went through the buffers)
        self.buckets_seen = 0
        self._iter = self._receive()
        self.done = False

    def receive_into(self, place: Placement) -> None:
        """Receive each tensor sent on its own into ``place(name, dtype, shape)`` when that returns a contiguous
        tensor of that dtype and shape on the group's device (the engine's parameter; None: the receive buffer).
        An update only: a check sync compares what arrives, it must not overwrite the engine's weights."""
        if self.header.kind == "update":
            self.place = place

    def _destination(self, header: BucketHeader) -> torch.Tensor | None:
        if self.place is None or not header.bucket.direct:
            return None
        (meta,) = header.metas
        dest = self.place(meta.name, _dtype(meta.dtype), meta.shape)
        if (dest is None or dest.dtype != _dtype(meta.dtype) or tuple(dest.shape) != meta.shape
                or not dest.is_contiguous() or dest.device != self.group.device):
            return None  # (a non-contiguous view would be received into a copy and lost)
        return dest

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iter

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Posts every bucket whose header has come (the source sends each header before it waits for older
        broadcasts, so this never waits for it in a cycle) as long as it has somewhere to land: in place, or in
        one of the two receive buffers that neither a posted bucket nor the bucket the engine is reading holds."""
        group = self.group
        posted: deque[tuple[Any, torch.Tensor, BucketHeader, int | None]] = deque()  # (work, bytes, header, slot)
        held: set[int] = set()  # buffer slots of posted buckets and of the one being read
        waiting: list[BucketHeader] = []  # a header whose bucket waits for a free buffer
        ended = False

        def post_more() -> None:
            nonlocal ended
            while not ended:
                if waiting:
                    header: BucketHeader | None = waiting.pop()
                else:
                    header = group.comms.bcast(None, group.source, group.ranks, timeout=self.timeout,
                                               what=f"{_what(group, self.buckets_seen)} metadata")
                    if header is None:  # the end mark
                        ended = True
                        return
                    self.buckets_seen += 1
                dest = self._destination(header)
                if dest is not None:  # straight into the engine's storage
                    self.in_place_bytes += header.bucket.nbytes
                    posted.append((group.broadcast(_as_bytes(dest)), dest, header, None))
                    continue
                free = [slot for slot in (0, 1) if slot not in held]
                if not free:
                    waiting.append(header)
                    return
                held.add(free[0])
                buf = _buffer(group, free[0], header.bucket.nbytes)
                posted.append((group.broadcast(buf), buf, header, free[0]))
                if posted[0][3] is not None and len(posted) > 1:
                    return  # the engine's next bucket is a buffered one: hand it over before posting further

        post_more()
        while posted:
            work, got, header, slot = posted.popleft()
            group.wait(work, _what(group, header.bucket.index), self.timeout)
            post_more()  # receive the next buckets while the engine loads this one
            if slot is None:
                yield header.metas[0].name, got  # the engine's own tensor, already holding the new values
            else:
                yield from _unpack(header, got)
                held.discard(slot)
                if not posted:
                    post_more()
        group.buffers.clear()  # the engine has copied every tensor out
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
