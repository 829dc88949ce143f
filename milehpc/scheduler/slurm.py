"""The Slurm client: sbatch, squeue → sacct → scontrol, scancel, by subprocess with argv lists (never a shell).

Status queries are batched: one ``squeue`` call for every job asked about, then one ``sacct`` call for the jobs
squeue no longer knows, then one ``scontrol show job`` for what is left (clusters without accounting are
common: there ``sacct`` fails and only slurmctld's memory of recent jobs, MinJobAge, remains).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError, SchedulerError

_JOB_ID = re.compile(r"^(\d+)(;\S+)?$")
# A job id as users type it: 123, an array element 123_4, or a hetjob component 123+1.
JOB_ID = re.compile(r"\d+([_+]\d+)?")

# Job states after which nothing more happens (REQUEUED/REQUEUE_HOLD are not: the job comes back).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                      "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise SchedulerError(f"'{tool}' not found: Slurm is not available on this machine (use --site local, "
                             "or run on a login node of the site)")
    return path


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    tool = Path(argv[0]).name
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"{tool} did not answer within {timeout:.0f} s (is slurmctld up?)") from None


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    text = proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}"
    return text.splitlines()[-1]


def check_job_id(job_id: str) -> str:
    job_id = job_id.strip()
    if not JOB_ID.fullmatch(job_id):
        raise SchedulerError(f"expected a Slurm job id like 1234 or 1234_5, got {job_id!r}", field="JOBID")
    return job_id


def dependency_args(after: str | None, scheduler: str) -> list[str]:
    """``--after JOBID[,JOBID...]`` as sbatch's ``--dependency=afterany:...`` (start once they ended, however)."""
    if not after:
        return []
    if scheduler != "slurm":
        raise ConfigError("--after needs a Slurm site (this site runs without a scheduler)", field="--after")
    ids = [j.strip() for j in after.split(",")]
    bad = [j for j in ids if not JOB_ID.fullmatch(j)]
    if bad:
        raise ConfigError(f"expected Slurm job ids like 1234 or 1234_5, comma-separated, got {bad[0]!r}",
                          field="--after")
    return ["--dependency=afterany:" + ":".join(ids)]


def sbatch(script: Path, *, extra: list[str] | None = None, test_only: bool = False,
           timeout: float = 60.0) -> str:
    """Submit ``script``; returns the job id (or sbatch's --test-only answer)."""
    argv = [_require("sbatch"), "--parsable", *(extra or [])]
    if test_only:
        argv.append("--test-only")
    argv.append(str(script))
    proc = _run(argv, timeout)
    if proc.returncode != 0:
        raise SchedulerError(f"sbatch refused the job: {_last_line(proc)}")
    if test_only:
        return proc.stderr.strip()
    match = _JOB_ID.match(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "")
    if not match:
        raise SchedulerError(f"could not read a job id from sbatch's answer {proc.stdout.strip()!r}")
    return match.group(1)


@dataclass
class JobStatus:
    """What Slurm says about one job (or one array element)."""

    job_id: str                 # 123, or 123_4 for an array element
    state: str                  # PENDING, RUNNING, COMPLETED, ...; UNKNOWN when no source knows it
    name: str = ""
    reason: str = ""
    exit_code: str | None = None  # "0:0" (code:signal); None when the source does not say
    elapsed: str = ""
    time_limit: str = ""
    nodes: str = ""
    restarts: int | None = None
    stdout: str | None = None
    source: str = ""            # squeue | sacct | scontrol | local
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "terminal": self.terminal}


def _base(job_id: str) -> str:
    return re.split(r"[_+]", job_id, maxsplit=1)[0]


def _matches(asked: str, found: str) -> bool:
    """Whether a job id Slurm printed answers a job id the user asked for (123 covers 123_0, 123_1...)."""
    return found == asked or ("_" not in asked and "+" not in asked and _base(found) == asked)


