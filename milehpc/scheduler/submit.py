"""Submitting a job: prepare the run directory, then sbatch (Slurm sites) or a detached local run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError
from milehpc.render.rundir import check_paths, prepare, write_run_dir
from milehpc.scheduler.records import add_record


def submit(job_file: str, site: str, overrides: tuple[str, ...] = (), *, run_dir: str | None = None,
           dry_run: bool = False, resume: str | None = None, after: str | None = None,
           sweep: str | None = None) -> dict[str, Any]:
    job = None
    if resume:
        from milehpc.config.load import job_from_dict

        rdir = Path(resume)
        spec = rdir / "job.json"
        if not spec.is_file():
            raise ConfigError("not a milehpc run directory (no job.json)", file=str(rdir), field="--resume")
        job = job_from_dict(json.loads(spec.read_text()), file=str(spec))
        run_dir = str(rdir)
    prep = prepare(job_file, site, overrides, run_dir=run_dir, job=job)
    result: dict[str, Any] = {"site": prep.site.name, "run_dir": str(prep.run_dir), "plan": prep.plan.summary()}
    if dry_run:
        result["script"] = prep.script
        return result
    if sweep or after:
        raise ConfigError("--sweep and --after need the Slurm lifecycle support", field="--sweep")
    check_paths(prep.job, job_file)
    rdir = write_run_dir(prep, resume=bool(resume))
    script = rdir / "job.sbatch"
    if prep.partition.scheduler == "local":
        from milehpc.scheduler.local import start_detached

        job_id = start_detached(script, rdir)
    else:
        from milehpc.scheduler.slurm import sbatch

        job_id = sbatch(script)
    add_record(job_id, prep.job.name, prep.site.name, str(rdir))
    result["job_id"] = job_id
    return result
