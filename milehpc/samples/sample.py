"""The Sample: token ids in, token ids out. Nothing is ever re-tokenised between engine and trainer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

AGENT_COUNTS = "agent_counts"  # agent generator: an episode's counts (episodes, divergences...) on its first sample
ADAPTER_KEY = "adapter"  # multi-LoRA: the metadata key naming the adapter a prompt (and its samples) belongs to


class Status(str, enum.Enum):
    COMPLETED = "completed"  # stopped on EOS / a stop string
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # cut short (weight update, partial rollout); may be continued
    FAILED = "failed"  # the engine or the reward failed; excluded from the loss, counted in metrics


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    # Per response token, from the engine that sampled it (the behaviour policy).
    rollout_logprobs: list[float] = field(default_factory=list)
    # 1 = trained on; 0 = not (tool/environment output in multi-turn rollouts).
    loss_mask: list[int] = field(default_factory=list)
    reward: float | dict[str, float] | None = None
    status: Status = Status.COMPLETED
    group: int = 0  # samples of the same prompt share a group index
    index: int = 0  # a unique id within the run (prompt cursor * n + sample), for dedup/requeue accounting
    weight_version: int = 0  # policy version that generated (the first token of) this response
    label: Any = None  # the task's reference answer
    prompt_text: str = ""
    response_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # MoE routing replay (R3): per response token, per layer, the expert ids the engine chose.
    routed_experts: list[list[list[int]]] | None = None

    def __post_init__(self) -> None:
        if not self.loss_mask and self.response_ids:
            self.loss_mask = [1] * len(self.response_ids)

    @property
    def scalar_reward(self) -> float:
        """The reward used for advantages: a dict reward contributes its ``"score"`` entry."""
        if self.reward is None:
            return 0.0
        if isinstance(self.reward, dict):
            return float(self.reward.get("score", 0.0))
        return float(self.reward)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        out = asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Status(data.get("status", "completed"))
        return cls(**data)


Group = list[Sample]  # the samples of one prompt: the unit that rewards, filters and group advantages work on


def samples_of(groups: list[Group]) -> list[Sample]:
    """The samples of ``groups``, in order."""
    return [s for g in groups for s in g]