_SQUEUE_FIELDS = ["JobArrayID", "ArrayJobID", "Name", "State", "Reason", "TimeUsed", "TimeLimit", "NodeList"]


def _squeue(ids: list[str], timeout: float) -> list[JobStatus] | None:
    """Jobs slurmctld still holds (pending, running, and ended less than MinJobAge ago); None if squeue fails."""
    tool = shutil.which("squeue")
    if not tool:
        return None
    fmt = ",".join(f"{f}:|" for f in _SQUEUE_FIELDS)
    proc = _run([tool, "-h", "-t", "all", "-j", ",".join(ids), "-O", fmt], timeout)
    if proc.returncode != 0:
        return None  # "Invalid job id specified" when none is known; the next source decides
    out = []
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < len(_SQUEUE_FIELDS):
            continue
        jid, _, name, state, reason, used, limit, nodes = parts[:len(_SQUEUE_FIELDS)]
        out.append(JobStatus(jid, state.split()[0] if state else "UNKNOWN", name=name,
                             reason="" if reason == "None" else reason, elapsed=used, time_limit=limit,
                             nodes=nodes, source="squeue"))
    return out


def _sacct(ids: list[str], timeout: float) -> list[JobStatus] | None:
    """Ended jobs from the accounting database; None when there is none (sacct fails) or sacct is absent."""
    tool = shutil.which("sacct")
    if not tool:
        return None
    proc = _run([tool, "-X", "-n", "-P", "-j", ",".join(ids), "-o",
                 "JobID,JobName,State,ExitCode,Elapsed,Timelimit,NodeList,Reason"], timeout)
    if proc.returncode != 0:
        return None  # "Slurm accounting storage is disabled" on clusters without slurmdbd
    out = []
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 8:
            continue
        jid, name, state, code, elapsed, limit, nodes, reason = parts[:8]
        out.append(JobStatus(jid, state.split()[0] if state else "UNKNOWN", name=name, exit_code=code,
                             elapsed=elapsed, time_limit=limit, nodes=nodes,
                             reason="" if reason == "None" else reason, source="sacct"))
    return out


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """``scontrol show job -o`` output: one job per line of ``Key=Value`` words (values may hold '=')."""
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        record: dict[str, str] = {}
        key = None
        for word in line.split(" "):
            k, sep, v = word.partition("=")
            if sep and re.fullmatch(r"[A-Za-z/:_]+", k):
                key = k
                record[k] = v
            elif key is not None:  # a value with spaces (Command=..., Reason=...)
                record[key] += " " + word
        jobs.append(record)
    return jobs


def _scontrol_status(rec: dict[str, str]) -> JobStatus:
    jid = rec.get("JobId", "")
    if rec.get("ArrayTaskId") not in (None, "", "N/A") and rec.get("ArrayJobId"):
        jid = f"{rec['ArrayJobId']}_{rec['ArrayTaskId']}"
    restarts = rec.get("Restarts", "")
    return JobStatus(jid, rec.get("JobState", "UNKNOWN"), name=rec.get("JobName", ""),
                     reason="" if rec.get("Reason") == "None" else rec.get("Reason", ""),
                     exit_code=rec.get("ExitCode"), elapsed=rec.get("RunTime", ""),
                     time_limit=rec.get("TimeLimit", ""), nodes=rec.get("NodeList", ""),
                     restarts=int(restarts) if restarts.isdigit() else None, stdout=rec.get("StdOut"),
                     source="scontrol", extra={"real_job_id": rec.get("JobId", "")})


def scontrol_jobs(timeout: float = 30.0) -> list[dict[str, str]] | None:
    """Every job slurmctld holds, in one call (a per-job loop would hammer slurmctld); None if it fails."""
    tool = shutil.which("scontrol")
    if not tool:
        return None
    proc = _run([tool, "show", "job", "-o"], timeout)
    if proc.returncode != 0:
        return None
    return parse_scontrol(proc.stdout)


