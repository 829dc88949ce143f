"""Every milehpc hook. Plugins implement them with ``@milehpc.hookimpl``.

Register hooks are generators (conda style): they ``yield`` the dataclasses of ``milehpc.plugin_types``.
A name registered twice, by two plugins, is an error naming both. Chooser hooks use ``firstresult``.
A test fails if a hookspec here has no docstring.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pluggy

from milehpc.plugin_types import (
    AdvantageEstimator,
    ContainerRuntime,
    Generator,
    PolicyLoss,
    RewardFunction,
    RolloutEngine,
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

    Example::

        @hookimpl
        def milehpc_sites():
            yield SiteConfig(name="mycluster", impl=str(Path(__file__).parent / "mycluster.toml"),
                             description="My centre's GPU partition")
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

    Example::

        @hookimpl
        def milehpc_rewards():
            yield RewardFunction(name="length_penalty", impl="mypkg.rewards:length_penalty",
                                 defaults={"target": 32})
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
            yield PolicyLoss(name="ppo_clip", impl="milehpc.algorithms.losses:ppo_clip_loss",
                             defaults={"clip_low": 0.2, "clip_high": 0.2})
    """


@hookspec
def milehpc_rollout_engines() -> Iterable[RolloutEngine]:
    """Register rollout engines, selected by ``[rollout] engine``.

    Example::

        @hookimpl
        def milehpc_rollout_engines():
            yield RolloutEngine(name="sglang", impl="milehpc.rollout.sglang_engine:SGLangEngine",
                                requires=("sglang",))
    """


@hookspec
def milehpc_trainers() -> Iterable[Trainer]:
    """Register trainer backends, selected by ``[trainer] backend``.

    Example::

        @hookimpl
        def milehpc_trainers():
            yield Trainer(name="megatron", impl="milehpc.train.megatron:MegatronTrainer",
                          requires=("megatron.core",))
    """


@hookspec
def milehpc_weight_converters() -> Iterable[WeightConverter]:
    """Register converters from a trainer's parameter names/layout to an engine's (used by weight sync).

    Example::

        @hookimpl
        def milehpc_weight_converters():
            yield WeightConverter(name="megatron-to-hf", source="megatron", target="hf",
                                  impl="milehpc.train.megatron_convert:megatron_to_hf")
    """


@hookspec
def milehpc_tasks() -> Iterable[Task]:
    """Register prompt sources / toy tasks, selected by ``[data] source = "task:NAME"``.

    Example::

        @hookimpl
        def milehpc_tasks():
            yield Task(name="sort", impl="milehpc.data.toy:sort_task", reward="sort_exact",
                       defaults={"min_len": 4, "max_len": 5})
    """


@hookspec
def milehpc_generators() -> Iterable[Generator]:
    """Register custom generation functions (multi-turn / agentic rollouts), selected by ``[rollout] generator``.

    Example::

        @hookimpl
        def milehpc_generators():
            yield Generator(name="calculator", impl="mypkg.env:calculator_rollout", defaults={"max_turns": 3})
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
