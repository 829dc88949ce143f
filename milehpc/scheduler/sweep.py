"""``milehpc submit --sweep KEY=V1,V2,...``: one run directory per value, submitted as one Slurm job array.

Layout: ``BASE/sweep-<i>/`` is a complete run directory (job.json, plan.json, job.sbatch, logs/) for value i;
``BASE/sweep.sbatch`` is the array script, which runs ``BASE/sweep-$SLURM_ARRAY_TASK_ID/job.sbatch``;
``BASE/sweep.json`` lists the key, the values and the run directories. Every element must ask Slurm for the same
resources (a job array has one request); a swept key that changes them is refused with one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from milehpc.config.load import load_job
from milehpc.errors import ConfigError
from milehpc.render.rundir import Prepared, check_paths, default_run_dir, prepare, write_run_dir
from milehpc.scheduler.records import add_record
from milehpc.scheduler.slurm import dependency_args

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*")


def parse_sweep(sweep: str) -> tuple[str, list[str]]:
    key, sep, values = sweep.partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise ConfigError(f"expected KEY.PATH=V1,V2,..., got {sweep!r}", field="--sweep")
    vals = [v.strip() for v in values.split(",")]
    if not vals or any(not v for v in vals):
        raise ConfigError(f"expected comma-separated non-empty values after '{key}=', got {values!r}",
                          field="--sweep")
    if len(set(vals)) != len(vals):
        raise ConfigError(f"expected distinct values, got {values!r}", field="--sweep")
    return key, vals


def _sbatch_lines(script: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]


def _shared_options(key: str, values: list[str], preps: list[Prepared]) -> list[str]:
    """The #SBATCH options of the elements without their --output; they must be the same for all."""
    shared = None
    for value, prep in zip(values, preps, strict=True):
        opts = [o for o in _sbatch_lines(prep.script) if not o.startswith("--output=")]
        if shared is None:
            shared = opts
        elif opts != shared:
            diff = next((b for a, b in zip(shared, opts, strict=False) if a != b), None) or "its options"
            raise ConfigError(f"{key}={value} changes the Slurm request ({diff}); a job array asks once for "
                              "all its elements: submit such values as separate jobs", field="--sweep")
    return shared or []


def submit_sweep(job_file: str, site: str, overrides: tuple[str, ...], sweep: str, *, run_dir: str | None,
                 dry_run: bool = False, after: str | None = None, force: bool | str | None = False) -> dict[str, Any]:
    from milehpc.render.script import template_environment

    key, values = parse_sweep(sweep)
    base = Path(run_dir).expanduser().absolute() if run_dir else default_run_dir(load_job(job_file, overrides))
    preps = [prepare(job_file, site, (*overrides, f"{key}={v}"), run_dir=str(base / f"sweep-{i}"))
             for i, v in enumerate(values)]
    from milehpc.memory import for_job

    for prep, value in zip(preps, values, strict=True):  # every value's layout must fit its devices (--force: submit)
        for_job(prep.job, prep.plan, prep.partition, file=f"{job_file} (with --sweep {key}={value})", force=force or False)
    first = preps[0]
    if first.partition.scheduler != "slurm":
        raise ConfigError(f"--sweep runs a Slurm job array; site '{first.site.name}' has no scheduler (loop over "
                          "`milehpc submit --set` instead)", field="--sweep")
    extra = dependency_args(after, "slurm")
    script = template_environment().get_template("sweep.sbatch.j2").render(
        name=first.job.name, site=first.site.name, key=key, values=values,
        runs=[str(p.run_dir) for p in preps], base=str(base),
        sbatch_options=_shared_options(key, values, preps))
    result: dict[str, Any] = {"site": first.site.name, "run_dir": str(base), "plan": first.plan.summary(),
                              "sweep": {"key": key, "values": values, "run_dirs": [str(p.run_dir) for p in preps]}}
    if extra:
        result["sbatch_args"] = extra
    if dry_run:
        result["script"] = script
        return result
    if base.exists() and any(base.iterdir()):
        raise ConfigError(f"run directory {base} already exists and is not empty (choose another run.run_dir "
                          "or --run-dir)", field="run.run_dir")
    for prep in preps:
        check_paths(prep.job, job_file)
        write_run_dir(prep)
    array_script = base / "sweep.sbatch"
    array_script.write_text(script, encoding="utf-8")
    array_script.chmod(0o700)
    (base / "sweep.json").write_text(json.dumps(result["sweep"], indent=2) + "\n", encoding="utf-8")
    from milehpc.scheduler.slurm import sbatch

    job_id = sbatch(array_script, extra=extra)
    add_record(job_id, first.job.name, first.site.name, str(base), sweep=result["sweep"],
               **({"after": after} if after else {}))
    result["job_id"] = job_id
    return result
