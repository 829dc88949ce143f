"""The colocated layout: every rank generates its share, trains on it (DP over all ranks) and loads the new weights
into its own engine in place (the whole model on every rank: :func:`milehpc.weights.inplace.whole_model`). Only
the sync loop (one process cannot overlap generation and training; the job rules refuse the others on the login
node). With SGLang the two halves of a step go through
:class:`milehpc.runtime.offload.ColocatedStep` (Miles' offload/onload order around torch_memory_saver)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from milehpc.runtime.loop.evaluation import LoopEval, eval_due
from milehpc.runtime.loop.rollout_metrics import merge_rollout_stats, rollout_metrics
from milehpc.runtime.loop.rollout_side import RolloutSide
from milehpc.runtime.loop.trainer_side import TrainerSide, world_facts
from milehpc.samples import samples_of
from milehpc.weights.inplace import whole_model
from milehpc.weights.sync import sync_weights

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.rollout.engine import Engine
    from milehpc.runtime.loop.checkpointing import LoopCheckpoint, Requeue
    from milehpc.runtime.offload import ColocatedStep
    from milehpc.train.base import Trainer


def run_colocated(ctx: RunContext, engine: Engine, trainer: Trainer, *, colo: ColocatedStep | None,
                  checkpointing: LoopCheckpoint, progress: bool) -> list[dict[str, float]]:
    """This rank's loop; returns the leader's metrics history (empty elsewhere)."""
    job, comms, plan = ctx.job, ctx.comms, ctx.plan
    e, _ = plan.engine_of(comms.rank)
    _, dp, _ = plan.trainer_coords(comms.rank)
    leader = comms.rank == 0
    file = str(ctx.run_dir / "job.toml")
    rollout = RolloutSide(job, engine, engine_index=e, num_engines=plan.engines, file=file)
    side = TrainerSide(job, trainer, run_dir=ctx.run_dir, dp_rank=dp, dp_size=plan.dp, leader=leader, file=file,
                       progress=progress)
    everyone = list(range(plan.world_size))
    evals = LoopEval.for_job(job, file=file, announce=leader, run_dir=ctx.run_dir)
    side.static = world_facts(comms)
    try:
        checkpointing.restore(trainer=side, rollout=rollout)
        if colo is None:
            side.warmup()
            sync_weights(comms, trainer.version, named_tensors=whole_model(comms, trainer.export_weights()),
                         engine=rollout)
        else:
            with colo.train_region():
                side.warmup()
            colo.initial_sync(trainer.version)
            rollout.state.weight_version = trainer.version
        for step in range(side.state.step, job.run.steps):
            t0 = time.perf_counter()
            if colo is None:
                groups, stats = rollout.produce()
            else:
                groups, stats = colo.generate_phase(rollout.produce)
            gathered = comms.gather((groups, stats), 0, everyone, what=f"step {step} rollouts")
            metrics: dict[str, float] = {}
            if leader:
                all_groups = [g for part in gathered for g in part[0]]
                merged = merge_rollout_stats([part[1] for part in gathered])
                metrics = rollout_metrics(merged)
            counts = comms.allgather(len(groups), everyone, what=f"step {step} group counts")
            # A rank without data cannot join the gradient all-reduce: then nobody trains this step.
            samples = samples_of(groups) if min(counts) > 0 else []
            ends: list[tuple[bool, Requeue | None, float]] = []

            def end_training(train_metrics: dict[str, float], step: int = step, metrics: dict[str, float] = metrics,
                             ends: list[tuple[bool, Requeue | None, float]] = ends) -> None:
                """Stop flag and checkpoint while the trainer's memory is resident: a colocated trainer is paused
                right after this, and its state_dict would read paused device memory."""
                metrics.update(train_metrics)
                rollout.state.weight_version = trainer.version
                stop = comms.bcast(leader and side.target_reached(metrics), 0, everyone, what="stop flag")
                side.unreported = {"step": step, **metrics}  # its reward belongs to the checkpoint's window
                t = time.perf_counter()
                requeue = checkpointing.save_if_due(step, trainer=side, rollout=rollout, final=stop)
                ends.append((stop, requeue, time.perf_counter() - t))

            if colo is None:
                end_training(side.train(step, samples))
                t1 = time.perf_counter()
                sync_weights(comms, trainer.version, named_tensors=whole_model(comms, trainer.export_weights()),
                             engine=rollout)
                metrics["time/sync"] = time.perf_counter() - t1
            else:
                metrics.update(colo.train_phase(lambda step=step, samples=samples: side.train(step, samples),
                                                resident=end_training))
            (stop, requeue, saving), = ends
            metrics["time/step"] = time.perf_counter() - t0 - saving  # as before: a step's time, not its save's
            if evals is not None and eval_due(job, step, stop or step == job.run.steps - 1):
                # the engines hold this step's weights (colocated SGLang: onloaded again by train_phase)
                part = evals.share(engine, rollout.state.weight_version, engine_index=e,
                                   num_engines=plan.engines)
                parts = comms.gather(part, 0, everyone, what=f"step {step} evaluation")
                if leader:
                    metrics.update(evals.metrics(step, parts))
            if leader:
                side.report(step, metrics, all_groups)
            checkpointing.requeue_if(requeue)  # after the report: the resumed run starts after this step
            if stop:
                break
        if colo is not None:
            colo.finish()
    finally:
        side.close()
    return side.history
