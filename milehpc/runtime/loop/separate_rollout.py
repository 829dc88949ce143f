"""Separate trainer and rollout groups, the rollout ranks' driver.

Engine leaders generate their share of each step's prompts, score them and send the finished groups to trainer
rank 0 (:mod:`~milehpc.runtime.loop.protocol`). Between generations only — never during one (the Miles rule) — a
rollout rank takes the weight notices that are due: ``sync`` generates batch k with the weights after step k-1,
``one_step_off`` with those after step k-2 (batch k+1 is generated while step k trains), ``async`` runs at most
``run.max_staleness`` batches ahead (:func:`~milehpc.runtime.loop.schedule.required_version`) and, with
``run.async_weights = "latest"``, takes whatever weights have arrived; with ``"scheduled"`` it generates each batch
with exactly the version it requires, so the run is a function of the seed alone and resumes bitwise. The last notice is a stop, answered by a "bye" from each engine leader after its last batch,
so nothing is in flight at shutdown.

Engines that receive the weight bytes directly (SGLang, :mod:`milehpc.weights.sglang`) also swap health flags with
the other engine leaders before each batch, take their share of the prompts from the router over the live engines,
restart a dead engine in place and have it re-synced; while waiting they serve the re-syncs of other engines. An
engine that dies during an evaluation is restarted and re-synced the same way, then evaluates again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from milehpc.errors import RuntimeFailure
from milehpc.faults import armed
from milehpc.runtime.loop.evaluation import LoopEval
from milehpc.runtime.loop.protocol import (
    BATCH,
    BYE,
    CHECKPOINT,
    EVAL_WEIGHTS,
    RESYNC,
    STOP,
    STOP_NOTICE,
    TAG_ALIVE,
    TAG_BATCH,
    TAG_EVAL,
    TAG_NOTICE,
    TAG_RESYNC,
    Mailbox,
)
from milehpc.runtime.loop.rollout_side import RolloutSide
from milehpc.runtime.loop.schedule import required_version
from milehpc.weights.sync import direct_weight_sync

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.rollout.engine import DirectSyncEngine, Engine
    from milehpc.runtime.loop.checkpointing import LoopCheckpoint


class SeparateRollout:
    """One rollout rank of a separate-groups job (see the module docstring)."""

    def __init__(self, ctx: RunContext, engine: Engine, checkpointing: LoopCheckpoint) -> None:
        self.job, self.comms, self.plan = ctx.job, ctx.comms, ctx.plan
        e, er = self.plan.engine_of(self.comms.rank)
        self.side = RolloutSide(self.job, engine, engine_index=e, num_engines=self.plan.engines, leader=er == 0,
                                file=str(ctx.run_dir / "job.toml"))
        self.engine = engine
        self.ckpt = checkpointing
        self.box = Mailbox(self.comms)
        self.direct = direct_weight_sync(self.job)
        self.evals = LoopEval.for_job(self.job, file=str(ctx.run_dir / "job.toml"),
                                      announce=e == 0) if self.side.leader else None
        if self.side.leader and self.plan.reward_ranks:  # scoring on the reward ranks (runtime.loop.reward_side)
            from milehpc.runtime.loop.reward_side import RewardClient

            self.side.remote = RewardClient(self.box, self.plan.reward_leader_for(e), self.job.reward_model.chunks)

    def run(self) -> None:
        job, side, box = self.job, self.side, self.box
        resumed = self.ckpt.restore(rollout=side)
        # The warmed-up weights (version 0), or after a resume the trainer's restored weights; engines that receive
        # weights directly always start with them (they may have started from random "dummy" weights).
        if (job.trainer.sft_warmup_steps > 0 or resumed or self.direct) and not self.take_notice(block=True):
            return
        for sent in list(side.outbox) if resumed else []:
            # Batches generated before the checkpoint that the trainer had not trained yet: send them again.
            box.send((BATCH, sent.batch, sent.groups, sent.stats), 0, TAG_BATCH,
                     f"batch {sent.batch} to trainer rank 0")
        # async "latest": take any weights that arrived; every other schedule waits for exactly the version it needs
        latest = job.run.loop == "async" and job.run.async_weights == "latest"
        running = True
        while running:
            b = side.state.step
            # Between generations only: take updates that are due (or, async, any that arrived).
            while running:
                if b >= job.run.steps:
                    running = self.take_notice(block=True)
                    continue
                if side.state.weight_version < required_version(job, b):
                    running = self.take_notice(block=True)
                elif latest and (got := box.poll(0, TAG_NOTICE)) is not None:
                    running = self.apply_notice(got[0])
                else:
                    break
            if not running:
                break
            if side.leader:
                if self.direct:
                    self.engine_turn(b)
                with self.resyncs_through((RESYNC, b, [], {}), TAG_BATCH, f"batch {b}"):
                    groups, stats = side.produce()
                box.send((BATCH, b, groups, stats), 0, TAG_BATCH, f"batch {b} to trainer rank 0")
                side.sent(b, groups, stats)
            else:
                side.state.step += 1
                if self.direct:
                    self.serve_resyncs()
        if side.leader:
            if side.remote is not None:
                side.remote.bye(side.state.step)
            box.send((BYE, side.state.step, [], {}), 0, TAG_BATCH, "end of rollouts")
        box.flush()

    # ---- notices ------------------------------------------------------------------------------------------
    def take_notice(self, *, block: bool) -> bool:
        """Apply one notice if there is one (or wait for it). Returns False on stop."""
        what = "waiting for new weights from trainer rank 0"
        t0 = time.perf_counter()
        if block and self.direct:  # serve other engines' re-syncs while waiting (the trainer may be in one)
            notice = self.wait_serving(lambda: self.box.poll(0, TAG_NOTICE), what)
        elif block:
            notice = self.box.recv(0, TAG_NOTICE, what)
        else:
            got = self.box.poll(0, TAG_NOTICE)
            if got is None:
                return True
            notice = got[0]
        if block:
            self.side.add_time("time_wait_weights", time.perf_counter() - t0)
        return self.apply_notice(notice)

    def apply_notice(self, notice: tuple[str, Any]) -> bool:
        """Act on one notice from trainer rank 0: a checkpoint, a weight sync, or a stop (False)."""
        kind, arg = notice
        if kind == STOP:
            return False
        if kind == CHECKPOINT:
            if self.side.remote is not None:  # its reward rank joins the save once every leader it serves has
                self.side.remote.at_checkpoint(int(arg["step"]))
            self.ckpt.on_notice(self.side, arg)
            return True
        version, eval_step = arg if kind == EVAL_WEIGHTS else (int(arg), None)
        self.side.trained(version)
        t0 = time.perf_counter()
        if self.direct:  # the bytes go into the engine's schedulers through its own update group
            from milehpc.weights.sglang import sync_weights as direct_sync

            engine = cast("DirectSyncEngine", self.engine)
            if engine.is_leader and not engine.health():
                engine.restart()  # died since the last generation: this sync rebuilds its group and fills it
            direct_sync(self.comms, version, engine=engine)
            self.side.state.weight_version = version
        else:
            from milehpc.weights.sync import sync_weights

            sync_weights(self.comms, version, engine=self.side)
        self.side.add_time("time_load_weights", time.perf_counter() - t0)
        if eval_step is not None and self.evals is not None:  # engine leaders: evaluate these weights
            part = self.evaluate(eval_step)
            self.box.send((eval_step, part), 0, TAG_EVAL, f"evaluation of step {eval_step} to trainer rank 0")
        return True

    def evaluate(self, step: int) -> Any:
        """This engine's share of step ``step``'s evaluation. An SGLang engine that dies during it restarts in
        place, has the trainer re-sync the same weights (``(step, RESYNC)`` on TAG_EVAL) and evaluates again."""
        assert self.evals is not None
        fault = self.direct and armed("eval", step)  # MILEHPC_FAULT=eval:STEP, once: the redo must succeed
        while True:
            if fault:
                fault = False
                self.engine.kill_scheduler()  # type: ignore[attr-defined]
            try:
                with self.resyncs_through((step, RESYNC), TAG_EVAL, f"evaluation of step {step}"):
                    return self.evals.share(self.engine, self.side.state.weight_version, engine_index=self.side.e,
                                            num_engines=self.plan.engines)
            except RuntimeFailure:
                if not self.direct or cast("DirectSyncEngine", self.engine).health():
                    raise
            self.restart_resynced((step, RESYNC), TAG_EVAL, f"evaluation of step {step}")

    def restart_resynced(self, request: Any, tag: int, what: str) -> None:
        """Restart the dead engine in place, ask trainer rank 0 for a re-sync (``request`` on ``tag``) and wait,
        serving re-syncs, until the engine holds the trainer's weights again."""
        cast("DirectSyncEngine", self.engine).restart()
        self.await_resync(request, tag, what)

    def await_resync(self, request: Any, tag: int, what: str) -> None:
        """Ask trainer rank 0 for a re-sync of the restarted engine and wait, serving re-syncs, until it is filled."""
        engine = cast("DirectSyncEngine", self.engine)
        self.box.send(request, 0, tag, f"re-sync request ({what}) to trainer rank 0")
        self.wait_serving(lambda: None if engine.needs_weight_sync else (True,),
                          f"re-sync of restarted engine {self.side.e} ({what})")

    # ---- engines that receive weights directly (SGLang, vLLM) ---------------------------------------------
    @contextlib.contextmanager
    def resyncs_through(self, request: Any, tag: int, what: str) -> Iterator[None]:
        """During a call that may generate: an engine that restarts itself when it dies mid-call (vLLM's supervisor,
        its ``resync`` hook) has the trainer re-sync it with ``request`` on ``tag``, as :meth:`restart_resynced`."""
        if not self.direct or not hasattr(self.engine, "resync"):
            yield
            return
        self.engine.resync = lambda: self.await_resync(request, tag, what)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self.engine.resync = None  # type: ignore[attr-defined]

    def serve_resyncs(self) -> bool:
        """Take part in every re-sync the trainer has announced (after some engine restarted). Every sync has the
        same protocol, so it does not matter whether a re-sync or a regular one is taken first. False on stop."""
        while (got := self.box.poll(0, TAG_RESYNC)) is not None:
            if not self.apply_notice(got[0]):
                return False
        return True

    def wait_serving(self, probe: Callable[[], tuple[Any] | None], what: str) -> Any:
        """Wait (with the comms' timeout) until ``probe()`` returns something, serving re-syncs meanwhile."""
        return self.box.wait(lambda: (STOP_NOTICE,) if not self.serve_resyncs() else probe(), what, [0])

    def engine_turn(self, b: int) -> None:
        """Engine leader, before generating batch ``b``: the engine leaders swap health flags, this engine's share
        of the step's prompt groups comes from the router over the live engines (a dead one gets none this step),
        and a dead engine is restarted in place and re-synced to the trainer's current weights."""
        from milehpc.rollout.router import Router, split_prompts

        comms, side, ro = self.comms, self.side, self.job.rollout
        engine = cast("DirectSyncEngine", self.engine)
        healthy = engine.health()
        leaders = self.plan.engine_leaders()
        alive = [healthy]
        if len(leaders) > 1:
            for r in leaders:
                if r != comms.rank:
                    self.box.send((b, healthy), r, TAG_ALIVE, f"engine health to rank {r}")
            flags = {comms.rank: healthy}
            for r in leaders:
                while r not in flags:
                    got = self.wait_serving(lambda r=r: self.box.poll(r, TAG_ALIVE),
                                            f"health of engine leader {r} for batch {b}")
                    if got == STOP_NOTICE:
                        return
                    if got[0] == b:  # flags of an older batch cannot arrive after this one (FIFO per pair)
                        flags[r] = got[1]
            alive = [flags[r] for r in leaders]
        if any(alive):
            router = Router(len(leaders))
            for e, ok in enumerate(alive):
                if not ok:
                    router.mark_dead(e)
            # Token cost of the step's prompts at their stream positions (the same on every leader, so every leader
            # computes the same split); each engine then takes its count from its own part of the stream.
            costs = [side.source.peek(b * ro.prompts_per_step + i).ids for i in range(ro.prompts_per_step)]
            side.quota = len(split_prompts(costs, ro.n_samples, ro.max_new_tokens, len(leaders), router)[side.e])
        if not healthy:
            self.restart_resynced((RESYNC, b, [], {}), TAG_BATCH, f"batch {b}")
