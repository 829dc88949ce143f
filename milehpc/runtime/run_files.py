"""A run directory's files as the ranks read them (``job.json``, ``plan.json``, ``site.json``): shared by every rank's
entry (:mod:`milehpc.runtime.launch`) and an elastic engine's process (:mod:`milehpc.runtime.elastic.engine`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import ConfigError

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.plan import Plan


def load_run_dir(run_dir: str | os.PathLike[str]) -> tuple[JobSpec, Plan, dict[str, Any]]:
    """The job spec, the plan and the site partition (empty if there is no site.json) of a run directory."""
    from milehpc.config.load import read_run_json, run_job
    from milehpc.plan import Plan

    rdir = Path(run_dir)
    job = run_job(rdir)
    raw = read_run_json(rdir / "plan.json")
    try:
        plan = Plan.from_dict(raw)
    except TypeError as err:
        raise ConfigError(f"not a plan written by this milehpc version ({err})", file=str(rdir / "plan.json")) from None
    partition: dict[str, Any] = {}
    if (rdir / "site.json").exists():
        partition = dict(read_run_json(rdir / "site.json").get("partition") or {})
    return job, plan, partition
