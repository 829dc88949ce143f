"""The sync loop in one process, without MPI or torch.distributed: the reference engine and the torch trainer side by
side, weights loaded in place. For tests, notebooks and benchmarks."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from milehpc.runtime.loop.evaluation import LoopEval, eval_due
from milehpc.runtime.loop.rollout_metrics import rollout_metrics
from milehpc.runtime.loop.rollout_side import RolloutSide
from milehpc.runtime.loop.trainer_side import TrainerSide
from milehpc.samples import samples_of
from milehpc.weights.inplace import load_in_place

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec


def run_local(job: JobSpec, run_dir: str | Path | None = None, *, progress: bool = False,
              on_step: Callable[[int, dict[str, float]], None] | None = None,
              checkpointing: bool = False) -> list[dict[str, float]]:
    """The sync loop in this process. Returns the per-step metrics. With ``checkpointing`` (and a ``run_dir``) it
    resumes from and writes ``run_dir``'s checkpoints like a job does. ``job.run.loop`` must be ``"sync"``
    (:func:`milehpc.config.rules.check_single_process` says so in one line)."""
    from milehpc.config.rules import check_single_process
    from milehpc.data.tokenizer import build_tokenizer
    from milehpc.models import build_model
    from milehpc.rollout.reference import ReferenceEngine
    from milehpc.train.torch_trainer import TorchTrainer

    check_single_process(job)
    random.seed(job.run.seed)
    tok = build_tokenizer(job.model.tokenizer)
    trainer = TorchTrainer(job, tok)
    engine_model = build_model(job.model, tok.vocab_size, seed=job.run.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
    engine = ReferenceEngine(engine_model, tok, seed=job.run.seed * 100_003)
    rollout = RolloutSide(job, engine)
    side = TrainerSide(job, trainer, run_dir=Path(run_dir) if run_dir else None, progress=progress)
    evals = LoopEval.for_job(job, announce=progress, run_dir=run_dir)
    ckpt = None
    if checkpointing and run_dir is not None:
        from milehpc.runtime.loop.checkpointing import LoopCheckpoint

        ckpt = LoopCheckpoint(job, run_dir)
    try:
        if ckpt is not None:
            ckpt.restore(trainer=side, rollout=rollout)
        side.warmup()
        load_in_place(rollout, trainer.export_weights(), trainer.version)
        for step in range(side.state.step, job.run.steps):
            t0 = time.perf_counter()
            groups, stats = rollout.produce()
            metrics = rollout_metrics(stats)
            groups, st = side.filter_stale(groups)
            metrics.update(st)
            metrics.update(side.train(step, samples_of(groups)))
            t1 = time.perf_counter()
            load_in_place(rollout, trainer.export_weights(), trainer.version)
            metrics["time/sync"] = time.perf_counter() - t1
            metrics["time/step"] = time.perf_counter() - t0
            stop = side.target_reached(metrics)  # before report() adds this step to the history it averages
            if evals is not None and eval_due(job, step, stop or step == job.run.steps - 1):
                metrics.update(evals.metrics(step, [evals.share(engine, rollout.state.weight_version)]))
            side.report(step, metrics, groups)
            if on_step is not None:
                on_step(step, metrics)
            if ckpt is not None:
                ckpt.step_done(step, trainer=side, rollout=rollout, final=stop)
            if stop:
                break
    finally:
        side.close()
    return side.history