def query(job_ids: list[str], *, timeout: float = 30.0, details: bool = False) -> dict[str, list[JobStatus]]:
    """Status of each job id asked for: ``{asked id: [JobStatus...]}`` (several for an array), batched:
    squeue, then sacct for what squeue did not know, then scontrol. A job no source knows gets one entry with
    state UNKNOWN. ``details`` adds exit code, restarts and output path from scontrol where slurmctld has them."""
    ids = [check_job_id(j) for j in job_ids]
    if not ids:
        return {}
    if not any(shutil.which(t) for t in ("squeue", "sacct", "scontrol")):
        _require("squeue")
    found: dict[str, list[JobStatus]] = {j: [] for j in ids}

    def take(statuses: list[JobStatus] | None, pending: list[str]) -> list[str]:
        for st in statuses or []:
            for asked in pending:
                if _matches(asked, st.job_id):
                    found[asked].append(st)
        return [j for j in pending if not found[j]]

    missing = take(_squeue(ids, timeout), ids)
    if missing:
        missing = take(_sacct(missing, timeout), missing)
    need_scontrol = bool(missing) or (details and any(
        st.source == "squeue" for sts in found.values() for st in sts))
    if need_scontrol:
        records = scontrol_jobs(timeout) or []
        by_id = {}
        for rec in records:
            st = _scontrol_status(rec)
            by_id[st.job_id] = st
        missing = take(list(by_id.values()), missing)
        for sts in found.values():  # enrich squeue's answers with what only scontrol says
            for i, st in enumerate(sts):
                full = by_id.get(st.job_id)
                if st.source == "squeue" and full is not None:
                    full.source = "squeue+scontrol"
                    full.state = st.state
                    sts[i] = full
    for j in missing:
        found[j] = [JobStatus(j, "UNKNOWN", reason="no such job in squeue, sacct or scontrol (unknown id, or "
                                                   "it ended before slurmctld's MinJobAge and there is no accounting)")]
    for sts in found.values():
        sts.sort(key=lambda s: [int(x) for x in re.split(r"[_+]", s.job_id) if x.isdigit()])
    return found


def show_job(job_id: str, timeout: float = 30.0) -> dict[str, str] | None:
    """``scontrol show job -o ID`` for one job (None when slurmctld no longer knows it)."""
    tool = _require("scontrol")
    proc = _run([tool, "show", "job", "-o", check_job_id(job_id)], timeout)
    if proc.returncode != 0:
        return None
    jobs = parse_scontrol(proc.stdout)
    return jobs[0] if jobs else None


def scancel(job_id: str, *, signal: str | None = None, timeout: float = 30.0) -> None:
    argv = [_require("scancel")]
    if signal:
        argv += ["--batch", f"--signal={signal}"]  # to the batch shell, as the wall-time warning is
    argv.append(check_job_id(job_id))
    proc = _run(argv, timeout)
    # scancel exits 0 for some unknown ids and prints "Invalid job id"; both are errors here.
    msg = (proc.stderr + proc.stdout).strip()
    if proc.returncode != 0 or "error" in msg.lower():
        raise SchedulerError(f"scancel {job_id}: {msg.splitlines()[-1] if msg else f'exit code {proc.returncode}'}")


def mpi_plugins(timeout: float = 30.0) -> list[str] | None:
    """The MPI plugins this Slurm's srun offers (``srun --mpi=list``); None when srun is absent or fails."""
    tool = shutil.which("srun")
    if not tool:
        return None
    proc = _run([tool, "--mpi=list"], timeout)
    if proc.returncode != 0:
        return None
    names = []
    for line in (proc.stdout + proc.stderr).splitlines():
        line = line.strip()
        if line.startswith("MPI plugin types are"):
            continue
        m = re.match(r"^(?:srun:\s+)?([a-z0-9_]+)$", line)
        if m:
            names.append(m.group(1))
    return names
