"""Separate trainer and rollout groups, the trainer ranks' driver.

Trainer rank 0 receives each step's batches from the engine leaders, drops or keeps stale groups, deals whole
groups to the DP ranks (:mod:`~milehpc.runtime.loop.protocol`), every trainer rank takes one optimizer step, and
the stage leaders send the new weights to the rollout ranks — announced to them first by a notice, so a rollout
rank can take it between generations without blocking. At the end rank 0 sends a stop and drains each engine
leader's last messages up to its "bye", so nothing is in flight at shutdown.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from milehpc.config.job import sync_bucket_bytes
from milehpc.errors import RuntimeFailure
from milehpc.runtime.loop import schedule
from milehpc.runtime.loop.evaluation import LoopEval, eval_due
from milehpc.runtime.loop.protocol import (
    BATCH,
    BYE,
    EVAL_DONE,
    EVAL_WEIGHTS,
    RESYNC,
    STOP_NOTICE,
    TAG_BATCH,
    TAG_EVAL,
    TAG_NOTICE,
    TAG_RESYNC,
    TAG_SHARE,
    WEIGHTS,
    Mailbox,
)
from milehpc.runtime.loop.rollout_metrics import merge_rollout_stats, rollout_metrics
from milehpc.runtime.loop.trainer_side import TrainerSide, world_facts
from milehpc.samples import samples_of
from milehpc.weights.sync import TimedExport, direct_weight_sync

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.runtime.loop.checkpointing import LoopCheckpoint
    from milehpc.samples import Group
    from milehpc.train.base import Trainer


class SeparateTrainer:
    """One trainer rank of a separate-groups job (see the module docstring)."""

    push_at_start = False  # send the weights before the first step even when the engines start with them
    share_timeout: float | None = None  # how long the other trainer ranks wait for their share (None: the comms')

    def __init__(self, ctx: RunContext, trainer: Trainer, checkpointing: LoopCheckpoint, *, progress: bool) -> None:
        self.job, self.comms, self.plan = ctx.job, ctx.comms, ctx.plan
        _, self.dp, _ = self.plan.trainer_coords(self.comms.rank)
        self.leader = self.comms.rank == 0
        self.trainer = trainer
        self.side = TrainerSide(self.job, trainer, run_dir=ctx.run_dir, dp_rank=self.dp, dp_size=self.plan.dp,
                                leader=self.leader, file=str(ctx.run_dir / "job.toml"), progress=progress)
        self.side.static = world_facts(self.comms)
        self.ckpt = checkpointing
        self.box = Mailbox(self.comms)
        self.direct = direct_weight_sync(self.job)
        self.leaders = self.plan.engine_leaders()
        self.rollout_ranks = list(self.plan.rollout_group())
        self.trainers = list(self.plan.trainer_group())
        # trainer rank 0 turns the engine leaders' evaluation results into eval/*
        self.evals = LoopEval.for_job(self.job, answers=False, run_dir=ctx.run_dir) if self.leader else None

    def run(self) -> list[dict[str, float]]:
        job, side = self.job, self.side
        try:
            resumed = self.ckpt.restore(trainer=side)
            side.warmup()
            if job.trainer.sft_warmup_steps > 0 or resumed or self.direct or self.push_at_start:  # resumed: the engines were rebuilt
                self.push_weights(self.trainer.version)
            for step in range(side.state.step, job.run.steps):
                t0 = time.perf_counter()
                if self.leader:
                    groups, mine, last, metrics = self.deal(step)
                else:
                    groups, metrics = [], {}
                    mine, last = self.take_share(step)
                metrics.update(side.train(step, samples_of(mine)))
                version = side.state.weight_version
                evaluate = eval_due(job, step, last)  # the weights after the last step go out only for this
                if evaluate or (not last and version in schedule.sync_versions(job)):
                    metrics["time/sync"] = self.push_weights(version, eval_step=step if evaluate else None)
                    metrics["time/sync_export"] = self.export_s
                metrics["time/step"] = time.perf_counter() - t0
                if evaluate and self.leader:
                    metrics.update(self.collect_eval(step))
                elif evaluate and self.direct:  # an engine may need a re-sync before its evaluation is in
                    self.take_share(step, until_eval_done=True)
                if self.leader:
                    side.report(step, metrics, groups)
                self.ckpt.step_done(step, trainer=side, mailbox=self.box, final=last)
                if last:
                    break
            if self.leader:
                self.stop_rollouts()
        finally:
            side.close()
        return side.history

    def push_weights(self, version: int, tag: int = TAG_NOTICE, *, eval_step: int | None = None) -> float:
        """Announce (rank 0) and send (stage leaders) the weights of ``version``; every trainer rank calls it (a
        trainer whose export is a collective needs them all). ``eval_step``: the engines evaluate these weights
        as step ``eval_step``'s. Returns the seconds it took."""
        if self.direct:
            from milehpc.weights.sglang import sync_weights
        else:
            from milehpc.weights.sync import sync_weights

        t0 = time.perf_counter()
        self.export_s = 0.0  # of which making the export's tensors (gathers, conversions), streamed into the send
        if self.leader:
            for r in self.rollout_ranks:
                notice = (WEIGHTS, version) if eval_step is None else (EVAL_WEIGHTS, (version, eval_step))
                self.box.send(notice, r, tag, f"weight notice to rank {r}")
        source = any(g.is_source for g in self.comms.sync_groups.values())
        if source or self.trainer.export_is_collective:
            # Streamed (issue 33): the stage leader sends each tensor as the export makes it (gathers included);
            # the other trainer ranks take part in the export's gathers in step, keeping nothing. A redone SGLang
            # sync exports again on every trainer rank.
            exports = [TimedExport(self.trainer.export_weights())]

            def again() -> TimedExport:
                exports.append(TimedExport(self.trainer.export_weights()))
                return exports[-1]

            bucket = sync_bucket_bytes(self.job)  # rollout.options.weight_bucket_mb, whatever the engine
            if self.direct and self.trainer.export_is_collective:
                sync_weights(self.comms, version, named_tensors=exports[0], again=again, bucket_bytes=bucket)
            elif source:
                sync_weights(self.comms, version, named_tensors=exports[0], bucket_bytes=bucket)
            exports[-1].drain()
            self.export_s = sum(e.seconds for e in exports)
        return time.perf_counter() - t0

    # ---- trainer rank 0 -----------------------------------------------------------------------------------
    def deal(self, step: int) -> tuple[list[Group], list[Group], bool, dict[str, float]]:
        """Rank 0: receive step ``step``'s batches, filter them, send every other trainer rank its share. Returns
        (all groups, rank 0's share, whether this is the last step, the rollout metrics)."""
        job, plan, side = self.job, self.plan, self.side
        t0 = time.perf_counter()
        groups, metrics = self.collect(step)
        metrics["time/wait_batch"] = time.perf_counter() - t0
        groups, st = side.filter_stale(groups)
        metrics.update(st)
        last = step == job.run.steps - 1 or side.target_reached(metrics)
        shares = schedule.deal_groups(groups, plan.dp)
        if plan.dp > 1 and not all(shares):
            # A DP rank without data cannot join the gradient all-reduce: nobody trains this step.
            metrics["train/skipped_groups"] = float(len(groups))
            shares = [[] for _ in shares]
        for r in self.trainers[1:]:
            _, rdp, _ = plan.trainer_coords(r)
            self.box.send((step, shares[rdp], last), r, TAG_SHARE, f"step {step} share to rank {r}")
        return groups, shares[self.dp], last, metrics

    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """Rank 0: step ``step``'s groups from every engine leader, and the rollout metrics."""
        parts, groups = [], []
        for src in self.leaders:
            g, stats = self.receive_batch(step, src)
            groups += g
            parts.append(stats)
        return groups, rollout_metrics(merge_rollout_stats(parts))

    def collect_eval(self, step: int) -> dict[str, float]:
        """Rank 0: every engine leader's share of step ``step``'s evaluation, as ``eval/*`` metrics."""
        assert self.evals is not None
        parts = []
        for src in self.leaders:
            got, part = self.box.recv(src, TAG_EVAL, f"evaluation of step {step} from engine leader {src}")
            while part == RESYNC:  # its engine died during the evaluation and restarted: the same weights again
                self.resync(step)
                got, part = self.box.recv(src, TAG_EVAL, f"evaluation of step {step} from engine leader {src}")
            if got != step:
                raise RuntimeFailure(f"trainer rank 0 expected the evaluation of step {step} from rank {src}, "
                                     f"got step {got}")
            parts.append(part)
        if self.direct:
            for r in self.trainers[1:]:
                self.box.send((step, EVAL_DONE, False), r, TAG_SHARE, f"end of evaluation {step} to rank {r}")
        return self.evals.metrics(step, parts)

    def receive_batch(self, step: int, src: int) -> tuple[list[Group], dict[str, float]]:
        """Engine leader ``src``'s batch of step ``step``; a re-sync request first (that engine restarted) gets
        every engine the current weights again."""
        what = f"batch {step} from engine leader {src}"
        kind, b, groups, stats = self.box.recv(src, TAG_BATCH, what)
        while kind == RESYNC:
            self.resync(step)
            kind, b, groups, stats = self.box.recv(src, TAG_BATCH, what)
        if kind != BATCH or b != step:
            raise RuntimeFailure(f"trainer rank 0 expected batch {step} from rank {src}, got {kind} {b}")
        return groups, stats

    def resync(self, step: int) -> None:
        """Rank 0: an engine restarted; every stage leader sends the current weights to every engine again."""
        for r in self.trainers[1:]:
            self.box.send((step, RESYNC, self.side.state.weight_version), r, TAG_SHARE, f"re-sync notice to rank {r}")
        self.push_weights(self.side.state.weight_version, TAG_RESYNC)

    def stop_rollouts(self) -> None:
        """Stop the rollout ranks and drain what they still send, so nothing is in flight at shutdown."""
        for r in [*self.rollout_ranks, *self.plan.reward_group()]:  # the reward ranks end after their leaders
            self.box.send(STOP_NOTICE, r, TAG_NOTICE, f"stop notice to rank {r}")
        for src in self.leaders:
            while (kind := self.box.recv(src, TAG_BATCH, f"end of rollouts from rank {src}")[0]) != BYE:
                if kind == RESYNC:  # too late to re-sync: release the waiting engine leader
                    self.box.send(STOP_NOTICE, src, TAG_RESYNC, f"stop to rank {src}")
        self.box.flush()

    # ---- the other trainer ranks --------------------------------------------------------------------------
    def take_share(self, step: int, *, until_eval_done: bool = False) -> tuple[list[Any], bool]:
        """This rank's share of step ``step`` from rank 0 (or, ``until_eval_done``, the end of step ``step``'s
        evaluation), joining the re-syncs announced before it."""
        what = f"step {step} {'evaluation' if until_eval_done else 'share'} from trainer rank 0"
        _, mine, last = self.box.recv(0, TAG_SHARE, what, self.share_timeout)
        while mine == RESYNC:  # an engine restarted (see receive_batch): `last` carries the version
            self.push_weights(last, TAG_RESYNC)
            _, mine, last = self.box.recv(0, TAG_SHARE, what, self.share_timeout)
        if (mine == EVAL_DONE) != until_eval_done:
            raise RuntimeFailure(f"trainer rank {self.comms.rank} expected the {what}, got {str(mine)[:80]}")
        return mine, last
