"""The reward-model group (``[reward_model]`` ranks of their own): the hand-off between the rollout engine leaders and
the reward ranks, both ends.

* :class:`RewardClient` (a rollout engine leader): a step's prompts are generated in ``reward_model.chunks`` parts;
  each part's finished samples go to this engine's reward rank as soon as they are generated (a nonblocking send)
  and the next part is generated while they are scored. The leader then waits for the last scores, so a batch
  leaves for the trainer fully scored — and nothing is pending with the reward rank between generations.
* :class:`RewardRank` (a reward rank): takes the requests of every rollout leader it serves as they come, scores them
  in batches of up to ``reward_model.batch_size`` samples across rollout ranks (:mod:`milehpc.rollout.scorer_process`: a
  supervised scorer process; dead or stalled scorers are restarted, their samples scored again or dropped and
  counted, never scored 0), and answers each request once all its samples are scored.

Messages (over ``comms.ctrl``, nonblocking sends through the loop's :class:`~.protocol.Mailbox`):

=============  ==============================  ======================================================================
tag            direction                       messages
=============  ==============================  ======================================================================
TAG_SCORE      engine leader → reward rank     ``(SCORE, step, id, samples)``; ``(CHECKPOINT, step, -1, [])`` as the
                                               leader joins the checkpoint after ``step`` steps; ``(BYE, step, -1,
                                               [])`` after its last batch
TAG_SCORED     reward rank → engine leader     ``(id, [Scored, ...], restarts)``: one outcome per sample, in order
=============  ==============================  ======================================================================

Checkpoints (issue 35 item 4): the scorer's pending work is **drained at the step boundary**. A rollout leader takes
a checkpoint notice only between generations, when every request it sent has been answered; it tells its reward
rank so (``CHECKPOINT``) before it joins the save, and the reward rank, told by trainer rank 0 like the rollout
ranks, joins the save only once each leader it serves has — answering their requests until then. So a checkpoint
holds no scoring in flight: every sample of a saved batch is scored (in the rollout outbox) and every sample
generated after it is scored after the resume, once.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure
from milehpc.runtime.loop.protocol import BYE, CHECKPOINT, STOP, TAG_NOTICE, Mailbox
from milehpc.samples import Status

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.rollout.scorer_process import Scored
    from milehpc.runtime.loop.checkpointing import LoopCheckpoint
    from milehpc.runtime.loop.rollout_side import RolloutSide
    from milehpc.samples import Group, Sample

TAG_SCORE, TAG_SCORED = 32107, 32108
SCORE = "score"


class RewardClient:
    """A rollout engine leader's end of the hand-off (see the module docstring)."""

    def __init__(self, box: Mailbox, reward_rank: int, chunks: int) -> None:
        self.box, self.dest, self.chunks = box, reward_rank, chunks
        self.pending: dict[int, list[Sample]] = {}
        self.next_id = 0

    def generate_and_score(self, side: RolloutSide, prompts: list[Any], stats: dict[str, float]) -> list[Group]:
        """``side``'s groups for ``prompts``, generated in parts, each part scored on the reward rank while the
        next one generates. Partial rollouts generate in one part (a part would continue the others' carry)."""
        parts = 1 if side.job.rollout.partial_rollout else max(1, min(self.chunks, len(prompts)))
        size = math.ceil(len(prompts) / parts) if prompts else 0
        finished: list[Group] = []
        for start in range(0, max(len(prompts), 1), max(size, 1)):
            t0 = time.perf_counter()
            groups = side._generate(prompts[start:start + size] if size else [], stats)
            stats["time_gen"] += time.perf_counter() - t0
            self.submit(side.state.step, [s for g in groups for s in g
                                          if s.reward is None and s.status is not Status.FAILED])
            finished += groups
        t0 = time.perf_counter()
        self.collect(stats, f"scores of batch {side.state.step}")
        stats["time_reward"] += time.perf_counter() - t0  # only the wait after the last part: the rest overlapped
        return finished

    def submit(self, step: int, samples: list[Sample]) -> None:
        if not samples:
            return
        self.pending[self.next_id] = samples
        self.box.send((SCORE, step, self.next_id, samples), self.dest, TAG_SCORE,
                      f"{len(samples)} sample(s) of batch {step} to reward rank {self.dest}")
        self.next_id += 1

    def collect(self, stats: dict[str, float], what: str) -> None:
        """Wait for every pending request's outcomes and set them on the samples; count the reward's failures."""
        while self.pending:
            rid, outcomes, restarts = self.box.recv(self.dest, TAG_SCORED, f"waiting for the {what}")
            samples = self.pending.pop(rid)
            if len(outcomes) != len(samples):
                raise RuntimeFailure(f"reward rank {self.dest} answered {len(outcomes)} outcome(s) for request {rid} "
                                     f"of {len(samples)} sample(s)")
            for sample, outcome in zip(samples, outcomes, strict=True):
                outcome.apply(sample)
                stats["reward_failed"] = stats.get("reward_failed", 0.0) + (outcome.reward is None)
                stats["reward_dropped"] = stats.get("reward_dropped", 0.0) + outcome.dropped
                stats["reward_rescored"] = stats.get("reward_rescored", 0.0) + (outcome.tries > 1)
            stats["reward_restarts"] = stats.get("reward_restarts", 0.0) + restarts

    def at_checkpoint(self, step: int) -> None:
        """The leader joins the checkpoint after ``step`` steps: nothing may be pending (the drain guarantee)."""
        if self.pending:
            raise RuntimeFailure(f"checkpoint after step {step} with {len(self.pending)} scoring request(s) pending")
        self.box.send((CHECKPOINT, step, -1, []), self.dest, TAG_SCORE, f"checkpoint mark to reward rank {self.dest}")

    def bye(self, step: int) -> None:
        self.box.send((BYE, step, -1, []), self.dest, TAG_SCORE, f"end of scoring to reward rank {self.dest}")


