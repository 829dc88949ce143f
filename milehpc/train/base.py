"""The trainer protocol every trainer plugin implements (torch/FSDP2 on CPU and GPUs, Megatron-core)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from milehpc.rollout.sample import Sample


class Trainer(Protocol):
    """Lives on the trainer ranks; DP/TP/PP come from the plan's process groups (ctx.comms)."""

    def compute_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-response-token logprobs of the current policy (same code path as the loss)."""

    def train_step(self, samples: list[Sample], step: int) -> dict[str, float]:
        """One RL (or SFT) update on this DP rank's share of the batch; returns metrics (already reduced over DP)."""

    def export_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full (TP-gathered) weights of this rank's pipeline stage, in the engine's naming (converted).
        Called on the weight-sync source rank(s); other ranks may return nothing but must take part in gathers."""

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Everything this rank needs to resume bit-exactly (model, optimizer, scheduler, RNG)."""

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict_for_checkpoint."""

    def offload(self) -> None:
        """Colocated: move weights/optimizer off the GPU (torch_memory_saver)."""

    def onload(self) -> None:
        """Colocated: bring them back."""
