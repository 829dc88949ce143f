"""The job lifecycle after submit: status, logs, cancel and the list of this user's milehpc jobs.

Where a job's output is (the contract with the runtime, ``milehpc.runtime``):

- ``RUN_DIR/logs/slurm-<jobid>.out`` — the batch log (sbatch ``--output``; an array element's is
  ``RUN_DIR/logs/slurm-<arrayid>_<index>.out``), with every rank's stdout/stderr unless the ranks redirect it;
- ``RUN_DIR/logs/local.out`` — the same for a job of a site without a scheduler;
- ``RUN_DIR/logs/rank-<N>.log`` (:data:`RANK_LOG`) — a rank's own log, when the runtime writes one;
  ``milehpc logs --rank N`` reads it, and falls back to the batch log's lines of that rank.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from milehpc.errors import SchedulerError
from milehpc.scheduler.records import read_records
from milehpc.scheduler.slurm import JobStatus, check_job_id

RANK_LOG = "logs/rank-{rank}.log"
LOCAL_PREFIX = "local-"


def is_local(job_id: str) -> bool:
    return job_id.startswith(LOCAL_PREFIX)


def find_record(job_id: str) -> dict[str, Any] | None:
    """The newest local record of ``job_id`` (an array element maps to its array's record)."""
    base = re.split(r"[_+]", job_id, maxsplit=1)[0]
    for rec in reversed(read_records()):
        if str(rec.get("job_id")) in (job_id, base):
            return rec
    return None


def run_dir_of(job_id: str, record: dict[str, Any] | None = None) -> Path | None:
    """The run directory of a job or of one array element (``123_2`` → the sweep's third run directory)."""
    record = record if record is not None else find_record(job_id)
    if not record:
        return None
    sweep = record.get("sweep")
    if sweep and "_" in job_id and job_id.split("_", 1)[1].isdigit():  # not 123_[0-2]: pending elements
        index = int(job_id.split("_", 1)[1])
        dirs = sweep.get("run_dirs", [])
        return Path(dirs[index]) if 0 <= index < len(dirs) else None
    return Path(record["run_dir"])


# ---- status --------------------------------------------------------------------------------------------------

def local_status(job_id: str) -> JobStatus:
    pid_text = job_id[len(LOCAL_PREFIX):]
    if not pid_text.isdigit():
        raise SchedulerError(f"expected a job id like local-1234, got {job_id!r}", field="JOBID")
    rec = find_record(job_id)
    if rec is None:
        return JobStatus(job_id, "UNKNOWN", reason="not in this user's milehpc records", source="local")
    alive = Path(f"/proc/{pid_text}").exists() and _same_job(int(pid_text), rec)
    return JobStatus(job_id, "RUNNING" if alive else "ENDED", name=rec.get("name", ""), source="local",
                     stdout=str(Path(rec["run_dir"]) / "logs" / "local.out"))


def _same_job(pid: int, rec: dict[str, Any]) -> bool:
    """A pid can be reused after the job ended: the process must still run our script in our run dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(arg.decode(errors="replace").startswith(rec["run_dir"]) for arg in cmdline)


def status(job_ids: list[str]) -> list[JobStatus]:
    """One entry per job (per element for arrays), in the order asked; Slurm queries batched in one go."""
    remote = [check_job_id(j) for j in job_ids if not is_local(j)]
    found: dict[str, list[JobStatus]] = {}
    if remote:
        from milehpc.scheduler.slurm import query

        found = query(remote, details=True)
    out: list[JobStatus] = []
    for j in job_ids:
        if is_local(j):
            out.append(local_status(j))
            continue
        for st in found[j]:
            rdir = run_dir_of(st.job_id)
            if rdir:
                st.extra["run_dir"] = str(rdir)
            out.append(st)
    return out


# ---- jobs ----------------------------------------------------------------------------------------------------

def jobs(limit: int | None = 20, with_status: bool = True) -> list[dict[str, Any]]:
    """This user's milehpc jobs from the local record (newest last), with their state when Slurm is reachable."""
    recs = read_records()
    if limit:
        recs = recs[-limit:]
    states: dict[str, str] = {}
    if with_status and recs:
        ids = [str(r["job_id"]) for r in recs]
        slurm_ids = [j for j in ids if not is_local(j)]
        try:
            if slurm_ids:
                from milehpc.scheduler.slurm import query

                for asked, sts in query(slurm_ids).items():
                    states[asked] = summarize(sts)
        except SchedulerError as err:  # no Slurm here: the record alone is still worth showing
            states = {j: f"? ({err})" for j in slurm_ids}
        for j in ids:
            if is_local(j):
                states[j] = local_status(j).state
    out = []
    for rec in recs:
        row = {"job_id": str(rec["job_id"]), "name": rec.get("name", ""), "site": rec.get("site", ""),
               "run_dir": rec.get("run_dir", ""),
               "submitted": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("submitted", 0)))}
        if rec.get("sweep"):
            row["sweep"] = rec["sweep"]
        if rec.get("after"):
            row["after"] = rec["after"]
        if with_status:
            row["state"] = states.get(row["job_id"], "UNKNOWN")
        out.append(row)
    return out


