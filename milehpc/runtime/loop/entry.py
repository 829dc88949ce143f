"""The loop's entry on every rank (``milehpc launch`` calls :func:`run`): build this rank's engine and/or trainer
from their plugins, the checkpointing, and hand over to the driver of the plan's layout."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.rollout.engine import Engine
    from milehpc.runtime.loop.checkpointing import LoopCheckpoint
    from milehpc.runtime.loop.reward_side import RewardRank
    from milehpc.runtime.offload import ColocatedStep
    from milehpc.train.base import Trainer


def run(ctx: RunContext, *, progress: bool = True, checkpointing: LoopCheckpoint | None = None,
        ) -> list[dict[str, float]]:
    """The loop on this rank. Returns the trainer leader's metrics history (empty on other ranks).
    ``checkpointing``: resume and checkpoints (default :meth:`LoopCheckpoint.for_context`)."""
    from milehpc import plugins
    from milehpc.runtime.loop.checkpointing import LoopCheckpoint

    job, plan, comms = ctx.job, ctx.plan, ctx.comms
    random.seed(job.run.seed + comms.rank)
    file = str(ctx.run_dir / "job.toml")
    engine: Engine | None = None
    trainer: Trainer | None = None
    colo: ColocatedStep | None = None
    reward_rank: RewardRank | None = None
    if plan.is_reward(comms.rank):  # starts its scorer process before the start-up barrier (it loads a model)
        from milehpc.runtime.loop.reward_side import RewardRank

        reward_rank = RewardRank(ctx, checkpointing or LoopCheckpoint.for_context(ctx))
    if plan.is_rollout(comms.rank):
        engine = plugins.load("engine", job.rollout.engine, file=file, field="rollout.engine")(ctx)
    if plan.colocated and engine is not None:
        from functools import partial

        from milehpc.runtime.offload import for_job
        from milehpc.weights.inplace import whole_model

        colo = for_job(job, engine, device=comms.device, rank=comms.rank,
                       share=partial(whole_model, comms))  # None: nothing to offload
        if colo is not None:
            # Released before the trainer is built and warmed up: at no point do both sides hold the device.
            colo.offload_rollout()
    if plan.is_trainer(comms.rank):
        make_trainer = plugins.load("trainer", job.trainer.backend, file=file, field="trainer.backend")
        if colo is not None:  # parameters and optimizer state in the pausable region
            with colo.train_region():
                trainer = colo.trainer = make_trainer(ctx)
        else:
            trainer = make_trainer(ctx)
    if comms.size > 1:
        # Loading a large model or starting an engine can take much longer than any later collective: wait for it
        # here, under its own limit, so the first collective (the resume agreement) is not timed from a rank that
        # is still loading. A rank that dies meanwhile is named by the heartbeat watchdog as usual.
        comms.barrier(what="start-up: every rank builds its engine and trainer",
                      timeout=job.resources.startup_timeout_s)
    if reward_rank is not None:
        reward_rank.run()
        return []
    ckpt = checkpointing or LoopCheckpoint.for_context(ctx)
    if plan.colocated:
        from milehpc.runtime.loop.colocated import run_colocated

        assert engine is not None and trainer is not None
        return run_colocated(ctx, engine, trainer, colo=colo, checkpointing=ckpt, progress=progress)
    if trainer is not None and plan.elastic:
        from milehpc.runtime.elastic.trainer import ElasticTrainer

        return ElasticTrainer(ctx, trainer, ckpt, progress=progress).run()
    if trainer is not None:
        from milehpc.runtime.loop.separate_trainer import SeparateTrainer

        return SeparateTrainer(ctx, trainer, ckpt, progress=progress).run()
    from milehpc.runtime.loop.separate_rollout import SeparateRollout

    assert engine is not None
    SeparateRollout(ctx, engine, ckpt).run()
    return []
