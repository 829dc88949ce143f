"""The RL loop's checkpointing: resume at the start of every rank's loop, and a checkpoint at step boundaries when one
is due (interval, time, requeue request, end of run), for every layout. What goes into a checkpoint comes from the
two sides (:class:`~milehpc.runtime.loop.trainer_side.TrainerSide`,
:class:`~milehpc.runtime.loop.rollout_side.RolloutSide`); how it is written is :mod:`milehpc.checkpoint`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.checkpoint import Checkpointer, CheckpointInfo, Collective, Decision, Solo, derive_rng
from milehpc.runtime.loop.protocol import CHECKPOINT, TAG_NOTICE
from milehpc.runtime.signals import RequestWatcher, RequeueExit, restart_count

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.comm.world import Comms
    from milehpc.config.job import JobSpec
    from milehpc.plan import Plan
    from milehpc.runtime.loop.protocol import Mailbox
    from milehpc.runtime.loop.rollout_side import RolloutSide
    from milehpc.runtime.loop.trainer_side import TrainerSide


@dataclass(frozen=True)
class Requeue:
    """A checkpoint written for a requeue request: the rank exits once the step is finished."""

    done: int
    path: Path


class CommsCollective:
    """:class:`milehpc.checkpoint.Collective` over the job's timed helpers (:class:`milehpc.comm.world.Comms`): they
    end early when the watchdog saw a rank die and name the ranks that did not answer."""

    def __init__(self, comms: Comms, timeout_s: float | None = None) -> None:
        self.comms = comms
        self.rank = comms.rank
        self.size = comms.size
        self.timeout_s = timeout_s

    def barrier(self, what: str) -> None:
        self.comms.barrier(what=what, timeout=self.timeout_s)

    def allreduce_max(self, values: list[int], what: str) -> list[int]:
        rows = self.comms.allgather(list(values), what=what, timeout=self.timeout_s)
        return [max(col) for col in zip(*rows, strict=True)]


class LoopCheckpoint:
    """Resume at the start and checkpoint at step boundaries for the RL loop (:mod:`milehpc.runtime.loop`).

    * Colocated and single-process runs: every rank is at the same boundary; one allreduce agrees on
      interval / time / requeue-request / end-of-run checkpoints (:meth:`Checkpointer.at_step_end`).
    * Separate trainer and rollout groups: the trainer ranks call :meth:`step_done` after each step; rank 0
      decides and tells the trainer ranks (broadcast) and the rollout ranks (a ``(CHECKPOINT, {...})`` notice through
      the loop's mailbox, taken between generations; they call :meth:`on_notice`). A rollout rank may be ahead of
      the trainer (it generated batches the trainer has not trained yet, still in flight): it keeps every batch it
      sent in an *outbox* until the trainer has trained it (a weight notice of version v means batches < v were
      trained); the checkpoint holds the outbox (HDF5), and a resumed rollout rank sends it again before generating
      anything new. After a resume the trainer pushes its weights once (the engines are rebuilt from the seeded
      init). Those weights may be newer than the ones the engine held (between two syncs, or at the end), but no
      batch is ever generated with them: a rollout rank reads a notice only between generations, and in every
      deterministic schedule (sync, one-step-off, async with ``async_weights = "scheduled"``) only when it
      waits for a weight version it does not have — the next sync after the checkpoint's step. Every batch it
      could still generate with its old weights, it generated before it joined the checkpoint (they are in the
      outbox); the next batch needs the next sync, which replaces the pushed weights before it is generated.

    What each rank writes: ``rank-N.pt`` = {"trainer": TrainerSide.state_dict(), "rollout": RolloutSide
    .state_dict() (scalars, the engine's state, the outbox's batch numbers and stats)} and ``rank-N.h5`` = the
    rollout side's sample buffers: the partial rollouts (``carry``), the over-sampled groups (``ready``) and each
    outbox batch (``outbox_B``). The process RNG is captured with every shard and restored once, last.

    **Resuming at another trainer layout** (only when the trainer plugin's ``can_reshard`` accepts it, e.g.
    Megatron TP=2 x DP=1 -> TP=1 x DP=2; the rollout layout and the model never change). What is per rank and
    where a rank of the new layout takes it from (:meth:`sources`):

    * *trainer state* — loop step, weight version, SFT flag (all global: every trainer rank holds the
      same values) and the trainer's own small state (version,
      step count, the path of its dist checkpoint): from **trainer rank 0's** shard, on every trainer rank. The
      model and optimizer come from the trainer's layout-independent checkpoint (Megatron: dist_checkpointing,
      loaded and resharded for the new TP/PP/DP), so they are exactly the saved ones.
    * *rollout state* — data cursor, partial rollouts, over-sampled groups, outbox, engine RNG: from the saved
      rank with the **same rollout index** (the rollout ranks shift when the number of trainer ranks changes);
      these are exactly the saved ones.
    * *process RNG* (python/numpy/torch) — rollout and colocated ranks: that same rank's, exact; trainer rank 0:
      its own, exact; every other trainer rank: a new stream derived from (run.seed, rank, step), because a
      rank of another layout has no saved stream to continue (its numbers cannot be bit-identical to any
      uninterrupted run, which did not exist at this layout). The trainer keeps RNG that depends on the layout
      (Megatron's TP-rank RNG tracker) as seeded for the new layout. Steps after a resharded resume therefore
      match an uninterrupted run only up to reduction order (TP/DP sums), not bitwise.
    """

    def __init__(self, job: JobSpec, run_dir: str | os.PathLike[str], *, comms: Comms | None = None,
                 plan: Plan | None = None) -> None:
        self.job = job
        self.run_dir = Path(run_dir)
        self.comms = comms
        self.plan = plan
        self.rank = comms.rank if comms is not None else 0
        coll: Collective = Solo() if comms is None or comms.size == 1 else \
            CommsCollective(comms, job.resources.collective_timeout_s)
        self.ck = Checkpointer.for_job(job, plan, run_dir, coll=coll)
        self.watcher = RequestWatcher(run_dir, rank=self.rank)
        self.separated = bool(plan is not None and not plan.colocated and comms is not None and comms.size > 1)
        self.resumed_step: int | None = None

    @classmethod
    def for_context(cls, ctx: RunContext) -> LoopCheckpoint:
        return cls(ctx.job, ctx.run_dir, comms=ctx.comms, plan=ctx.plan)

    # ---- resume ----------------------------------------------------------------------------------------
    def restore(self, *, trainer: TrainerSide | None = None, rollout: RolloutSide | None = None) -> bool:
        """Collective, at the start of every rank's loop: load the newest checkpoint into the sides.
        Returns True when the run resumed."""
        info = (self.ck.find_latest(sources=lambda i: sorted(set(self.sources(i).values())))
                if self.job.checkpoint.resume else None)
        if info is None:
            if trainer is not None:  # e.g. a job killed or requeued before its first checkpoint committed
                trainer.drop_records_from(0)
            return False
        src = self.sources(info)
        parts = {r: self.ck.load(info, source_rank=r) for r in sorted(set(src.values()))}
        restored = parts[src.get("rollout", src.get("trainer", self.rank))]
        resharded = restored.resharded
        if trainer is not None:
            ts = parts[src["trainer"]].state["trainer"]
            if resharded:  # the trainer loads its model/optimizer at the new layout, keeps its layout's RNG
                ts = {**ts, "trainer": {**ts["trainer"], "resharded": True}}
            trainer.load_state_dict(ts)
        if rollout is not None:
            rs = dict(restored.state["rollout"])
            # Checkpoints written before the loop became a package kept the outbox beside the rollout state.
            rs.setdefault("outbox", restored.state.get("outbox", []))
            rollout.load_state_dict(rs, restored.samples)
        if "rng" in src:  # last: everything above may have drawn from or set the process RNG
            parts[src["rng"]].apply_rng()
        else:
            derive_rng(self.job.run.seed, self.rank, info.step)
        self.resumed_step = info.step
        if self.rank == 0:
            how = ""
            if resharded:
                assert self.plan is not None
                saved = info.manifest["layout"]["parallel"]
                how = (f", resharded from tp={saved.get('tp')} pp={saved.get('pp')} dp={saved.get('dp')} to "
                       f"tp={self.plan.tp} pp={self.plan.pp} dp={self.plan.dp}")
            print(f"milehpc: resumed from {info.path} (step {info.step}, restart {restart_count()}{how})",
                  flush=True)
        return True

    def sources(self, info: CheckpointInfo) -> dict[str, int]:
        """The saved ranks this rank's state comes from: ``{"trainer": r, "rollout": r, "rng": r}`` (a role
        this rank does not have is absent; no ``"rng"`` = derive a new stream). Identity at the saved layout;
        at another trainer layout see the class docstring."""
        rank, plan = self.rank, self.plan
        saved = info.manifest.get("layout")
        if plan is None or saved is None or self.ck.layout is None or saved == self.ck.layout:
            return {"trainer": rank, "rollout": rank, "rng": rank}
        par = saved["parallel"]
        out: dict[str, int] = {}
        if plan.is_trainer(rank):
            out["trainer"] = 0
            if rank == 0:
                out["rng"] = 0
        if plan.is_rollout(rank):
            # can_reshard keeps the rollout layout; only its first rank moves with the number of trainer ranks.
            first = 0 if par.get("colocated") else int(par["trainer_ranks"])
            out["rollout"] = out["rng"] = first + rank - plan.rollout_first
        return out

    # ---- the trainer ranks' (and colocated ranks') step boundary -----------------------------------------
    def step_done(self, step: int, *, trainer: TrainerSide, rollout: RolloutSide | None = None,
                  mailbox: Mailbox | None = None, final: bool = False) -> None:
        """After step ``step`` (0-based) was trained, on every trainer rank (and every colocated rank, with its
        ``rollout`` side): checkpoint if due, and stop if a requeue was asked. ``final``: the loop ends after this
        step although steps remain (``run.target_reward`` reached) — that end is checkpointed like the last step.
        Separate groups: trainer rank 0 tells the rollout ranks through its ``mailbox``."""
        self.requeue_if(self.save_if_due(step, trainer=trainer, rollout=rollout, mailbox=mailbox, final=final))

    def save_if_due(self, step: int, *, trainer: TrainerSide, rollout: RolloutSide | None = None,
                    mailbox: Mailbox | None = None, final: bool = False) -> Requeue | None:
        """:meth:`step_done` without the requeue exit: the colocated loop saves while the trainer's memory is
        resident (before it is paused) and exits only after the step is reported (:meth:`requeue_if`)."""
        done = step + 1
        last = final or done >= self.job.run.steps
        requested = self.watcher.requested()
        if self.separated:
            decision = self._decide_for_groups(done, requested, last, mailbox)
        else:
            decision = self.ck.at_step_end(done, requested=requested, last=last)
        if not decision.save:
            return None
        path = self.write(done, trainer=trainer, rollout=rollout)
        return Requeue(done, path) if decision.stop else None

    def _decide_for_groups(self, done: int, requested: bool, last: bool, mailbox: Mailbox | None) -> Decision:
        comms, plan = self.comms, self.plan
        assert comms is not None and plan is not None
        trainers = list(plan.trainer_group())
        decision = self.ck.decide(done, requested=requested, last=last) if self.rank == 0 else None
        if len(trainers) > 1:
            decision = comms.bcast(decision, 0, trainers, what=f"step {done}: checkpoint decision")
        assert decision is not None
        if decision.save and self.rank == 0:
            assert mailbox is not None, "trainer rank 0 of separate groups tells the rollout ranks by its mailbox"
            for r in [*plan.rollout_group(), *plan.reward_group()]:  # reward ranks: runtime.loop.reward_side
                mailbox.send((CHECKPOINT, {"step": done, "stop": decision.stop}), r, TAG_NOTICE,
                             f"checkpoint notice to rank {r}")
        return decision

    # ---- the rollout ranks' side (separate groups) -----------------------------------------------------
    def on_notice(self, rollout: RolloutSide, info: dict[str, Any]) -> None:
        """A checkpoint notice from trainer rank 0: batches before its step are trained; join the save."""
        rollout.trained(int(info["step"]))
        self.save(int(info["step"]), trainer=None, rollout=rollout, stop=bool(info["stop"]))

    # ---- writing ---------------------------------------------------------------------------------------
    def save(self, done: int, *, trainer: TrainerSide | None, rollout: RolloutSide | None, stop: bool) -> None:
        """Collective over every rank: write this rank's sides after ``done`` steps; with ``stop``, then end the
        rank for a requeue (:class:`~milehpc.runtime.signals.RequeueExit`)."""
        path = self.write(done, trainer=trainer, rollout=rollout)
        if stop:
            self.requeue_if(Requeue(done, path))

    def write(self, done: int, *, trainer: TrainerSide | None, rollout: RolloutSide | None) -> Path:
        """Collective over every rank: write this rank's sides after ``done`` steps; returns the directory."""
        state: dict[str, Any] = {}
        samples: dict[str, Any] = {}
        meta: dict[str, Any] = {"restart_count": restart_count(), "steps_done": done}
        if trainer is not None:
            state["trainer"] = trainer.state_dict()
            meta.update(weight_version=trainer.state.weight_version, metric_step=trainer.state.step)
        if rollout is not None:
            state["rollout"] = rollout.state_dict()
            samples.update(rollout.sample_buffers())
            meta.setdefault("data", rollout.state.data)
        return self.ck.save(done, state, samples=samples, meta=meta)

    def requeue_if(self, requeue: Requeue | None) -> None:
        """End this rank for a requeue (:class:`~milehpc.runtime.signals.RequeueExit`) after the checkpoint that
        was asked for it."""
        if requeue is None:
            return
        self.watcher.acknowledge(requeue.done, requeue.path)
        if self.rank == 0:
            print(f"milehpc: checkpointed after step {requeue.done} in {requeue.path}; exiting with 75 to be "
                  "requeued", flush=True)
        raise RequeueExit(f"checkpointed after step {requeue.done} for a requeue")
