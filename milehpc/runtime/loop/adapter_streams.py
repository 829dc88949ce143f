"""The rollout side of multi-LoRA (``[trainer.lora.adapters.NAME]``): each adapter's prompts come from its own
stream (:class:`milehpc.data.adapters.AdapterMix`), are generated with that adapter (``SamplingParams.adapter``:
the reference engine merges it), scored with that adapter's reward, and counted into ``adapter/<NAME>/*``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from milehpc.data.adapters import ADAPTER_KEY
from milehpc.rewards.routing import SourceRouter
from milehpc.samples import Sample, Status

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.rewards.api import RewardRunner
    from milehpc.rollout.engine import Engine, SamplingParams


@dataclass
class AdapterRouter(SourceRouter):
    """Scores each sample with its adapter's reward runner."""

    def runner_for(self, sample: Sample) -> RewardRunner | None:
        return self.routes.get(str(sample.metadata.get(ADAPTER_KEY)), self.default)


def adapter_scorer(job: JobSpec, *, file: str | None = None) -> AdapterRouter:
    """Each adapter's reward: its ``reward`` (a name or {name, params}), else its task's own, else ``reward.name``
    (with ``reward.params``); timeouts and concurrency as ``[reward]``."""
    from milehpc.config.job import reward_route
    from milehpc.data.source import task_reward_name
    from milehpc.rewards.api import RewardRunner

    spec = job.trainer.lora
    assert spec is not None
    routes = {}
    for name, adapter in spec.adapters.items():
        if adapter.reward != "":
            reward, params = reward_route(adapter.reward)
            reward_spec = replace(job.reward, name=reward, params=dict(params or {}), by_source={})
            routes[name] = RewardRunner.from_spec(reward_spec, file=file)
        else:
            task = task_reward_name(replace(job.data, source=adapter.source))
            reward_spec = replace(job.reward, name="", params={}, by_source={}) if task else job.reward
            routes[name] = RewardRunner.from_spec(reward_spec, task or None, file=file)
    return AdapterRouter(routes, None)


def generate_by_adapter(engine: Engine, prompts: list[Any], sampling: SamplingParams) -> list[Sample]:
    """``engine.generate`` once per adapter, over its prompts and with it applied; each sample's ``group`` is its
    prompt's position in ``prompts`` (as one call over all of them would give)."""
    by_adapter: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_adapter.setdefault(p.metadata[ADAPTER_KEY], []).append(i)
    out: list[Sample] = []
    for name, where in by_adapter.items():
        part = engine.generate([prompts[i].ids for i in where], replace(sampling, adapter=name))
        for s in part:
            s.group = where[s.group]
        out += part
    return out


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
