"""The ``[reward_model]`` table: a reward model on ranks of its own (a third MPI group beside trainer and rollout),
or beside the rollout engines (``colocate = "rollout"``).

With ``path`` set, the job's ``[reward]`` (which must name the model scorer of ``kind`` on that folder: ``reward_model``
for a classifier, ``judge`` for a generative judge; directly, in ``combine`` or in ``by_source``) runs on the reward
ranks: the rollout engine leaders hand their finished samples over and get the scores back
(:mod:`milehpc.runtime.loop.reward_side`). Login-safe: no torch, no model is read here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from milehpc.config.schema import opt
from milehpc.errors import ConfigError

# The model scorer each kind runs (their parameters: milehpc.builtin.rewards).
SCORER_OF_KIND = {"classifier": "reward_model", "generative": "judge"}


@dataclass
class RewardModelSpec:
    path: str = opt("", help="the reward model's folder; empty = no reward group (the rollout ranks score)")
    kind: Literal["classifier", "generative"] = opt(
        "classifier", help="classifier: the reward_model scorer (a sequence-classification RM); generative: judge")
    engines: int = opt(1, min=1, help="reward-model engines (scorer processes), each on its own ranks")
    gpus_per_engine: int = opt(1, min=1, help="ranks (GPUs) of one reward-model engine; its first rank scores")
    batch_size: int = opt(32, min=1, help="samples per scorer call, gathered across the rollout ranks")
    colocate: Literal["", "rollout"] = opt("", help="'rollout': the scorer runs on the rollout engine leaders "
                                                    "instead of ranks of its own")
    chunks: int = opt(2, min=1, help="each rollout engine hands its step's prompts' samples over in this many "
                                     "parts as they finish, so scoring overlaps the rest of the generation")
    timeout_s: float = opt(300.0, min=1.0, help="a scorer call longer than this is a slow scorer: it is killed, "
                                                "restarted and its samples are scored again")
    retries: int = opt(1, min=0, help="how many times samples whose scorer died or stalled are scored again; then "
                                      "they are dropped (FAILED, counted in reward/failed), never scored 0")

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    @property
    def own_ranks(self) -> bool:
        """Whether the reward model has ranks of its own (a third group in the plan)."""
        return self.enabled and self.colocate != "rollout"

    def validate(self, *, file: str | None, prefix: str) -> None:
        if self.colocate == "rollout" and (self.engines != 1 or self.gpus_per_engine != 1):
            field = "engines" if self.engines != 1 else "gpus_per_engine"
            raise ConfigError(f"expected {prefix}.{field} unset with colocate = \"rollout\" (the scorer runs on every "
                              f"rollout engine leader), got {getattr(self, field)}", file=file,
                              field=f"{prefix}.{field}")


def check_reward_group(rm: RewardModelSpec, rewards: Iterable[tuple[str, str, dict[str, Any]]], *, reward_name: str,
                       colocated: bool, file: str | None) -> None:
    """``[reward_model]`` against the rest of the job: ``rewards`` are (field, name, params) of every reward the job's
    ``[reward]`` names (``reward_name`` is its own name), ``colocated`` is ``resources.colocate``. One line, naming the
    field, on the first fault."""
    if not rm.enabled:
        return
    if rm.own_ranks and colocated:
        raise ConfigError("expected reward_model.colocate = \"rollout\" with resources.colocate = true (every rank is "
                          "trainer and rollout; reward ranks of their own are for separate groups), got "
                          f"{rm.colocate!r}", file=file, field="reward_model.colocate")
    want = SCORER_OF_KIND[rm.kind]
    found = [(field, params) for field, name, params in rewards if name == want]
    if not found:
        raise ConfigError(f"expected the job's [reward] to name the '{want}' scorer (reward_model.kind = "
                          f"{rm.kind!r}; directly or in combine), got {reward_name or 'the task reward'!r}",
                          file=file, field="reward.name")
    for field, params in found:
        if params.get("path") != rm.path:
            raise ConfigError(f"expected the '{want}' scorer's path to be reward_model.path ({rm.path!r}), got "
                              f"{params.get('path')!r}", file=file, field=f"{field}.params.path")


def check_judge_engine(engine: str, options: dict[str, Any], *, file: str | None, prefix: str) -> None:
    """A judge's ``engine`` and ``engine_options`` checked as ``rollout.engine`` and ``rollout.options`` are (the
    engine plugin's declared options and its own full check), one line naming ``prefix.engine[_options...]``."""
    from milehpc import plugins
    from milehpc.config.schema import check_params
    from milehpc.plugin_types import load_ref

    spec = plugins.lookup("engine", engine, file=file, field=f"{prefix}.engine")
    where = f"{prefix}.engine_options"
    check_params(spec, options, file=file, prefix=where)
    if spec.check_options is not None:
        try:
            load_ref(spec.check_options)(options, file=file)
        except ConfigError as err:  # the engine's own check names rollout.options: name the judge's field
            field = (err.field or "rollout.options").replace("rollout.options", where, 1)
            message = err.message
            if message.startswith("set by milehpc from "):  # a server arg milehpc derives: from the judge's fields
                source = message.removeprefix("set by milehpc from ").removesuffix("; change that instead")
                ours = {"model.path": f"{prefix}.path", "model.tokenizer": f"{prefix}.tokenizer",
                        "run.seed": f"{prefix}.seed"}.get(source)
                if ours is None and source.startswith("rollout.options"):
                    ours = source.replace("rollout.options", where, 1)
                message = (f"set by milehpc from {ours}; change that instead" if ours else
                           "set by milehpc for the judge (one engine on one device)")
            raise ConfigError(message, file=file, field=field) from None


def judge_engines(rewards: Iterable[tuple[str, str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """(field, engine) of every ``judge`` the job's ``[reward]`` names (``rewards``: :func:`milehpc.config.job.
    named_rewards`), for the site's container check."""
    return [(f"{field}.params.engine", str(params.get("engine", "reference")))
            for field, name, params in rewards if name == SCORER_OF_KIND["generative"]]
