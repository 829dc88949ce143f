"""What the loop itself carries across a restart (the engine's and the trainer's own state are added by the sides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from milehpc.samples import Group, Sample


@dataclass
class LoopState:
    """One rank's loop state. Scalars go into the checkpoint's ``.pt`` shard (:meth:`state_dict`); the sample
    buffers into its HDF5 file (:meth:`sample_buffers`). The process RNG is not here: the checkpoint captures it
    once per shard (:mod:`milehpc.checkpoint.rng`)."""

    step: int = 0  # rollout side: next batch to generate; trainer side: next step to train
    weight_version: int = 0  # rollout: weights loaded in the engine; trainer: optimizer steps since RL began
    data: dict[str, Any] = field(default_factory=dict)  # prompt cursor
    carry: list[Sample] = field(default_factory=list)  # partial rollouts: samples of unfinished groups
    ready: list[Group] = field(default_factory=list)  # finished groups beyond a step's need (over-sampling)
    sft_done: bool = False

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weight_version": self.weight_version, "data": dict(self.data),
                "sft_done": self.sft_done}

    def sample_buffers(self) -> dict[str, list[Sample] | list[Group]]:
        return {"carry": self.carry, "ready": self.ready}

    def load_state_dict(self, state: dict[str, Any], buffers: dict[str, Any] | None = None) -> None:
        self.step, self.weight_version = int(state["step"]), int(state["weight_version"])
        self.data = dict(state["data"])
        self.sft_done = bool(state.get("sft_done", False))
        buffers = buffers or {}
        self.carry = list(buffers.get("carry", []))
        self.ready = [list(g) for g in buffers.get("ready", [])]
