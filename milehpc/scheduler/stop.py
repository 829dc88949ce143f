"""``milehpc stop JOBID|RUN_DIR``: ask a running job's ranks to checkpoint and end without a requeue.

It writes the stop request of the checkpoint contract (:mod:`milehpc.runtime.signals`, item 7) into the job's run
directory; the ranks checkpoint at their next step boundary and exit 75, and the job script, seeing the stop
request, ends the job with status 0 (COMPLETED) instead of requeueing it. Resume later with
``milehpc submit --resume RUN_DIR``.

A job that is not running yet (pending, or held after a requeue) has no ranks to ask: it is cancelled (``scancel``),
which is what a user who says "stop" expects; its run directory keeps whatever checkpoint an earlier run committed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from milehpc.errors import SchedulerError
from milehpc.render.script import REQUEST_FILE, STOP_FILE
from milehpc.scheduler import lifecycle
from milehpc.scheduler.records import read_records
from milehpc.scheduler.slurm import JOB_ID

# What the job record and a run directory must show (written by `milehpc submit`).
RUN_DIR_MARKER = "plan.json"
RESUME_HINT = "resume with: milehpc submit --resume {run_dir}"


def stop(target: str) -> list[str]:
    """Stop the job named by ``target`` (a job id or a run directory); returns the lines to print."""
    target = target.strip()
    path = Path(target).expanduser()
    if path.is_dir():
        return _stop_run_dir(path)
    if JOB_ID.fullmatch(target) or lifecycle.is_local(target):
        return _stop_job(target)
    if path.exists():
        raise SchedulerError(f"{target} is not a milehpc run directory (expected a directory with {RUN_DIR_MARKER})",
                             field="JOBID|RUN_DIR")
    raise SchedulerError(f"expected a job id (1234, 1234_5, local-1234) or an existing milehpc run directory, "
                         f"got {target!r}", field="JOBID|RUN_DIR")


def check_run_dir(path: Path) -> Path:
    if not (path / RUN_DIR_MARKER).is_file():
        raise SchedulerError(f"{path} is not a milehpc run directory (no {RUN_DIR_MARKER}: not written by "
                             f"`milehpc submit`)", field="JOBID|RUN_DIR")
    return path.resolve()


def _stop_run_dir(path: Path) -> list[str]:
    run_dir = check_run_dir(path)
    job_id = job_of(run_dir)
    if job_id is None:  # submitted from elsewhere: its ranks, if running, read the request all the same
        _request(run_dir)
        return [f"no milehpc job record for {run_dir}; asked any job running there to checkpoint and stop",
                RESUME_HINT.format(run_dir=run_dir)]
    return _stop_job(job_id)


def job_of(run_dir: Path) -> str | None:
    """The newest recorded job of ``run_dir`` (``123_2`` for the third run of a sweep)."""
    for rec in reversed(read_records()):
        if _same_dir(rec.get("run_dir"), run_dir):
            return str(rec["job_id"])
        for index, element in enumerate((rec.get("sweep") or {}).get("run_dirs", [])):
            if _same_dir(element, run_dir):
                return f"{rec['job_id']}_{index}"
    return None


def _same_dir(recorded: str | None, run_dir: Path) -> bool:
    return bool(recorded) and Path(recorded).expanduser().resolve() == run_dir


def _stop_job(job_id: str) -> list[str]:
    if lifecycle.is_local(job_id):
        lifecycle.live_local_pid(job_id)
        run_dir = _run_dir(job_id)
        _request(run_dir)
        return _asked(job_id, run_dir)
    from milehpc.scheduler.slurm import scancel

    live = lifecycle.live_slurm_statuses(job_id)
    lines: list[str] = []
    for st in live:  # one job, or the live elements of a sweep
        if st.state == "PENDING":
            if not JOB_ID.fullmatch(st.job_id):  # a range of pending sweep elements (123_[3-5])
                lines.append(f"job {st.job_id} is pending: left queued (`milehpc cancel` drops it)")
                continue
            scancel(st.job_id)
            lines.append(f"job {st.job_id} was pending ({st.reason or 'not started'}): nothing running to "
                         f"checkpoint, cancelled it")
            continue
        run_dir = _run_dir(st.job_id)
        _request(run_dir)
        lines += _asked(st.job_id, run_dir)
    return lines


def _run_dir(job_id: str) -> Path:
    run_dir = lifecycle.run_dir_of(job_id) or lifecycle.run_dir_from_slurm(job_id)
    if run_dir is None:
        raise SchedulerError(f"no run directory known for job {job_id} (submitted elsewhere?): give its RUN_DIR",
                             field="JOBID")
    return check_run_dir(run_dir)


def _request(run_dir: Path) -> None:
    """Contract item 7 (milehpc.runtime.signals): the stop file first, so that the script finds it by the time
    the ranks, answering the checkpoint request, exit 75. Each file appears whole (written aside, renamed)."""
    text = f"milehpc stop by pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
    for rel in (STOP_FILE, REQUEST_FILE):
        path = run_dir / rel
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def _asked(job_id: str, run_dir: Path) -> list[str]:
    return [f"asked job {job_id} to checkpoint at its next step boundary and end (no requeue)",
            f"  follow: milehpc logs {job_id} -f;  then {RESUME_HINT.format(run_dir=run_dir)}"]
