"""Virtual pipeline stages (``trainer.vpp``, Megatron's interleaved 1F1B): a PP rank holds several model chunks, each
a slice of the layers (chunk ``i`` of PP rank ``r`` holds virtual stage ``i * pp + r``). :class:`Chunks` gives the
trainer's code one object for the list where it treats the model as a whole (train/eval, gradient buffers, state
dicts, parameters); the schedule and the export take the chunks themselves (:attr:`Chunks.parts`).

State dicts: a chunk's keys are local (``decoder.layers.0`` in every chunk), so each is prefixed ``chunk<i>.``; the
dist checkpoint's sharded keys are global (megatron-core numbers a chunk's layers by its virtual stage), so a
checkpoint written with virtual stages holds the same tensors under the same keys as one written without.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Chunks:
    """A PP rank's model chunks (GPT models, or their DDP wrappers), used as one model."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = list(parts)

    def train(self) -> Chunks:
        for p in self.parts:
            p.train()
        return self

    def eval(self) -> Chunks:
        for p in self.parts:
            p.eval()
        return self

    def cuda(self) -> Chunks:
        for p in self.parts:
            p.cuda()
        return self

    def zero_grad_buffer(self) -> None:
        for p in self.parts:
            p.zero_grad_buffer()

    def parameters(self) -> Iterator[Any]:
        for p in self.parts:
            yield from p.parameters()

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        for i, p in enumerate(self.parts):
            for name, param in p.named_parameters():
                yield f"chunk{i}.{name}", param

    def state_dict(self) -> dict[str, Any]:
        return {f"chunk{i}.{k}": v for i, p in enumerate(self.parts) for k, v in p.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        for i, p in enumerate(self.parts):
            prefix = f"chunk{i}."
            p.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)},
                              strict=strict)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, Any]:
        """Every chunk's sharded state dict (global sharded keys), under ``chunk<i>.`` dict keys."""
        out: dict[str, Any] = {}
        for i, p in enumerate(self.parts):
            out.update({f"chunk{i}.{k}": v for k, v in p.sharded_state_dict(prefix=prefix).items()})
        return out


def parts(model: Any) -> list[Any]:
    """The chunks of ``model`` (one for a plain model)."""
    return model.parts if isinstance(model, Chunks) else [model]
