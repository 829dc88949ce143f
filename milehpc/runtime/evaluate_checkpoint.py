"""``milehpc eval``: one checkpoint of a run evaluated after the fact, in one process — its policy weights loaded into
the job's reference engine (CPU here; a GPU where there is one), the prompts of a file answered with the job's
``[eval]`` settings (options may override them), scored with the job's reward routing, and the result written to
``RUN_DIR/eval/step_<N>.json``. The same :class:`~milehpc.rollout.evaluate.Evaluator` as the loop's, with the same
batches and seeds: a checkpoint's numbers equal the loop's evaluation of that step on the same prompts.

``N`` is the checkpoint's step (steps done, the ``step-N`` folder); the loop logged the same weights' evaluation at
metrics step ``N - 1``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError

REFERENCE_ENGINES = ("reference", "reference_process")


@dataclass
class EvalReport:
    path: Path  # the JSON file written
    step: int  # the checkpoint's step
    metrics: dict[str, float]
    sources: list[str]  # the prompts' data sources
    notes: list[str]


def eval_path(run_dir: Path, step: int, adapter: str | None = None) -> Path:
    return run_dir / "eval" / (f"step_{step}.json" if adapter is None else f"step_{step}.{adapter}.json")


def evaluate_checkpoint(run_dir: str | Path, data: str | Path, *, step: int | None = None,
                        overrides: dict[str, Any] | None = None, force: bool = False,
                        adapter: str | None = None) -> EvalReport:
    """Evaluate checkpoint ``step`` (default: the newest) of the run in ``run_dir`` on the prompts of ``data``.
    ``overrides``: ``[eval]`` fields (``n_samples``, ``pass_k``, ...) for this evaluation only. A multi-LoRA run:
    the policy of ``adapter`` (required there), scored with that adapter's reward."""
    from milehpc.config.job import EvalSpec
    from milehpc.config.schema import build, to_dict
    from milehpc.export.run import policy_weights
    from milehpc.export.source import load_source
    from milehpc.rollout.evaluate import Evaluator, results_to_json
    from milehpc.rollout.reference import build_engine

    run_dir = Path(run_dir)
    source = load_source(run_dir, step)
    step = source.info.step
    job = source.job
    adapters = list(job.trainer.lora.adapters) if job.trainer.lora is not None else []
    if adapters and adapter not in adapters:
        raise ConfigError(f"a multi-LoRA run has one policy per adapter: expected --adapter one of {', '.join(adapters)}"
                          f", got {adapter or 'none'}", field="--adapter")
    if adapter is not None and not adapters:
        raise ConfigError(f"--adapter names one adapter of a multi-LoRA run; this run trains "
                          f"{'one adapter' if job.trainer.lora is not None else 'the whole model'}", field="--adapter")
    out = eval_path(run_dir, step, adapter)
    if out.exists() and not force:
        raise ConfigError("an evaluation of this step is there already: expected --force to replace it",
                          file=str(out))
    spec = build(EvalSpec, {**to_dict(job.eval), **(overrides or {})}, prefix="eval")
    if str(data).startswith("task:") and spec.max_prompts == 0:  # as the loop's rule: a generated task has no end
        raise ConfigError(f"a generated task ({data}) has no end: expected --max-prompts N > 0 (or eval.max_prompts "
                          "in the job), got 0", field="--max-prompts")
    job = replace(job, eval=spec)
    if adapter is not None:  # the file as this adapter's held-out prompts (the others' kept, unread: same seeds)
        lora = job.trainer.lora
        assert lora is not None
        named = {n: replace(a, val_source=str(data) if n == adapter else "") for n, a in lora.adapters.items()}
        job = replace(job, trainer=replace(job.trainer, lora=replace(lora, adapters=named)))
    notes = []
    if job.rollout.engine not in REFERENCE_ENGINES:
        notes.append(f"the job's engine is {job.rollout.engine!r}: evaluating with the reference engine (same "
                     "weights, sampling and seeds) in this process")
    engine = build_engine(job)
    engine.update_weights(policy_weights(source, adapter).items(), source.weight_version)
    evaluator = Evaluator(job, engine.tokenizer, data=str(data))
    results = evaluator.run(engine)
    metrics = {**evaluator.metrics(results), "eval/weight_version": float(source.weight_version)}
    record = {"format": 1, "run_dir": str(run_dir.resolve()), "step": step, "metric_step": step - 1,
              "weight_version": source.weight_version, "checkpoint": str(source.info.path.resolve()),
              "data": str(Path(data).resolve()), "adapter": adapter, "engine": "reference", "eval": to_dict(spec),
              "metrics": metrics, "results": results_to_json(results)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out)  # a killed eval leaves no half-written result
    return EvalReport(out, step, metrics, sorted({r.source for r in results}), notes)


def metrics_table(metrics: dict[str, float], sources: list[str]) -> list[tuple[str, str, str, str, str]]:
    """Rows (source, prompts, acc, pass@k..., mean reward) for printing: one per data source, then ``all``."""
    rows = []
    for name, prefix in [*((s, f"eval/{s}/") for s in sources), ("all", "eval/")]:
        passes = "  ".join(f"{k.removeprefix(prefix)} {v:.3f}" for k, v in sorted(metrics.items())
                           if k.startswith(prefix + "pass@"))
        acc = metrics.get(prefix + "acc")
        rows.append((name, f"{metrics.get(prefix + 'prompts', 0):.0f}", "-" if acc is None else f"{acc:.3f}",
                     passes or "-", f"{metrics.get(prefix + 'reward_mean', 0.0):.3f}"))
    return rows
