"""The scorer of a reward rank (``[reward_model]``): the job's ``[reward]`` in a supervised child process.

:class:`ScorerWorker` runs in the child (started by :class:`milehpc.rollout.supervisor.ProcessEngine`, as an engine
is): it builds the job's reward scorer and scores what it is handed. :class:`SupervisedScorer`, on the reward rank,
hands it one batch at a time. A scorer that dies (killed, out of memory) or stalls past ``reward_model.timeout_s`` is
reported by name (rank, pid, what happened), killed and restarted, and the batch is scored again, up to
``reward_model.retries`` times; then its samples are **dropped**: FAILED with ``reward_error`` saying why, counted,
left out of the loss — never scored 0. A sample the scorer itself fails (the RM's forward pass, a judge answer that
does not parse) comes back FAILED the same way (:mod:`milehpc.rewards.api`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from milehpc.errors import RuntimeFailure
from milehpc.samples import Sample, Status

if TYPE_CHECKING:
    from milehpc.config.job import RewardSpec
    from milehpc.config.reward_model import RewardModelSpec

WORKER = "milehpc.rollout.scorer_process:ScorerWorker"


@dataclass(frozen=True)
class Scored:
    """One sample's outcome, sent back to its rollout rank: the reward, or why it failed (``reward`` None)."""

    reward: float | dict[str, float] | None
    error: str = ""
    tries: int = 1  # scorer calls it took (> 1: scored again after its scorer died or stalled)
    dropped: bool = False  # failed because its scorer died or stalled on every try

    def apply(self, sample: Sample) -> None:
        """Set this outcome on ``sample`` (the rollout rank's own copy)."""
        if self.reward is None:
            sample.status = Status.FAILED
            sample.reward = None
            sample.metadata["reward_error"] = self.error
        else:
            sample.reward = self.reward


class ScorerWorker:
    """In the child process: the job's reward scorer (:func:`milehpc.rewards.routing.reward_scorer`)."""

    def __init__(self, reward: RewardSpec, task_reward: str | None = None, file: str | None = None) -> None:
        from milehpc.rewards.routing import reward_scorer

        self.scorer = reward_scorer(reward, task_reward, file=file)
        # One throw-away sample scored now, so the model loads at start-up (under the start-up limit), not in the
        # first step's call (under reward_model.timeout_s). Its outcome, a score or a failure, is discarded.
        self.scorer.score([Sample(prompt_ids=[], prompt_text="warm-up", response_text="warm-up", label="")])

    def score(self, samples: list[Sample]) -> list[Scored]:
        self.scorer.score(samples)
        return [Scored(s.reward) if s.status is not Status.FAILED
                else Scored(None, str(s.metadata.get("reward_error", "the reward failed"))) for s in samples]


class SupervisedScorer:
    """The reward rank's handle on its scorer process (see the module docstring)."""

    def __init__(self, spec: RewardModelSpec, reward: RewardSpec, task_reward: str | None, *, name: str,
                 file: str | None = None, start_timeout: float = 600.0) -> None:
        from milehpc.rollout.supervisor import ProcessEngine

        self.spec, self.name = spec, name
        self.proc = ProcessEngine(WORKER, {"reward": reward, "task_reward": task_reward, "file": file},
                                  start_timeout=start_timeout, call_timeout=spec.timeout_s)
        self.restarts = 0
        self.kill_at: int | None = None  # fault injection (milehpc.faults "scorer"): the step whose batch kills it

    def score(self, samples: Sequence[Sample], step: int = -1) -> list[Scored]:
        """One outcome per sample; the scorer restarted and the batch scored again when the scorer dies or stalls."""
        from milehpc.faults import armed
        from milehpc.rollout.supervisor import EngineDied

        tries = self.spec.retries + 1
        why = ""
        for attempt in range(1, tries + 1):
            if armed("scorer", step) and self.kill_at is None:
                self.kill_at = step
                self.proc.after_send = self._kill_once
            try:
                return [Scored(o.reward, o.error, attempt) for o in self.proc.call("score", list(samples))]
            except (EngineDied, RuntimeFailure) as err:
                why = str(err)
            left = "scoring them again" if attempt < tries else f"dropping them (reward_model.retries = {tries - 1})"
            print(f"milehpc: {self.name}: scorer failed on {len(samples)} sample(s) of step {step}: {why}; restarting "
                  f"it and {left}", flush=True)
            self.proc.restart()
            self.restarts += 1
        error = f"reward scorer ({self.name}) failed {tries} time(s): {why}"[:500]
        return [Scored(None, error, tries, dropped=True)] * len(samples)

    def _kill_once(self, method: str) -> None:
        self.proc.after_send = None
        if self.proc.pid:
            os.kill(self.proc.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        self.proc.shutdown()
