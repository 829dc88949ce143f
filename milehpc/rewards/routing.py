"""Per-sample reward routing by data source (``reward.by_source``): a mixed dataset (verl's and slime's carry a
``data_source`` column, e.g. math and code problems) scores each sample with its source's reward; samples of other
sources (or none) get the job's ``reward.name`` (or the task's own reward). Multi-LoRA
(``[trainer.lora.adapters.NAME]``): each sample with its adapter's reward (:func:`adapter_scorer`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError
from milehpc.rewards.api import RewardRunner
from milehpc.samples import ADAPTER_KEY, Sample

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec, RewardSpec


def source_of(sample: Sample) -> str | None:
    value = sample.metadata.get("data_source")
    return None if value is None else str(value)


@dataclass
class SourceRouter:
    """Scores each sample with its data source's runner, the rest with ``default``."""

    routes: dict[str, RewardRunner]
    default: RewardRunner | None

    def runner_for(self, sample: Sample) -> RewardRunner | None:
        return self.routes.get(source_of(sample) or "", self.default)

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Every sample scored by its route (group rewards see whole groups: a group shares its prompt's source);
        returns the count-weighted metrics."""
        by_runner: dict[int, tuple[RewardRunner, list[Sample]]] = {}
        for s in samples:
            runner = self.runner_for(s)
            if runner is None:  # check_sources refuses such data at the start; a generator may still make one
                raise ConfigError(f"no reward for data_source {source_of(s)!r}: expected it in reward.by_source or a "
                                  "reward.name", field="reward.by_source")
            by_runner.setdefault(id(runner), (runner, []))[1].append(s)
        totals: dict[str, float] = {}
        for runner, part in by_runner.values():
            for key, value in runner.score(part).items():
                weight = 1.0 if key in ("reward/count", "reward/failed", "reward/skipped") else len(part) / len(samples)
                totals[key] = totals.get(key, 0.0) + weight * value
        return totals

    def check_sources(self, sources: Collection[str], *, file: str | None = None) -> None:
        """Every data source of the prompts has a reward (one line naming the first that has none)."""
        if self.default is None:
            missing = sorted(set(sources) - set(self.routes))
            if missing:
                raise ConfigError(f"data_source '{missing[0]}' has no reward: expected it in reward.by_source "
                                  f"({', '.join(sorted(self.routes))}) or a reward.name", file=file,
                                  field="reward.by_source")


def reward_scorer(reward_spec: RewardSpec, task_reward: str | None, *, sources: Collection[str] = (),
                  file: str | None = None) -> RewardRunner | SourceRouter:
    """The job's scorer: one :class:`RewardRunner`, or a :class:`SourceRouter` when ``reward.by_source`` is set
    (``sources``: the data sources the prompts carry, checked to all have a reward)."""
    from milehpc.config.job import reward_route

    if not reward_spec.by_source:
        return RewardRunner.from_spec(reward_spec, task_reward, file=file)
    routes = {}
    for source, route in reward_spec.by_source.items():
        name, params = reward_route(route)
        spec = replace(reward_spec, name=name, params=dict(params or {}), by_source={})
        routes[source] = _runner(spec, file, f"reward.by_source.{source}")
    default = (RewardRunner.from_spec(reward_spec, task_reward, file=file)
               if reward_spec.name or task_reward else None)
    router = SourceRouter(routes, default)
    router.check_sources(sources, file=file)
    return router


def _runner(spec: Any, file: str | None, where: str) -> RewardRunner:
    from milehpc.errors import MilehpcError

    try:
        return RewardRunner.from_spec(spec, file=file)
    except MilehpcError as err:  # the route's own field (reward.name, reward.params.x) re-rooted under its entry
        inner = err.field.replace("reward.", f"{where}.", 1) if err.field else where
        raise type(err)(err.message, file=file, field=inner) from None


@dataclass
class AdapterRouter(SourceRouter):
    """Scores each sample with its adapter's reward runner (multi-LoRA)."""

    def runner_for(self, sample: Sample) -> RewardRunner | None:
        return self.routes.get(str(sample.metadata.get(ADAPTER_KEY)), self.default)


def adapter_scorer(job: JobSpec, *, file: str | None = None) -> AdapterRouter:
    """Each adapter's reward: its ``reward`` (a name or {name, params}), else its task's own, else ``reward.name``
    (with ``reward.params``); timeouts and concurrency as ``[reward]``."""
    from milehpc import plugins
    from milehpc.config.job import reward_route

    spec = job.trainer.lora
    assert spec is not None
    routes = {}
    for name, adapter in spec.adapters.items():
        if adapter.reward != "":
            reward, params = reward_route(adapter.reward)
            reward_spec = replace(job.reward, name=reward, params=dict(params or {}), by_source={})
            routes[name] = RewardRunner.from_spec(reward_spec, file=file)
        else:
            task = (plugins.lookup("task", adapter.source.removeprefix("task:")).reward
                    if adapter.source.startswith("task:") else "")
            reward_spec = replace(job.reward, name="", params={}, by_source={}) if task else job.reward
            routes[name] = RewardRunner.from_spec(reward_spec, task or None, file=file)
    return AdapterRouter(routes, None)
