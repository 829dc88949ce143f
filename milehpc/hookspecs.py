"""Every milehpc hook. Plugins implement them with ``@milehpc.hookimpl``.

Register hooks are generators (conda style): they ``yield`` the dataclasses of ``milehpc.plugin_types``.
A name registered twice, by two plugins, is an error naming both. Chooser hooks use ``firstresult``.
A test fails if a hookspec here has no docstring, or if its example does not run or registers a target that does
not resolve (tests/test_plugins_core.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pluggy

from milehpc.plugin_types import (
    AdvantageEstimator,
    ContainerRuntime,
    Generator,
    Logger,
    PolicyLoss,
    RewardFunction,
    RolloutEngine,
    SandboxBackend,
    SiteConfig,
    Task,
    Trainer,
    WeightConverter,
)

PROJECT = "milehpc"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def milehpc_sites() -> Iterable[SiteConfig]:
    """Register sites (clusters). ``impl`` is the path of a site TOML file or a callable returning its dict.

    Example (the site plugin in ``plugins/milehpc-site-example``; in a plugin's own module the path is
    ``Path(__file__).with_name("example-cluster.toml")``)::

        import milehpc_site_example

        @hookimpl
        def milehpc_sites():
            toml = Path(milehpc_site_example.__file__).with_name("example-cluster.toml")
            yield SiteConfig(name="example-cluster", impl=str(toml),
                             description="Example Centre's cluster: 4 A100 per GPU node")
    """


@hookspec
def milehpc_container_runtimes() -> Iterable[ContainerRuntime]:
    """Register container runtimes that wrap each rank's command.

    Example::

        @hookimpl
        def milehpc_container_runtimes():
            yield ContainerRuntime(name="apptainer", impl="milehpc.render.container:apptainer_argv")
    """


@hookspec
def milehpc_rewards() -> Iterable[RewardFunction]:
    """Register reward functions, selected by ``[reward] name`` in the job spec.

    A reward's parameters (``[reward] params``) are declared as a ``schema`` dataclass of ``opt`` fields, checked on
    the login node and printed by ``milehpc plugins show NAME`` (every kind below takes one the same way).

    Example (the reward plugin in ``plugins/milehpc-reward-example``)::

        from dataclasses import dataclass

        from milehpc.config.schema import opt

        @dataclass
        class LengthTargetParams:
            target: int = opt(8, min=0, help="response length (tokens) that scores 1")
            width: int = opt(8, min=1, help="tokens away from target at which the score reaches 0")

        @hookimpl
        def milehpc_rewards():
            yield RewardFunction(name="length_target", impl="milehpc_reward_example.rewards:length_target",
                                 schema=LengthTargetParams)
    """


@hookspec
def milehpc_advantage_estimators() -> Iterable[AdvantageEstimator]:
    """Register advantage estimators, selected by ``[algorithm] advantage``.

    Example::

        @hookimpl
        def milehpc_advantage_estimators():
            yield AdvantageEstimator(name="grpo", impl="milehpc.algorithms.advantages:grpo",
                                     defaults={"epsilon": 1e-6, "norm_by_std": True})
    """


@hookspec
def milehpc_policy_losses() -> Iterable[PolicyLoss]:
    """Register policy losses, selected by ``[algorithm] loss``.

    Example::

        @hookimpl
        def milehpc_policy_losses():
            yield PolicyLoss(name="ppo_clip", impl="milehpc.algorithms.losses:ppo_clip",
                             defaults={"clip_low": 0.2, "clip_high": 0.2, "clip_ratio_c": 3.0})
    """


@hookspec
def milehpc_rollout_engines() -> Iterable[RolloutEngine]:
    """Register rollout engines, selected by ``[rollout] engine``. ``impl(ctx)`` builds the rank's engine.

    Example::

        @hookimpl
        def milehpc_rollout_engines():
            yield RolloutEngine(name="sglang", impl="milehpc.rollout.sglang_engine:from_context",
                                requires=("sglang",), direct_weight_sync=True)
    """


@hookspec
def milehpc_trainers() -> Iterable[Trainer]:
    """Register trainer backends, selected by ``[trainer] backend``. ``impl(ctx)`` builds the rank's trainer.

    Example::

        @hookimpl
        def milehpc_trainers():
            yield Trainer(name="megatron", impl="milehpc.train.megatron.trainer:from_context",
                          requires=("megatron.core", "torch", "transformers"),
                          can_reshard="milehpc.train.megatron.checkpoint:can_reshard")
    """


@hookspec
def milehpc_weight_converters() -> Iterable[WeightConverter]:
    """Register converters from a trainer's parameter names/layout to an engine's (used by weight sync).

    Example::

        @hookimpl
        def milehpc_weight_converters():
            yield WeightConverter(name="megatron-to-hf", source="megatron", target="hf",
                                  impl="milehpc.train.megatron.convert:megatron_to_hf")
    """


@hookspec
def milehpc_tasks() -> Iterable[Task]:
    """Register prompt sources / toy tasks, selected by ``[data] source = "task:NAME"``.

    Example::

        @hookimpl
        def milehpc_tasks():
            yield Task(name="sort", impl="milehpc.data.tasks:sort_task", reward="toy_match",
                       defaults={"min_len": 4, "max_len": 5})
    """


@hookspec
def milehpc_generators() -> Iterable[Generator]:
    """Register custom generation functions (multi-turn / agentic rollouts), selected by ``[rollout] generator``.

    Example::

        @hookimpl
        def milehpc_generators():
            yield Generator(name="toy_retry", impl="milehpc.rollout.multiturn:retry_generator",
                            defaults={"max_turns": 2})
    """


@hookspec
def milehpc_sandboxes() -> Iterable[SandboxBackend]:
    """Register sandboxes for model-written programs, selected by the site's ``[partitions.NAME.sandbox] backend``
    or the job's ``[sandbox] backend``. ``impl(**params)`` builds one (see :class:`milehpc.sandbox.Sandbox`).

    Example::

        @hookimpl
        def milehpc_sandboxes():
            yield SandboxBackend(name="bubblewrap", impl="milehpc.sandbox.bubblewrap:Bubblewrap",
                                 defaults={"bwrap": "bwrap", "python": "python3", "uid": 65534})
    """


@hookspec
def milehpc_loggers() -> Iterable[Logger]:
    """Register metrics loggers, selected by ``[logging] loggers`` (their parameters: ``[logging.params.NAME]``).
    ``impl(ctx, **params)`` builds one on the trainer leader (see :class:`milehpc.plugin_types.Logger`).

    Example::

        @hookimpl
        def milehpc_loggers():
            yield Logger(name="tensorboard", impl="milehpc.runtime.loggers:TensorBoardLogger",
                         requires=("tensorboard",))
    """


@hookspec(firstresult=True)
def milehpc_detect_site(hostname: str, environ: dict[str, str]) -> str | None:
    """Name the site this machine belongs to, or return None. The first plugin that answers wins.

    Used when ``--site`` is not given (and by ``milehpc doctor``).

    Example::

        @hookimpl
        def milehpc_detect_site(hostname, environ):
            if hostname.startswith("login") and environ.get("LMOD_SYSTEM_NAME") == "frontier":
                return "frontier-like"
            return None
    """


def _all_hookspecs() -> dict[str, Any]:
    return {name: obj for name, obj in globals().items() if name.startswith("milehpc_") and callable(obj)}
