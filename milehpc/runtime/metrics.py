"""What a user watches: the job's metrics loggers (plugins: ``metrics.jsonl`` read by ``milehpc plot``, TensorBoard,
Weights & Biases, see :mod:`milehpc.runtime.loggers`) and a terminal progress display (a rich bar on a terminal,
one plain line per step otherwise, e.g. under mpirun or Slurm)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from milehpc.runtime.loggers import LoggerContext, record_step

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec

DEFAULT_LOGGERS = ("jsonl", "tensorboard")

# Shown in the progress line, in this order, when present: (metric key, label, format).
PROGRESS = (("rollout/reward_mean", "reward", "{:.3f}"), ("train/actor/kl", "kl", "{:.4f}"),
            ("perf/tokens_per_s", "tok/s", "{:.0f}"), ("time/step", "step s", "{:.2f}"))


def rich_progress(stream: TextIO) -> bool:
    """A live bar only on a real terminal. Under mpirun a rank's stdout is a pty even when the user's is a file,
    so ``milehpc run`` decides for its ranks through ``MILEHPC_PROGRESS`` (rich | plain)."""
    mode = os.environ.get("MILEHPC_PROGRESS")
    if mode:
        return mode == "rich"
    return stream.isatty() and "OMPI_COMM_WORLD_SIZE" not in os.environ and "SLURM_PROCID" not in os.environ


class MetricsLogger:
    """Rank 0 of the trainer group owns one of these: it hands every step's metrics to each logger plugin of the
    job (the same names and values to all) and draws the progress display."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, loggers: Sequence[str] = DEFAULT_LOGGERS,
                 params: dict[str, dict[str, Any]] | None = None, context: LoggerContext | None = None,
                 progress: bool = True, stream: TextIO | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.backends = build_loggers(context or LoggerContext(self.run_dir), loggers, params or {})
        self.stream = stream or sys.stdout
        self.start = time.time()
        self.first_step: int | None = None
        self.bar = self.task = None
        if progress and rich_progress(self.stream):
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False,
                                auto_refresh=False)
            self.task = self.bar.add_task("rl", total=total_steps, info="", completed=0)
            self.bar.start()
        self.quiet = not progress

    @classmethod
    def for_job(cls, job: JobSpec, run_dir: Path, *, progress: bool = True, file: str | None = None
                ) -> MetricsLogger:
        """The job's ``[logging]`` loggers; W&B may go online only where the run's site partition says the
        nodes have network (``RUN_DIR/site.json``; no site file: no network)."""
        from milehpc.config.schema import to_dict

        site = run_dir / "site.json"
        partition = (json.loads(site.read_text(encoding="utf-8")).get("partition") or {}) if site.is_file() else {}
        ctx = LoggerContext(run_dir, name=job.name, config=to_dict(job), network=bool(partition.get("network")),
                            file=file)
        return cls(run_dir, job.run.steps, loggers=job.logging.loggers, params=job.logging.params, context=ctx,
                   progress=progress)

    def continue_from(self, step: int) -> None:
        """A resumed run logs ``step`` and later again: each logger drops what it can of those records."""
        for backend in self.backends:
            backend.continue_from(step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.first_step is None:
            self.first_step = step
        values = {k: float(v) for k, v in metrics.items()}
        for backend in self.backends:
            backend.log(step, values)
        info = "  ".join(f"{label} {fmt.format(metrics[k])}" for k, label, fmt in PROGRESS if k in metrics)
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, info=info, refresh=True)
        elif not self.quiet:
            done = step + 1 - self.first_step
            elapsed = time.time() - self.start
            eta = elapsed / max(done, 1) * (self.total - step - 1)
            print(f"step {step + 1}/{self.total}  {info}  elapsed {elapsed:.0f}s  eta {eta:.0f}s",
                  file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        for backend in self.backends:
            backend.close()


def build_loggers(ctx: LoggerContext, names: Sequence[str], params: dict[str, dict[str, Any]]) -> list[Any]:
    """One logger per name (a registered ``logger`` plugin), its params checked against its schema."""
    from milehpc import plugins
    from milehpc.config.schema import check_params

    out = []
    for name in dict.fromkeys(names):
        spec = plugins.lookup("logger", name, file=ctx.file, field="logging.loggers")
        values = check_params(spec, params.get(name, {}), file=ctx.file, prefix=f"logging.params.{name}")
        out.append(plugins.load("logger", name, file=ctx.file, field="logging.loggers")(ctx, **values))
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl``, one per step (a resumed run rewrites the file from its step on;
    should an older file hold a step twice, the last record wins; a line torn by a killed run is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        from milehpc.errors import MilehpcError

        raise MilehpcError("no metrics.jsonl in this run directory", file=str(path))
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and record_step(line) != float("inf"):
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def plot_rewards(run_dir: str | Path, out: str | Path | None = None, key: str = "rollout/reward_mean") -> Path:
    """A PNG of the reward curve (per step, and its moving average); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(run_dir) if key in r]
    if not records:
        from milehpc.errors import MilehpcError

        raise MilehpcError(f"no '{key}' values in metrics.jsonl", file=str(Path(run_dir) / "metrics.jsonl"))
    steps = [r["step"] for r in records]
    mean = [r[key] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, mean, alpha=0.35, linewidth=0.8, label=f"{key} (per step)")
    window = max(1, min(10, len(mean) // 5))
    smooth = [sum(mean[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(mean))]
    ax.plot(steps, smooth, linewidth=2.0, label=f"mean of last {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path = Path(out) if out else Path(run_dir) / "reward.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