def summarize(statuses: list[JobStatus]) -> str:
    """One word for a job, or counts for an array ('COMPLETED:2 RUNNING:1')."""
    if len(statuses) == 1:
        return statuses[0].state
    counts: dict[str, int] = {}
    for st in statuses:
        counts[st.state] = counts.get(st.state, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


# ---- cancel --------------------------------------------------------------------------------------------------

def live_local_pid(job_id: str) -> int:
    """The process group of a running local job; a job that is not running is an error with one line."""
    st = local_status(job_id)
    if st.state != "RUNNING":
        raise SchedulerError(f"job {job_id} is not running ({st.state.lower()})", field="JOBID")
    return int(job_id[len(LOCAL_PREFIX):])


def live_slurm_statuses(job_id: str) -> list[JobStatus]:
    """The live statuses of a Slurm job (one, or a sweep's elements); unknown or ended jobs are one-line errors."""
    from milehpc.scheduler.slurm import query

    sts = query([job_id])[check_job_id(job_id)]
    if all(st.state == "UNKNOWN" for st in sts):
        raise SchedulerError(f"job {job_id} is unknown to Slurm ({sts[0].reason})", field="JOBID")
    live = [st for st in sts if not st.terminal]
    if not live:
        raise SchedulerError(f"job {job_id} already ended ({summarize(sts)})", field="JOBID")
    return live


def cancel(job_id: str) -> str:
    """Cancel a job; says what was done. Unknown or already-ended jobs are errors with one line."""
    if is_local(job_id):
        pid = live_local_pid(job_id)
        os.killpg(pid, signal.SIGTERM)  # its own session (start_detached): the script, mpirun and the ranks
        return f"sent SIGTERM to local job {job_id} (process group {pid})"
    from milehpc.scheduler.slurm import scancel

    live = live_slurm_statuses(job_id)
    scancel(job_id)
    return f"cancelled job {job_id} ({summarize(live)} before)"


# ---- logs ----------------------------------------------------------------------------------------------------

def log_path(job_id: str, rank: int | None = None) -> Path:
    """The file ``milehpc logs`` shows for a job (see the module docstring for the layout)."""
    job_id = job_id.strip()
    if not is_local(job_id):
        check_job_id(job_id)
    rec = find_record(job_id)
    rdir = run_dir_of(job_id, rec)
    if rdir is None and not is_local(job_id):
        rdir = run_dir_from_slurm(job_id)
    if rank is not None:
        if rdir is None:
            raise SchedulerError(f"job {job_id} is not in this user's milehpc records, so its run directory (and "
                                 "rank logs) is unknown; use `milehpc logs` without --rank", field="--rank")
        path = rdir / RANK_LOG.format(rank=rank)
        if path.exists():
            return path
        # No rank file: the batch log holds every rank's output (filtered by the caller).
    if is_local(job_id):
        if rdir is None:
            raise SchedulerError(f"job {job_id} is not in this user's milehpc records", field="JOBID")
        return rdir / "logs" / "local.out"
    candidates: list[Path] = []
    from milehpc.scheduler.slurm import show_job

    try:
        rec_sc = show_job(job_id) if "_" not in job_id else None
    except SchedulerError:
        rec_sc = None
    if rec_sc and rec_sc.get("StdOut") and "%" not in rec_sc["StdOut"]:
        candidates.append(Path(rec_sc["StdOut"]))
    if rdir is not None:
        if "_" in job_id:
            array, index = job_id.split("_", 1)
            candidates.append(rdir / "logs" / f"slurm-{array}_{index}.out")
        candidates.append(rdir / "logs" / f"slurm-{job_id}.out")
        candidates += sorted((rdir / "logs").glob(f"slurm-{job_id}*.out"))
    if rdir is None and rec_sc is None:
        from milehpc.scheduler.slurm import query

        sts = query([job_id])[job_id]
        if sts[0].state == "UNKNOWN":
            raise SchedulerError(f"job {job_id} is unknown to Slurm and to this user's milehpc records",
                                 field="JOBID")
        if len(sts) > 1:
            raise SchedulerError(f"job {job_id} is an array; ask for one element, e.g. {sts[0].job_id}",
                                 field="JOBID")
    for path in candidates:
        if path.exists():
            return path
    if candidates:
        return candidates[0]  # not written yet (pending job): -f waits for it
    raise SchedulerError(f"no log known for job {job_id}", field="JOBID")


def run_dir_from_slurm(job_id: str) -> Path | None:
    """A job submitted elsewhere (another machine's record): its script is RUN_DIR/job.sbatch."""
    from milehpc.scheduler.slurm import show_job

    try:
        rec = show_job(job_id)
    except SchedulerError:
        return None
    command = Path((rec or {}).get("Command", ""))
    if command.name == "job.sbatch" and (command.parent / "plan.json").exists():
        return command.parent
    return None


def _rank_filter(rank: int) -> Callable[[str], bool]:
    # srun --label / mpirun --tag-output prefixes, and milehpc's own "rank N" messages.
    pat = re.compile(rf"^(\s*{rank}:|\[\d+,{rank}\]|.*\brank {rank}\b)")
    return lambda line: bool(pat.match(line))


def read_log(job_id: str, *, rank: int | None = None, follow: bool = False, poll_s: float = 1.0,
             idle_timeout_s: float | None = None) -> Iterator[str]:
    """Yield the log's lines; with ``follow``, keep yielding new lines until the job has ended and the file
    stopped growing (Ctrl-C ends it earlier)."""
    path = log_path(job_id, rank)
    keep = None
    if rank is not None and path.name != Path(RANK_LOG.format(rank=rank)).name:
        keep = _rank_filter(rank)
    pos = 0
    buffer = ""
    last_growth = time.monotonic()
    ended_seen = False
    while True:
        if path.exists():
            with path.open("r", encoding="utf-8", errors="replace") as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
            if chunk:
                last_growth = time.monotonic()
                buffer += chunk
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    if keep is None or keep(line):
                        yield line
        if not follow:
            break
        if ended_seen:
            break
        if _ended(job_id):
            ended_seen = True  # one more read for what was written just before the end
            continue
        if idle_timeout_s is not None and time.monotonic() - last_growth > idle_timeout_s:
            break
        time.sleep(poll_s)
    if buffer and (keep is None or keep(buffer)):
        yield buffer


def _ended(job_id: str) -> bool:
    try:
        sts = status([job_id])
    except SchedulerError:
        return True
    return all(st.terminal or st.state in ("UNKNOWN", "ENDED") for st in sts)


def print_log(job_id: str, *, rank: int | None, follow: bool) -> None:
    try:
        for line in read_log(job_id, rank=rank, follow=follow):
            sys.stdout.write(line + "\n")
            if follow:
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
