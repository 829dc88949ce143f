"""The trainer protocol every trainer plugin implements (torch/FSDP2 on CPU and GPUs, Megatron-core)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from milehpc.samples import Sample


class Trainer(Protocol):
    """Lives on the trainer ranks; DP/TP/PP come from the plan's process groups (ctx.comms). Everything the loop,
    the weight sync, the checkpointing and the colocated driver call. Implemented by the torch and Megatron
    trainers."""

    version: int
    """The weight version: optimizer steps taken since RL began (the engines' weights carry it too)."""
    export_is_collective: bool
    """:meth:`export_weights` is a collective over all trainer ranks (TP gathers, FSDP all-gathers): every trainer
    rank calls it at each sync, not only the weight-sync sources."""

    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token logprobs of the current policy (same code path as the loss)."""

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        """One RL (or SFT) update on this DP rank's share of the batch; returns metrics (already reduced over DP)."""

    def export_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full (TP-gathered) weights of this rank's pipeline stage, in the engine's naming (converted).
        Called on the weight-sync source rank(s); other ranks may return nothing but must take part in gathers."""

    def skip_step(self) -> None:
        """A step with nothing to learn from (no rank got samples): advance :attr:`version` all the same, so the
        weight-sync schedule stays the one every rank computed."""

    def sft_optimizer(self, lr: float) -> Any:
        """The optimizer of the supervised warm-up (opaque to the loop; handed back to :meth:`sft_step`)."""

    def sft_step(self, samples: list[Sample], optimizer: Any) -> dict[str, float]:
        """One supervised step on labelled samples (every response token trained on); returns ``sft/*`` metrics."""

    def freeze_reference(self) -> None:
        """Snapshot the policy as the KL reference when RL begins (after any warm-up); no-op without one."""

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Everything this rank needs to resume bit-exactly (model, optimizer, scheduler, and RNG that belongs to
        the trainer's layout, e.g. Megatron's TP-rank streams); the process RNG is the checkpoint's own."""

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict_for_checkpoint. ``state["resharded"]`` is set when it was written at another rank
        layout (only for trainers whose plugin says ``can_reshard``). Colocated GPU runs pause the trainer's memory
        from outside (milehpc.runtime.offload): a trainer needs no offload methods of its own."""

