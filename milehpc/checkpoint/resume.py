"""Where a job's checkpoints live, and ``milehpc submit --resume RUN_DIR`` on the login node (no torch): is this a
run dir, and what will the resubmitted job resume from."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.checkpoint.files import MANIFEST
from milehpc.checkpoint.layout import check_layout, layout_record, reshard_check
from milehpc.checkpoint.manifest import list_checkpoints
from milehpc.errors import ConfigError, MilehpcError

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.plan import Plan


def checkpoint_root(job: JobSpec, run_dir: str | os.PathLike[str]) -> Path:
    """``checkpoint.dir`` (relative paths are relative to the run dir) or ``RUN_DIR/checkpoints``."""
    run_dir = Path(run_dir)
    if job.checkpoint.dir:
        path = Path(os.path.expandvars(os.path.expanduser(job.checkpoint.dir)))
        return path if path.is_absolute() else run_dir / path
    return run_dir / "checkpoints"


def resume_run_dir(run_dir: str | os.PathLike[str], *, job: JobSpec | None = None,
                   plan: Plan | None = None) -> dict[str, Any]:
    """For ``milehpc submit --resume RUN_DIR`` (login node, no torch): check that ``RUN_DIR`` is a milehpc run
    dir and that its newest complete checkpoint fits the layout the job will run with (``job``/``plan`` when the
    caller re-planned it, e.g. ``--set trainer.tp=2``, else the run dir's own job.json/plan.json) or that the
    trainer can reshard it, and say what the resubmitted job will resume from. Returns ``{"run_dir",
    "job_script", "checkpoint" (path or None), "step" (or None), "meta", "resharded" (bool)}``; raises a
    one-line MilehpcError otherwise. The ranks then resume by themselves (``checkpoint.resume``)."""
    from milehpc.config.job import JobSpec
    from milehpc.config.schema import build
    from milehpc.plan import Plan

    run_dir = Path(run_dir).resolve()
    job_json = run_dir / "job.json"
    if not job_json.is_file():
        raise MilehpcError("not a milehpc run dir (no job.json); give the directory `milehpc submit` created",
                           file=str(run_dir))
    try:
        if job is None:
            job = build(JobSpec, json.loads(job_json.read_text(encoding="utf-8")), file=str(job_json))
        if plan is None:
            plan = Plan.from_dict(json.loads((run_dir / "plan.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as err:
        raise MilehpcError(f"cannot read the run's job/plan ({err.__class__.__name__}: {err})",
                           file=str(run_dir)) from None
    if not job.checkpoint.resume:
        raise ConfigError("checkpoint.resume is false in this run's job; set it true to resume",
                          file=str(job_json), field="checkpoint.resume")
    root = checkpoint_root(job, run_dir)
    found = list_checkpoints(root, warn=True)
    out: dict[str, Any] = {"run_dir": str(run_dir), "job_script": str(run_dir / "job.sbatch"),
                           "checkpoint": None, "step": None, "meta": {}, "resharded": False}
    if found:
        newest = found[0]
        resharded = check_layout(newest.manifest.get("layout"), layout_record(job, plan),
                                 where=str(newest.path / MANIFEST), can_reshard=reshard_check(job))
        out.update(checkpoint=str(newest.path), step=newest.step, meta=newest.meta, resharded=resharded)
    return out
