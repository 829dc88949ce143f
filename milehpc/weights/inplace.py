"""Colocated weight loads: the trainer's tensors into the engine on the same rank, no communication. Either directly
(:func:`load_in_place`: the CPU reference engine shares the process's memory), or through a host snapshot
(:class:`HostSnapshot`) when trainer and engine take turns on one GPU: the snapshot is taken at the end of training,
the trainer is paused, and the snapshot is uploaded tensor by tensor into fresh memory outside any paused region for
the engine to read (SGLang: ``update_weights_from_tensor``, CUDA IPC; slime's ``TensorBackuper`` idea). The
choreography around it is :mod:`milehpc.runtime.offload`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from milehpc.weights.converters import Converter, NamedTensors, identity

if TYPE_CHECKING:
    import torch


class WeightSink(Protocol):
    """What takes the weights on a rollout rank: an engine, or the loop's rollout side (which records the
    version)."""

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None: ...


def load_in_place(sink: WeightSink, named_tensors: NamedTensors, version: int, converter: Converter | None = None,
                  ) -> None:
    """Hand the trainer's (converted) tensors to the engine on this rank."""
    sink.update_weights((converter or identity)(named_tensors), version)


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