@dataclass
class _Request:
    src: int
    rid: int
    step: int
    samples: list[Sample]
    outcomes: list[Scored | None] = field(default_factory=list)
    restarts: int = 0

    def __post_init__(self) -> None:
        self.outcomes = [None] * len(self.samples)


class RewardRank:
    """One reward rank (see the module docstring). Its engine's first rank runs the scorer; the others take part in
    checkpoints and the end only."""

    def __init__(self, ctx: RunContext, checkpointing: LoopCheckpoint) -> None:
        self.job, self.comms, self.plan = ctx.job, ctx.comms, ctx.plan
        self.ckpt = checkpointing
        self.box = Mailbox(self.comms)
        rank = self.comms.rank
        e, er = self.plan.reward_engine_of(rank)
        self.name = f"reward rank {rank} (reward engine {e})"
        leaders = self.plan.engine_leaders()
        self.clients = [r for i, r in enumerate(leaders) if er == 0 and self.plan.reward_leader_for(i) == rank]
        self.scorer = None
        if self.clients:
            from milehpc.data.source import task_reward_name
            from milehpc.rollout.scorer_process import SupervisedScorer

            self.scorer = SupervisedScorer(self.job.reward_model, self.job.reward, task_reward_name(self.job.data) or None,
                                           name=self.name, file=str(ctx.run_dir / "job.toml"),
                                           start_timeout=self.job.resources.startup_timeout_s)
        size = self.comms.reward.Get_size() if self.comms.reward is not None else 0
        print(f"milehpc: {self.name}: reward group of {size} rank(s), scoring for rollout engine leader(s) "
              f"{self.clients or 'none'}", flush=True)
        self.queue: deque[_Request] = deque()
        self.marks: dict[int, set[int]] = {}  # checkpoint step -> the leaders that reached it
        self.gone: set[int] = set()  # leaders that said bye
        self.scored = self.calls = self.mixed = 0  # samples, scorer calls, calls holding several rollout ranks'

    def run(self) -> None:
        self.ckpt.restore()
        try:
            while True:
                notice = self.box.poll(0, TAG_NOTICE)
                if notice is not None:
                    kind, arg = notice[0]
                    if kind == STOP:
                        self.serve_until(lambda: self.gone >= set(self.clients), "the rollout leaders' last batches")
                        break
                    if kind == CHECKPOINT:
                        done = int(arg["step"])
                        self.serve_until(lambda d=done: self.marks.get(d, set()) >= set(self.clients) - self.gone,
                                         f"the rollout leaders at the checkpoint after step {done}")
                        self.ckpt.save(done, trainer=None, rollout=None, stop=bool(arg["stop"]))
                        self.marks.pop(done, None)
                    continue  # weight notices are not for the reward ranks
                if not self.step():
                    time.sleep(0.002)  # idle: poll again shortly (as Comms.poll does)
            self.box.flush()
            if self.scorer is not None:
                print(f"milehpc: {self.name}: scored {self.scored} sample(s) in {self.calls} call(s), {self.mixed} of "
                      f"them across rollout ranks; {self.scorer.restarts} scorer restart(s)", flush=True)
        finally:
            if self.scorer is not None:
                self.scorer.shutdown()

    def serve_until(self, done: Callable[[], bool], what: str) -> None:
        """Serve requests until ``done()`` (with the comms' deadline)."""
        def probe() -> tuple[bool] | None:
            self.step()
            return (True,) if done() else None

        self.box.wait(probe, f"{self.name} waiting for {what}", self.clients)

    def step(self) -> bool:
        """Take what arrived; score one batch if any is queued. True when something happened."""
        busy = self.take()
        if self.queue:
            self.score_batch()
            busy = True
        return busy

    def take(self) -> bool:
        got = False
        for src in self.clients:
            while (msg := self.box.poll(src, TAG_SCORE)) is not None:
                got = True
                kind, step, rid, samples = msg[0]
                if kind == SCORE:
                    self.queue.append(_Request(src, rid, step, samples))
                elif kind == CHECKPOINT:
                    self.marks.setdefault(int(step), set()).add(src)
                elif kind == BYE:
                    self.gone.add(src)
        return got

    def score_batch(self) -> None:
        """Up to ``batch_size`` of the queued samples, oldest first and across rollout ranks, in one scorer call."""
        assert self.scorer is not None
        room = self.job.reward_model.batch_size
        picked: list[tuple[_Request, int]] = []
        for req in self.queue:
            for i, o in enumerate(req.outcomes):
                if o is None and len(picked) < room:
                    picked.append((req, i))
        restarts = self.scorer.restarts
        outcomes = self.scorer.score([r.samples[i] for r, i in picked], min(r.step for r, _ in picked))
        picked[0][0].restarts += self.scorer.restarts - restarts  # counted once, with the batch's first request
        for (req, i), outcome in zip(picked, outcomes, strict=True):
            req.outcomes[i] = outcome
        self.scored += len(picked)
        self.calls += 1
        self.mixed += len({r.src for r, _ in picked}) > 1
        while self.queue and all(o is not None for o in self.queue[0].outcomes):
            req = self.queue.popleft()
            self.box.send((req.rid, req.outcomes, req.restarts), req.src, TAG_SCORED,
                          f"scores of request {req.rid} to rank {req.src}")
