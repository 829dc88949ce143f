"""The built-in metrics loggers (plugins of kind ``logger``, registered in :mod:`milehpc.builtin.loggers`): the
``metrics.jsonl`` file (read by ``milehpc plot``), TensorBoard, and Weights & Biases.

Every logger gets the same ``(step, {name: float})`` records; the names are in the README's metrics table.
W&B never talks to its server from a rank unless the site partition says its compute nodes have network
(``network = true``): its default mode ``auto`` is offline there, and ``wandb sync RUN_DIR/wandb/offline-run-*``
uploads afterwards from a login node.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milehpc.config.job import wandb_mode
from milehpc.errors import PluginError


@dataclass
class LoggerContext:
    """What a logger is built with on the trainer leader."""

    run_dir: Path
    name: str = "run"  # the job's name
    config: dict[str, Any] = field(default_factory=dict)  # the job spec as a dict (W&B's run config)
    network: bool = False  # the site partition says compute nodes reach the internet
    file: str | None = None  # the job file, for error messages


def record_step(line: str) -> float:
    """The step of one ``metrics.jsonl`` line; a torn last line (a killed run) counts as past every step."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


class JsonlLogger:
    """``RUN_DIR/metrics.jsonl``: one JSON object per step (``step``, ``time`` since start, every metric)."""

    def __init__(self, ctx: LoggerContext) -> None:
        self.path = ctx.run_dir / "metrics.jsonl"
        self.fh = self.path.open("a", encoding="utf-8")
        self.start = time.time()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": round(time.time() - self.start, 3), **metrics}
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()

    def continue_from(self, step: int) -> None:
        """Drop the records of ``step`` and later (rewritten atomically): each step keeps one record."""
        self.fh.close()
        # Each kept record ends its line (a kill between a record and its newline must not glue the next one on).
        kept = [line.rstrip("\n") + "\n" for line in self.path.read_text(encoding="utf-8").splitlines()
                if record_step(line) < step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self.fh = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self.fh.close()


class TensorBoardLogger:
    """``RUN_DIR/tensorboard``: one scalar per metric name and step."""

    def __init__(self, ctx: LoggerContext) -> None:
        self.dir = ctx.run_dir / "tensorboard"
        self.writer = self._writer(None)

    def _writer(self, purge_step: int | None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.dir), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event per step holding every scalar (what add_scalar writes, one event each): ~8x less CPU on the
        # trainer leader, whose step time this is part of.
        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
        self.writer.file_writer.add_summary(Summary(value=values), step)

    def continue_from(self, step: int) -> None:
        self.writer.close()
        # TensorBoard reads the event files in name order and hides the events at or after purge_step of the files
        # read before the one that purges. The name starts with the creation second; within one second it ends with
        # a per-process counter that sorts as text (".10" before ".9"), so the new file waits for a later second.
        seconds = (p.name.split(".")[3] for p in self.dir.glob("events.out.tfevents.*"))
        newest = max((int(s) for s in seconds if s.isdigit()), default=0)
        time.sleep(max(0.0, newest + 1 - time.time()))
        self.writer = self._writer(step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run under ``RUN_DIR/wandb`` with the run's id kept in ``RUN_DIR/wandb/run_id``, so a resumed job
    continues the same run. W&B cannot take back logged steps: after a resume its server keeps the first record
    of each step logged twice (the JSONL file and TensorBoard keep the latest)."""

    def __init__(self, ctx: LoggerContext, *, project: str = "milehpc", entity: str | None = None,
                 mode: str = "auto", group: str | None = None, tags: list[str] | None = None) -> None:
        mode = wandb_mode(mode, ctx.network, file=ctx.file)
        try:
            import wandb
        except ImportError:
            raise PluginError("logger 'wandb' needs the Python package 'wandb', which is not installed "
                              "(pip install 'milehpc[wandb]')", file=ctx.file, field="logging.loggers") from None
        folder = ctx.run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4) + "\n", encoding="utf-8")
        run_id = id_file.read_text(encoding="utf-8").strip()
        # No stats sampler, console capture, git or code probes: the rank logs metrics and nothing else.
        settings = wandb.Settings(mode=mode, console="off", silent=True, x_disable_stats=True,
                                  x_disable_machine_info=True, disable_git=True, save_code=False)
        try:
            self.run = wandb.init(project=project, entity=entity, group=group, tags=tags or None, name=ctx.name,
                                  id=run_id, resume="allow", dir=str(ctx.run_dir), config=ctx.config,
                                  settings=settings)
        except Exception as err:  # noqa: BLE001 - wandb raises many kinds (its service, auth, settings): one line
            text = f"{type(err).__name__}: {err}".splitlines()[0]
            raise PluginError(f"logger 'wandb' could not start its run ({text})", file=ctx.file,
                              field="logging.loggers") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def continue_from(self, step: int) -> None:
        """Nothing to drop (see the class docstring)."""

    def close(self) -> None:
        self.run.finish()
