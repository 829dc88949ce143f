"""The rollout side's metrics of multi-LoRA (``[trainer.lora.adapters.NAME]``): each adapter's prompts come from its
own stream (:class:`milehpc.data.adapters.AdapterMix`), are generated with that adapter (``SamplingParams.adapters``,
one engine call for all of them), scored with that adapter's reward (:func:`milehpc.rewards.routing.adapter_scorer`),
and counted here into ``adapter/<NAME>/*``."""

from __future__ import annotations

from milehpc.samples import ADAPTER_KEY, Sample, Status


def count_by_adapter(group: list[Sample], stats: dict[str, float]) -> None:
    """Raw per-adapter counters of a finished group (summed over engines like the others)."""
    for s in group:
        key = f"adapter/{s.metadata.get(ADAPTER_KEY)}"
        stats[f"{key}/samples"] = stats.get(f"{key}/samples", 0.0) + 1
        if s.status is not Status.FAILED:
            stats[f"{key}/reward_sum"] = stats.get(f"{key}/reward_sum", 0.0) + s.scalar_reward
            stats[f"{key}/scored"] = stats.get(f"{key}/scored", 0.0) + 1


def adapter_metrics(stats: dict[str, float]) -> dict[str, float]:
    """``adapter/<NAME>/reward_mean`` and ``adapter/<NAME>/samples`` from the raw counters."""
    out = {}
    for key, value in stats.items():
        if key.startswith("adapter/") and key.endswith("/samples"):
            prefix = key.removesuffix("/samples")
            out[key] = value
            out[f"{prefix}/reward_mean"] = stats.get(f"{prefix}/reward_sum", 0.0) / max(
                stats.get(f"{prefix}/scored", 0.0), 1.0)
    return out
