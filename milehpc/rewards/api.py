"""Running the reward a job spec selects: a registered reward plugin by name, or ``module:function``.

Three kinds (``RewardFunction.kind``, or the ``reward_kind`` attribute of a ``module:function`` reward, set with
:func:`reward_kind`): ``sample`` (``fn(sample, **params)``), ``group`` (``fn(samples_of_one_prompt, **params)
-> list``) and ``batch`` (``fn(all_samples, **params) -> list``). A value is a number or a dict of numbers with
a ``"score"`` entry (the scalar used for advantages; the other entries become metrics). ``async def`` rewards
(or ones returning an awaitable) run concurrently, at most ``max_concurrency`` at once, each call bounded by
``timeout_s``.

A reward that raises, times out or returns something that is not a finite number marks the samples it was
scoring FAILED (``metadata["reward_error"]`` says why; counted in ``reward/failed``): the loss then ignores them,
and the run goes on. Samples already FAILED (by the engine) are not scored.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from milehpc.errors import ConfigError, PluginError
from milehpc.samples import Sample, Status

if TYPE_CHECKING:
    from milehpc.config.job import RewardSpec

log = logging.getLogger(__name__)
KINDS = ("sample", "group", "batch")
F = TypeVar("F", bound=Callable[..., Any])


def reward_kind(kind: str) -> Callable[[F], F]:
    """Mark a ``module:function`` reward as a ``group`` or ``batch`` reward (default: ``sample``)."""
    if kind not in KINDS:
        raise ValueError(f"reward kind must be one of {KINDS}, got {kind!r}")

    def mark(fn: F) -> F:
        fn.reward_kind = kind  # type: ignore[attr-defined]
        return fn

    return mark


def _check_value(value: Any) -> float | dict[str, float]:
    if isinstance(value, bool | int | float):
        if not math.isfinite(float(value)):
            raise ValueError(f"reward is not finite: {value!r}")
        return float(value)
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a dict reward needs a 'score' entry, got keys {sorted(value)}")
        return {str(k): float(_check_value(v)) for k, v in value.items()}  # type: ignore[arg-type]
    raise TypeError(f"reward must be a number or a dict of numbers, got {type(value).__name__}")


def _signature_params(fn: Callable[..., Any], params: dict[str, Any], *, name: str, file: str | None) -> None:
    """For ``module:function`` rewards (no declared defaults): the params must be keyword arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    accepted = list(sig.parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
        return
    names = [p.name for p in accepted if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in params:
        if key not in names:
            raise ConfigError(f"unknown parameter of reward '{name}' (expected one of: {', '.join(names) or 'none'})",
                              file=file, field=f"reward.params.{key}")


@dataclass
class RewardRunner:
    """Scores samples with one reward function (see the module docstring)."""

    name: str
    fn: Callable[..., Any]
    kind: str = "sample"
    params: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0
    max_concurrency: int = 64

    @classmethod
    def from_spec(cls, reward_spec: RewardSpec, task_reward: str | None = None, *,
                  file: str | None = None) -> RewardRunner:
        """The reward ``reward_spec.name`` (a registered reward or ``module:function``), or the task's own
        reward ``task_reward`` when the name is empty; ``reward_spec.params`` are validated against it."""
        from milehpc import plugins
        from milehpc.config.schema import check_params
        from milehpc.plugin_types import load_ref

        name = reward_spec.name or task_reward or ""
        common = dict(timeout_s=reward_spec.timeout_s, max_concurrency=reward_spec.max_concurrency)
        if not name:
            raise ConfigError("no reward: name one (a reward plugin or module:function); the data source has "
                              "no reward of its own", file=file, field="reward.name")
        if ":" in name:
            try:
                fn = load_ref(name)
            except (ImportError, AttributeError, ValueError) as err:
                raise PluginError(f"cannot load reward '{name}': {err.__class__.__name__}: {err}",
                                  file=file, field="reward.name") from None
            if not callable(fn):
                raise PluginError(f"reward '{name}' is not callable", file=file, field="reward.name")
            kind = getattr(fn, "reward_kind", "sample")
            if kind not in KINDS:
                raise PluginError(f"reward '{name}' has reward_kind {kind!r} (expected one of: {', '.join(KINDS)})",
                                  file=file, field="reward.name")
            _signature_params(fn, reward_spec.params, name=name, file=file)
            return cls(name, fn, kind, dict(reward_spec.params), **common)
        spec = plugins.lookup("reward", name, file=file, field="reward.name")
        plugins.check_requires(spec, f"reward '{name}'")
        params = check_params(spec, reward_spec.params, file=file, prefix="reward.params")
        kind = getattr(spec, "kind", "sample")
        fn = spec.load()
        validate = getattr(fn, "validate_params", None)
        if validate is not None:  # a reward with structured params checks them now, not at the first step
            validate(params, file=file)
        if kind not in KINDS:
            raise PluginError(f"reward '{name}' is registered with kind {kind!r} (expected one of: "
                              f"{', '.join(KINDS)})", file=file, field="reward.name")
        return cls(name, fn, kind, params, **common)

    # -- running -------------------------------------------------------------------------------------------

    def score(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Set ``sample.reward`` on every sample not already FAILED; returns metrics."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ascore(samples))
        # Called from inside an event loop: run ours in a worker thread.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self.ascore(samples)).result()

    async def ascore(self, samples: Sequence[Sample]) -> dict[str, float]:
        todo = [s for s in samples if s.status is not Status.FAILED]
        results = await self.compute(todo)
        failed, errors = 0, []
        for sample, value in zip(todo, results, strict=True):
            if isinstance(value, BaseException):
                failed += 1
                sample.status = Status.FAILED
                sample.reward = None
                sample.metadata["reward_error"] = f"{type(value).__name__}: {value}"[:500]
                errors.append(sample.metadata["reward_error"])
            else:
                sample.reward = value
        if errors:
            log.warning("reward '%s' failed on %d of %d samples; first: %s", self.name, failed, len(todo), errors[0])
        return self._metrics(todo, failed, skipped=len(samples) - len(todo))

    async def compute(self, samples: Sequence[Sample]) -> list[float | dict[str, float] | BaseException]:
        """One checked value, or the exception, per sample (nothing is set on the samples)."""
        if not samples:
            return []
        sem = asyncio.Semaphore(self.max_concurrency)
        if self.kind == "sample":
            units: list[list[int]] = [[i] for i in range(len(samples))]
        elif self.kind == "group":
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(samples):
                groups.setdefault(s.group, []).append(i)
            units = list(groups.values())
        else:
            units = [list(range(len(samples)))]
        outs = await asyncio.gather(*(self._run_unit([samples[i] for i in unit], sem) for unit in units))
        results: list[Any] = [None] * len(samples)
        for unit, out in zip(units, outs, strict=True):
            for i, value in zip(unit, out, strict=True):
                results[i] = value
        return results

    async def _run_unit(self, unit: list[Sample], sem: asyncio.Semaphore) -> list[Any]:
        try:
            async with sem:
                arg: Any = unit[0] if self.kind == "sample" else unit
                out = self.fn(arg, **self.params)
                if inspect.isawaitable(out):
                    out = await (asyncio.wait_for(out, self.timeout_s) if self.timeout_s else out)
            values = [out] if self.kind == "sample" else list(out)
            if len(values) != len(unit):
                raise ValueError(f"{self.kind} reward returned {len(values)} values for {len(unit)} samples")
        except asyncio.TimeoutError:
            err = TimeoutError(f"reward '{self.name}' took longer than {self.timeout_s} s")
            return [err] * len(unit)
        except Exception as err:  # a user's reward must not kill the run
            return [err] * len(unit)
        checked: list[Any] = []
        for v in values:
            if isinstance(v, Exception):  # a group/batch reward may fail one of its samples this way
                checked.append(v)
                continue
            try:
                checked.append(_check_value(v))
            except (TypeError, ValueError) as err:
                checked.append(err)
        return checked

    @staticmethod
    def _metrics(scored: Sequence[Sample], failed: int, skipped: int) -> dict[str, float]:
        ok = [s for s in scored if s.status is not Status.FAILED]
        metrics = {"reward/count": float(len(ok)), "reward/failed": float(failed), "reward/skipped": float(skipped),
                   "reward/mean": sum(s.scalar_reward for s in ok) / len(ok) if ok else 0.0}
        keys = sorted({k for s in ok if isinstance(s.reward, dict) for k in s.reward if k != "score"})
        for key in keys:
            vals = [s.reward[key] for s in ok if isinstance(s.reward, dict) and key in s.reward]
            metrics[f"reward/{key}"] = sum(vals) / len(vals)
        return metrics


# -- combine: a weighted sum of other rewards ------------------------------------------------------------------

@dataclass
class _Part:
    """One reward of ``combine``: its key in the result, weight, runner and gate (an earlier part's key, or "")."""

    key: str
    weight: float
    runner: RewardRunner
    gate: str = ""


def _components(rewards: list[Any], file: str | None = None) -> list[_Part]:
    from milehpc.config.job import RewardSpec
    from milehpc.errors import MilehpcError

    out: list[_Part] = []
    for i, item in enumerate(rewards):
        where = f"reward.params.rewards[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not set(item) <= {
                "name", "weight", "params", "gate"}:
            raise ConfigError("expected a table with name, and optionally weight, params and gate", file=file,
                              field=where)
        gate = item.get("gate", "")
        if gate and all(gate != p.runner.name for p in out):
            raise ConfigError(f"expected an earlier reward of the list, got {gate!r}", file=file,
                              field=f"{where}.gate")
        weight, params = item.get("weight", 1.0), item.get("params", {})
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(f"expected a number, got {weight!r}", file=file, field=f"{where}.weight")
        if not isinstance(params, dict):
            raise ConfigError(f"expected a table, got {params!r}", file=file, field=f"{where}.params")
        if item["name"] == "combine":
            raise ConfigError("combine cannot contain itself", file=file, field=f"{where}.name")
        try:
            runner = RewardRunner.from_spec(RewardSpec(name=item["name"], params=params), file=None)
        except MilehpcError as err:
            # The component's own field (reward.name, reward.params.x) re-rooted under this entry.
            inner = err.field.replace("reward.", f"{where}.", 1) if err.field else where
            raise type(err)(err.message, file=file, field=inner) from None
        key = item["name"] if all(item["name"] != p.key for p in out) else f"{item['name']}_{i}"
        gate_key = next((p.key for p in out if p.runner.name == gate), "")
        out.append(_Part(key, float(weight), runner, gate_key))
    if not out:
        raise ConfigError("expected at least one reward", file=file, field="reward.params.rewards")
    return out


async def combine(samples: Sequence[Sample], *, rewards: list[Any]) -> list[Any]:
    """A batch reward: ``sum(weight * score)`` of other rewards (each a table ``{name, weight = 1, params = {},
    gate = ""}``), e.g. a format bonus plus a correctness score. A part with a ``gate`` (an earlier part's name) is
    computed only for the samples that part scored above 0 (a judge asked only where the format is right); it
    counts 0 for the others. The result is a dict with the total as ``score`` and each part's score under its name;
    a sample that any part computed for it fails on fails."""
    parts = _components(rewards)
    results: dict[str, list[Any]] = {}
    for part in parts:
        if not part.gate:
            results[part.key] = await part.runner.compute(samples)
            continue
        opened = [i for i, v in enumerate(results[part.gate]) if not isinstance(v, BaseException) and _scalar(v) > 0]
        computed = await part.runner.compute([samples[i] for i in opened])
        gated: list[Any] = [0.0] * len(samples)  # not asked: the gate's own score already says why
        for i, value in zip(opened, computed, strict=True):
            gated[i] = value
        results[part.key] = gated
    out: list[Any] = []
    for i in range(len(samples)):
        values = {p.key: results[p.key][i] for p in parts}
        error = next((v for v in values.values() if isinstance(v, BaseException)), None)
        if error is not None:
            out.append(error)
            continue
        scalars = {name: _scalar(v) for name, v in values.items()}
        total = sum(p.weight * scalars[p.key] for p in parts)
        out.append({"score": total, **scalars})
    return out


def _scalar(value: float | dict[str, float]) -> float:
    return value["score"] if isinstance(value, dict) else value


def _validate_combine(params: dict[str, Any], file: str | None = None) -> None:
    _components(params.get("rewards", []), file)


combine.validate_params = _validate_combine  # type: ignore[attr-defined]
