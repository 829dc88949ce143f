"""Test harness for the real test Slurm cluster (tests/cluster/slurm.sh): start it once per session, run the CLI
against it, wait for jobs. Imported by tests/test_slurm_*.py."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/required.py, also when this file is imported on its own
from required import unavailable  # noqa: E402

REPO = HERE.parent.parent
SLURM_SH = HERE / "slurm.sh"
CLUSTER_DIR = os.environ.get("MILEHPC_CLUSTER_DIR", "/tmp/milehpc-cluster")
SLURM_CONF = f"{CLUSTER_DIR}/etc/slurm.conf"


def start_cluster(script: Path, *, timeout: float, not_root: str) -> tuple[bool, str]:
    """(True, its log) when ``script status`` answers or ``script start`` succeeds; else (False, why)."""
    status = subprocess.run(["bash", str(script), "status"], capture_output=True, text=True, timeout=60)
    if status.returncode == 0:
        return True, status.stderr
    if os.geteuid() != 0:
        return False, not_root
    name = f"tests/cluster/{script.name}"
    try:
        proc = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"{name} start did not finish in {timeout:.0f} s"
    sys.stderr.write(proc.stderr)  # the CI log shows the cluster starting
    if proc.returncode != 0:
        return False, f"{name} start failed: {proc.stderr.strip().splitlines()[-1:]}"
    return True, proc.stderr


@functools.lru_cache(maxsize=1)
def _start() -> tuple[bool, str]:
    return start_cluster(SLURM_SH, timeout=600, not_root="the test cluster's daemons run as root and this test "
                                                          "session is not root")


def ensure_cluster() -> str:
    """Start the cluster if needed; skip (with the reason; a failure under MILEHPC_REQUIRE_ALL=1) only when it
    cannot start. Returns SLURM_CONF."""
    ok, why = _start()
    if not ok:
        unavailable(f"test Slurm cluster unavailable: {why}")
    os.environ["SLURM_CONF"] = SLURM_CONF
    return SLURM_CONF


def python_standin(tmp: Path) -> Path:
    sys.path.insert(0, str(HERE))
    try:
        import payload
    finally:
        sys.path.remove(str(HERE))
    return payload.python_standin(tmp / "python-standin")


def write_job(path: Path, entry: str, *, name: str = "slurm-test", time_limit: str = "00:05:00",
              extra: str = "", env: dict[str, str] | None = None) -> Path:
    """A tiny job spec for local-slurm: one colocated rank (unless ``extra`` says otherwise) running ``entry``."""
    env_lines = "\n".join(f'{k} = "{v}"' for k, v in {"MILEHPC_TEST_ENTRY": f"payload:{entry}",
                                                      "PYTHONPATH": str(HERE), **(env or {})}.items())
    path.write_text(f'name = "{name}"\n{extra}\n[resources]\ncolocate = true\ntime = "{time_limit}"\n'
                    f"[env]\n{env_lines}\n")
    return path


class Cli:
    """``milehpc`` as a user runs it, against the test cluster, with its own record of submissions."""

    def __init__(self, tmp: Path) -> None:
        self.env = {**os.environ, "SLURM_CONF": SLURM_CONF, "MILEHPC_STATE_DIR": str(tmp / "state"),
                    "MILEHPC_PYTHON": str(python_standin(tmp)), "OMP_NUM_THREADS": "1"}
        self.submitted: list[str] = []

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "milehpc", *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout, cwd=REPO)
        if check and proc.returncode != 0:
            raise AssertionError(f"milehpc {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def submit(self, job: Path, run_dir: Path, *args: str) -> dict[str, Any]:
        out = self("submit", str(job), "--site", "local-slurm", "--run-dir", str(run_dir), "--json", *args)
        res = json.loads(out.stdout)
        self.submitted.append(res["job_id"])
        return res

    def cleanup(self) -> None:
        """Cancel what a failed test left running (scancel of an ended job is harmless)."""
        scancel = shutil.which("scancel")
        for job_id in self.submitted if scancel else []:
            subprocess.run([scancel, job_id], capture_output=True, env={**self.env, "PATH": os.defpath}, timeout=30)

    def status(self, *ids: str) -> list[dict[str, Any]]:
        return json.loads(self("status", "--json", *ids).stdout)


def scontrol_show(job_id: str) -> dict[str, str]:
    from milehpc.scheduler.slurm import show_job

    return show_job(job_id) or {}


def wait_for(job_id: str, *, timeout: float = 120, release_holds: bool = False, until_running: bool = False,
             poll: float = 0.3) -> list[Any]:
    """Poll milehpc's own status query until every element of ``job_id`` ended (or runs); with
    ``release_holds``, a requeued job held until its BeginTime (cred_expire + 1 s) is released at once."""
    from milehpc.scheduler.slurm import query

    deadline = time.monotonic() + timeout
    seen: list[str] = []
    gone_at: dict[str, float] = {}  # job id -> wall time its previous run's step daemons were first seen gone
    while time.monotonic() < deadline:
        sts = query([job_id])[job_id]
        seen.append(" ".join(f"{s.job_id}:{s.state}:{s.reason}" for s in sts))
        if until_running and any(s.state == "RUNNING" for s in sts):
            return sts
        if all(s.terminal for s in sts):
            return sts
        if release_holds:
            for s in sts:
                if s.state != "PENDING" or "BeginTime" not in s.reason:
                    continue
                # Slurm's hold (cred_expire + 1 s) exists for two reasons, and an early release must respect both:
                # the previous run's step daemons must be gone (else the new step meets the old PMIx socket, srun
                # fails and exits 0), and slurmd refuses a launch credential created in the same second as the
                # old one's revocation ("Job N already killed, do not launch batch job": ctime <= revoked, both in
                # whole seconds), so the release waits for the next whole second after the daemons went.
                if _stepds(s.job_id):
                    gone_at.pop(s.job_id, None)
                    continue
                gone = gone_at.setdefault(s.job_id, time.time())
                if time.time() >= int(gone) + 1.2:
                    subprocess.run(["scontrol", "update", f"JobId={s.job_id}", "StartTime=now"],
                                   capture_output=True, timeout=30)
        time.sleep(poll)
    uniq = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    raise AssertionError(f"job {job_id} not done within {timeout} s; states seen: {uniq[-8:]}")


def _stepds(job_id: str) -> list[int]:
    """PIDs of this host's slurmstepd processes of ``job_id`` ("slurmstepd: [123.0]", "[123.batch]")."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(f"slurmstepd: [{job_id}.".encode()):
            pids.append(int(proc.name))
    return pids
