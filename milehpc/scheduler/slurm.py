"""The Slurm client: sbatch (and later status/logs/cancel), by subprocess with argv lists (never a shell)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from milehpc.errors import SchedulerError

_JOB_ID = re.compile(r"^(\d+)(;\S+)?$")


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise SchedulerError(f"'{tool}' not found: Slurm is not available on this machine (use --site local, "
                             "or run on a login node of the site)")
    return path


def sbatch(script: Path, *, extra: list[str] | None = None, test_only: bool = False,
           timeout: float = 60.0) -> str:
    """Submit ``script``; returns the job id (or sbatch's --test-only answer)."""
    argv = [_require("sbatch"), "--parsable", *(extra or [])]
    if test_only:
        argv.append("--test-only")
    argv.append(str(script))
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"sbatch did not answer within {timeout:.0f} s (is slurmctld up?)") from None
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()[-1]
        raise SchedulerError(f"sbatch refused the job: {msg}")
    if test_only:
        return proc.stderr.strip()
    match = _JOB_ID.match(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "")
    if not match:
        raise SchedulerError(f"could not read a job id from sbatch's answer {proc.stdout.strip()!r}")
    return match.group(1)
