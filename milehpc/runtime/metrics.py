"""What a user watches: TensorBoard scalars, a ``metrics.jsonl`` log (read by ``milehpc plot``), and a terminal
progress display (a rich bar on a terminal, one plain line per step otherwise, e.g. under mpirun or Slurm)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

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
    """Rank 0 of the trainer group owns one of these."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, tensorboard: bool = True, progress: bool = True,
                 stream: TextIO | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self.tensorboard = tensorboard
        self.writer = self._tensorboard_writer(None)
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

    def _tensorboard_writer(self, purge_step: int | None) -> Any:
        if not self.tensorboard:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def continue_from(self, step: int) -> None:
        """A resumed run logs ``step`` and later again: drop those records from ``metrics.jsonl`` (rewritten
        atomically) and have TensorBoard purge its events from ``step`` on, so every step has one record."""
        path = self.run_dir / "metrics.jsonl"
        self.jsonl.close()
        # Each kept record ends its line (a kill between a record and its newline must not glue the next one on).
        kept = [line.rstrip("\n") + "\n" for line in path.read_text(encoding="utf-8").splitlines()
                if _record_step(line) < step]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
        self.jsonl = path.open("a", encoding="utf-8")
        if self.writer is not None:
            self.writer.close()
            # TensorBoard hides this run's events at or after purge_step that an earlier file holds.
            self.writer = self._tensorboard_writer(step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.first_step is None:
            self.first_step = step
        record = {"step": step, "time": round(time.time() - self.start, 3),
                  **{k: float(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, float(value), step)
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
        if self.writer is not None:
            self.writer.close()
        self.jsonl.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl``, one per step (a resumed run rewrites the file from its step on;
    should an older file hold a step twice, the last record wins; a line torn by a killed run is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        from milehpc.errors import MilehpcError

        raise MilehpcError("no metrics.jsonl in this run directory", file=str(path))
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and _record_step(line) != float("inf"):
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


def _record_step(line: str) -> float:
    """The step of one ``metrics.jsonl`` line; a torn last line (a killed run) counts as past every step."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")
