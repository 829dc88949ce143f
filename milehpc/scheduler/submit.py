"""Submitting a job: prepare the run directory, then sbatch (Slurm sites) or a detached local run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from milehpc.config.load import job_label
from milehpc.errors import ConfigError
from milehpc.memory import for_job
from milehpc.render.rundir import check_paths, prepare, write_run_dir
from milehpc.scheduler.records import add_record
from milehpc.scheduler.slurm import dependency_args


def submit(job_file: str, site: str, overrides: tuple[str, ...] = (), *, run_dir: str | None = None,
           dry_run: bool = False, resume: str | None = None, after: str | None = None,
           sweep: str | None = None, force: bool | str | None = False) -> dict[str, Any]:
    job = None
    if resume:
        from milehpc.config.load import apply_overrides, job_from_dict

        rdir = Path(resume)
        spec = rdir / "job.json"
        if not spec.is_file():
            raise ConfigError("not a milehpc run directory (no job.json)", file=str(rdir), field="--resume")
        # The run's own resolved spec, plus any --set (e.g. more run.steps or a longer resources.time).
        job = job_from_dict(apply_overrides(json.loads(spec.read_text()), overrides), file=str(spec))
        run_dir = str(rdir)
        job_file = job_file or str(spec)
    if sweep:
        if resume:
            raise ConfigError("a sweep starts new runs; resume each run directory on its own", field="--sweep")
        from milehpc.scheduler.sweep import submit_sweep

        return submit_sweep(job_file, site, overrides, sweep, run_dir=run_dir, dry_run=dry_run, after=after,
                            force=force)
    prep = prepare(job_file, site, overrides, run_dir=run_dir, job=job)
    # A layout whose ranks cannot fit their devices would fail after the queue: refuse it here (--force: submit).
    for_job(prep.job, prep.plan, prep.partition, file=job_label(job_file, overrides), force=force or False)
    result: dict[str, Any] = {"site": prep.site.name, "run_dir": str(prep.run_dir), "plan": prep.plan.summary()}
    extra = dependency_args(after, prep.partition.scheduler)
    if extra:
        result["sbatch_args"] = extra
    if resume:
        from milehpc.checkpoint import resume_run_dir

        # Refuses a checkpoint from an incompatible layout in one line (unless the trainer reshards it), before
        # anything is rewritten; a dry run checks it too.
        found = resume_run_dir(prep.run_dir, job=prep.job, plan=prep.plan)
        result["resume_from"] = {"checkpoint": found["checkpoint"], "step": found["step"],
                                 "resharded": found["resharded"]}
    if dry_run:
        result["script"] = prep.script
        return result
    check_paths(prep.job, job_file)
    rdir = write_run_dir(prep, resume=bool(resume))
    script = rdir / "job.sbatch"
    if prep.partition.scheduler == "local":
        from milehpc.scheduler.local import start_detached

        job_id = start_detached(script, rdir)
    else:
        from milehpc.scheduler.slurm import sbatch

        job_id = sbatch(script, extra=extra)
    add_record(job_id, prep.job.name, prep.site.name, str(rdir), **({"after": after} if after else {}))
    result["job_id"] = job_id
    return result
