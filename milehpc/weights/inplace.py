"""Colocated weight loads: the trainer's tensors into the engine on the same rank, no communication. Either directly
(:func:`load_in_place`: the CPU reference engine shares the process's memory), or through a host snapshot
(:class:`HostSnapshot`) when trainer and engine take turns on one GPU: the snapshot is taken at the end of training,
the trainer is paused, and the snapshot is uploaded tensor by tensor into fresh memory outside any paused region for
the engine to read (SGLang: ``update_weights_from_tensor``, CUDA IPC; slime's ``TensorBackuper`` idea). The
choreography around it is :mod:`milehpc.runtime.offload`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from milehpc.errors import RuntimeFailure
from milehpc.weights.converters import Converter, NamedTensors, identity

if TYPE_CHECKING:
    import torch

    from milehpc.comm.world import Comms


class WeightSink(Protocol):
    """What takes the weights on a rollout rank: an engine, or the loop's rollout side (which records the
    version)."""

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None: ...


def load_in_place(sink: WeightSink, named_tensors: NamedTensors, version: int, converter: Converter | None = None,
                  ) -> None:
    """Hand the trainer's (converted) tensors to the engine on this rank."""
    sink.update_weights((converter or identity)(named_tensors), version)


def whole_model(comms: Comms, named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """Colocated: the whole model on every rank, from what each trainer rank exported. Call on every trainer rank.

    Each colocated rank's engine needs every weight (an SGLang TP scheduler slices its own shard out of the full
    tensor), but a trainer may export a part per rank: Megatron gives each pipeline stage's weights to that stage's
    leader (tp = 0, dp = 0) and nothing to the others, and an engine fed ``[]`` keeps its old weights without a word
    (issue 30, fault 4). As slime's colocated update does (``hf_weight_iterator_direct._get_megatron_full_params``:
    a broadcast from each parameter's source rank, then every rank serializes for its own engine), each tensor is
    broadcast over the trainer group from the lowest rank that exported it, one at a time on the group's device
    (NCCL takes CUDA tensors only), so the extra device memory is one tensor. When every rank already holds every
    name (the torch trainer) nothing is sent. The names come in the same order on every rank (an engine of several
    ranks cuts the stream into the same buckets on each). Iterate to the end on every rank: each step is a
    collective."""
    import torch
    import torch.distributed as dist

    from milehpc.comm.collectives import collective_device

    mine = {name: tensor for name, tensor in named_tensors}
    metas = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in mine.items()]
    ranks = list(comms.plan.trainer_group())
    every = comms.allgather(metas, ranks, what="colocated weight sync: the names each trainer rank exported")
    source: dict[str, tuple[int, str, tuple[int, ...]]] = {}  # name -> (lowest rank with it, dtype, shape)
    for rank, have in zip(ranks, every, strict=True):
        for name, dtype, shape in have:
            first = source.setdefault(name, (rank, dtype, tuple(shape)))
            if first[1:] != (dtype, tuple(shape)):
                raise RuntimeFailure(f"colocated weight sync: {name} is {first[1]}{list(first[2])} on rank {first[0]} "
                                     f"but {dtype}{list(shape)} on rank {rank}")
    if not source:
        raise RuntimeFailure("colocated weight sync: no trainer rank exported any weight")
    if all(len(have) == len(source) for have in every):
        yield from mine.items()  # every rank holds the whole model already
        return
    device = collective_device()
    for name, (src, dtype, shape) in source.items():
        if comms.rank == src:
            tensor = mine[name].to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=ranks.index(src))  # default group = the trainer ranks, in world order
        yield name, tensor


class HostSnapshot:
    """Pinned host copies of the trainer's (engine-named) weights, reused across steps."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.uploaded_bytes = 0  # of the last :meth:`upload`

    def take(self, named_tensors: NamedTensors) -> None:
        """Copy ``named_tensors`` into the host buffers (pinned when CUDA is there; waits for the copies)."""
        import torch

        pin = torch.cuda.is_available()
        for name, tensor in named_tensors:
            buf = self.buffers.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = self.buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                                       pin_memory=pin)
            buf.copy_(tensor, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()

    def upload(self, device: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The snapshot, one tensor at a time onto ``device`` (None: the host buffers themselves)."""
        self.uploaded_bytes = 0
        for name, buf in self.buffers.items():
            self.uploaded_bytes += buf.numel() * buf.element_size()
            yield name, (buf.to(device, non_blocking=True) if device is not None else buf)
