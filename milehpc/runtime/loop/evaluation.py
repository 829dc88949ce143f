"""The loop's evaluation hook: every ``run.eval_every`` steps and after the last one, the rollout side answers the
validation prompts with the step's new weights (:class:`milehpc.rollout.evaluate.Evaluator`) and the trainer
leader logs ``eval/*`` with that step's metrics and writes the answers to ``RUN_DIR/evals/step_NNNNNNNN.jsonl``
(``NNNNNNNN``: the metrics step; one line per prompt, :func:`~milehpc.rollout.evaluate.answer_rows`).

Where it runs in each layout: *local* and *colocated* right after the step's weights are loaded into the engines
(colocated: every rank its share, gathered to rank 0); *separate groups*: the trainer sends that step's weights
with an evaluation order (``(EVAL_WEIGHTS, (version, step))``, also after the last step, whose weights no batch
needs), each engine leader evaluates when it takes them — between generations, as for every weight notice — and
sends its results to trainer rank 0, which waits for them before it reports the step. The evaluation samples from
its own seeds, so the training stream is the same with and without it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from milehpc.rollout.evaluate import PromptResult, answer_rows, merge_results, spec_metrics

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.rollout.engine import Engine
    from milehpc.rollout.evaluate import Evaluator


def eval_due(job: JobSpec, step: int, last: bool) -> bool:
    """Evaluate after step ``step`` (0-based): every ``run.eval_every`` steps, and after the last one."""
    every = job.run.eval_every
    return every > 0 and ((step + 1) % every == 0 or last)


def answers_path(run_dir: str | Path, step: int) -> Path:
    """The answers of the evaluation logged at metrics step ``step``."""
    return Path(run_dir) / "evals" / f"step_{step:08d}.jsonl"


def write_answers(run_dir: str | Path, step: int, results: Sequence[PromptResult], weight_version: int) -> Path:
    """``RUN_DIR/evals/step_NNNNNNNN.jsonl``, written whole or not at all (tmp + rename: a killed job leaves no
    half file, and a resumed run that repeats the step replaces it)."""
    path = answers_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    rows = answer_rows(results, step=step, weight_version=weight_version)
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


@dataclass
class EvalShare:
    """One engine's part of an evaluation (a message from an engine leader to trainer rank 0)."""

    results: list[PromptResult]
    seconds: float
    version: int  # the weights it answered with


class LoopEval:
    """One rank's part of the loop's evaluation (built only where ``run.eval_every > 0``): the engine ranks answer
    (``evaluator``), the trainer leader turns everyone's results into metrics (it needs no evaluator) and, given a
    ``run_dir``, writes their answers there."""

    def __init__(self, job: JobSpec, evaluator: Evaluator | None = None, run_dir: str | Path | None = None) -> None:
        self.job, self.evaluator, self.run_dir = job, evaluator, run_dir

    @classmethod
    def for_job(cls, job: JobSpec, *, file: str | None = None, answers: bool = True, announce: bool = False,
                run_dir: str | Path | None = None) -> LoopEval | None:
        """None without ``run.eval_every``; ``answers``: this rank's engine evaluates (reads the prompts);
        ``run_dir``: where :meth:`metrics` writes the answers (the trainer leader's; None: nowhere)."""
        if job.run.eval_every <= 0:
            return None
        if not answers:
            return cls(job, run_dir=run_dir)
        from milehpc.data.tokenizer import build_tokenizer
        from milehpc.rollout.evaluate import Evaluator

        evaluator = Evaluator(job, build_tokenizer(job.model.tokenizer), file=file)
        if announce:
            print(evaluator.summary, flush=True)
        return cls(job, evaluator, run_dir)

    def share(self, engine: Engine, version: int, *, engine_index: int = 0, num_engines: int = 1) -> EvalShare:
        """This engine's results with its weights of ``version``, and the seconds they took."""
        assert self.evaluator is not None, "built with answers=False"
        t0 = time.perf_counter()
        results = self.evaluator.run(engine, engine_index=engine_index, num_engines=num_engines)
        return EvalShare(results, time.perf_counter() - t0, version)

    def metrics(self, step: int, parts: Sequence[EvalShare]) -> dict[str, float]:
        """Metrics step ``step``'s ``eval/*`` metrics from every engine's share, ``eval/weight_version`` (the weights
        evaluated: the oldest any engine held, which is every engine's) and ``time/eval`` (the slowest engine); the
        answers go to :func:`answers_path` when there is a ``run_dir``."""
        results = merge_results([p.results for p in parts])
        version = min(p.version for p in parts)
        out = spec_metrics(self.job.eval, results)
        out["eval/weight_version"] = float(version)
        out["time/eval"] = max(p.seconds for p in parts)
        if self.run_dir is not None:
            write_answers(self.run_dir, step, results, version)
        return out
