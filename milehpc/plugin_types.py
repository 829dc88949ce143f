"""What plugins register: small, import-light dataclasses yielded by the ``milehpc_*`` register hooks.

Implementations are referenced lazily: ``impl`` is either a callable or a ``"module:attribute"`` string, so
that listing plugins on a login node never imports torch or an engine.

A plugin that takes parameters declares them in ``schema``: a dataclass whose fields are made with
:func:`milehpc.config.schema.opt` (type hint, default, ``min``/``max``/``pattern``, ``help``; an optional
``validate(*, file, prefix)`` for checks across parameters), exactly like a table of the job spec. The login node
validates the job's params against it (``submit``/``plan``/``render``/``run``, one-line errors) and
``milehpc plugins show NAME`` prints it. ``defaults`` (every parameter and its default) is derived from the schema;
a plugin without a schema may still give ``defaults`` alone, and then each default's type is its parameter's type.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Ref = Callable[..., Any] | str


def load_ref(ref: Ref) -> Any:
    """Resolve a ``"package.module:attr"`` reference (or return a callable unchanged)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Registered:
    """Common part of everything registered: a unique name (per kind), the implementation, its parameters."""

    name: str
    impl: Ref
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    # Python packages the implementation needs (checked before loading, one clear line if missing).
    requires: tuple[str, ...] = ()
    # The parameters' declared schema (a dataclass of ``opt`` fields, see the module doc); None = ``defaults`` only.
    schema: type | None = None

    def __post_init__(self) -> None:
        if self.schema is not None:
            if not dataclasses.is_dataclass(self.schema):
                raise TypeError(f"{self.name}: schema must be a dataclass, got {self.schema!r}")
            # One truth: the defaults the ranks merge are the schema's own.
            object.__setattr__(self, "defaults", schema_defaults(self.schema))

    def load(self) -> Any:
        return load_ref(self.impl)


def schema_defaults(schema: type) -> dict[str, Any]:
    """Every init field of a schema dataclass with its default (a required field has none and is left out)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        if f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


@dataclass(frozen=True)
class SiteConfig(Registered):
    """A site: ``impl`` is the path of a site TOML file (str or Path) or a callable returning the site dict."""


@dataclass(frozen=True)
class ContainerRuntime(Registered):
    """A container runtime: ``impl(plan, partition, container_spec, run_dir) -> list[str]`` gives the argv prefix
    that wraps each rank's command (e.g. ``apptainer exec --rocm ... image.sif``)."""


@dataclass(frozen=True)
class RewardFunction(Registered):
    """A reward. ``impl(sample, **params) -> float | dict`` (``kind="sample"``), or
    ``impl(samples, **params) -> list`` for ``kind="batch"`` / ``kind="group"`` (a group sees all samples of one
    prompt). ``async def`` implementations are awaited concurrently."""

    kind: str = "sample"  # sample | batch | group


@dataclass(frozen=True)
class AdvantageEstimator(Registered):
    """``impl(batch, **params) -> (advantages, returns)`` over padded [B, T] tensors (see algorithms)."""

    needs_critic: bool = False
    needs_teacher: bool = False


@dataclass(frozen=True)
class PolicyLoss(Registered):
    """``impl(logprobs, old_logprobs, advantages, mask, agg, **params) -> (loss, metrics)``."""


@dataclass(frozen=True)
class RolloutEngine(Registered):
    """``impl(ctx) -> engine``; the engine protocol is in ``milehpc.rollout.engine``.

    ``direct_weight_sync``: on separate rollout ranks the trainer's stage leaders send the weights straight into the
    engine's own update group (:mod:`milehpc.weights.sglang`; the engine implements
    :class:`milehpc.rollout.engine.DirectSyncEngine`) instead of the bucketed broadcast to the rollout rank."""

    direct_weight_sync: bool = False
    # ``None`` or a callable / lazy ``"module:attr"`` reference ``(options, *, file) -> Any`` that validates
    # ``rollout.options`` in full beyond ``defaults`` (one-line ConfigError). The login node calls it: keep its module
    # import-light.
    check_options: Ref | None = None


@dataclass(frozen=True)
class Trainer(Registered):
    """``impl(ctx) -> trainer``; the trainer protocol is in ``milehpc.train.base``.

    ``can_reshard``: ``None`` (a checkpoint resumes only at the layout it was written with) or a callable / lazy
    ``"module:attr"`` reference ``(saved_parallel, current_parallel) -> bool`` saying whether this trainer can load
    a checkpoint written at another rank layout (the ``parallel`` part of the checkpoint's layout record, see
    :func:`milehpc.checkpoint.layout_record`). The login node calls it too: keep its module import-light."""

    can_reshard: Ref | None = None


@dataclass(frozen=True)
class WeightConverter(Registered):
    """``impl(named_tensors, **params) -> iterable of (name, tensor)``: trainer names/layout → engine's."""

    source: str = ""  # trainer backend, e.g. "megatron"
    target: str = ""  # engine weight format, e.g. "hf"


@dataclass(frozen=True)
class Task(Registered):
    """A prompt source: ``impl(seed, **params)`` returns an iterable of dicts with prompt, label, metadata.
    Toy tasks also name their reward (``reward``) and tokenizer vocabulary."""

    reward: str = ""


@dataclass(frozen=True)
class Generator(Registered):
    """Custom generation (multi-turn / agentic): ``impl(engine, prompts, sampling, **params) -> list[Sample]``."""


@dataclass(frozen=True)
class SandboxBackend(Registered):
    """A sandbox for untrusted programs (model-written code): ``impl(**params)`` returns an object with the
    :class:`milehpc.sandbox.Sandbox` interface. ``contained = False`` (the ``none`` backend) is built only when the job
    says ``[sandbox] allow_unsandboxed = true``."""

    contained: bool = True


@dataclass(frozen=True)
class Logger(Registered):
    """A metrics logger, selected by ``[logging] loggers``: ``impl(ctx, **params)`` (``ctx`` a
    :class:`milehpc.runtime.loggers.LoggerContext`) returns an object with ``log(step, metrics)``,
    ``continue_from(step)`` (a resumed run logs ``step`` and later again) and ``close()``. Only the trainer leader
    builds loggers; every one gets the same metric names and values."""


KINDS: dict[str, tuple[str, type]] = {
    # kind -> (hook name, dataclass)
    "site": ("milehpc_sites", SiteConfig),
    "container": ("milehpc_container_runtimes", ContainerRuntime),
    "reward": ("milehpc_rewards", RewardFunction),
    "advantage": ("milehpc_advantage_estimators", AdvantageEstimator),
    "loss": ("milehpc_policy_losses", PolicyLoss),
    "engine": ("milehpc_rollout_engines", RolloutEngine),
    "trainer": ("milehpc_trainers", Trainer),
    "converter": ("milehpc_weight_converters", WeightConverter),
    "task": ("milehpc_tasks", Task),
    "generator": ("milehpc_generators", Generator),
    "sandbox": ("milehpc_sandboxes", SandboxBackend),
    "logger": ("milehpc_loggers", Logger),
}
