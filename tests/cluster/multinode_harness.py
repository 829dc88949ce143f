"""Test harness for the multi-node test cluster (tests/cluster/multinode.sh): start it once per session, submit
jobs to it through the real CLI, kill or cut a node, bring it back. Imported by tests/test_multinode_cluster.py.

Run directories live under the cluster's own directory (not pytest's /tmp): every node mounts its own /tmp."""

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
sys.path.insert(0, str(HERE.parent))
import harness  # noqa: E402
from required import unavailable  # noqa: E402

REPO = HERE.parent.parent
MN_SH = HERE / "multinode.sh"
MN_DIR = Path(os.environ.get("MILEHPC_MN_DIR", "/var/tmp/milehpc-multinode"))
SLURM_CONF = str(MN_DIR / "etc" / "slurm.conf")
SITE = "local-multinode"
NODES = int(os.environ.get("MILEHPC_MN_NODES", "4"))
PREFIX = os.environ.get("MILEHPC_MN_PREFIX", "mn")


@functools.lru_cache(maxsize=1)
def _start() -> tuple[bool, str]:
    return harness.start_cluster(MN_SH, timeout=300, not_root="the multi-node cluster makes network namespaces and "
                                                              "runs its daemons as root; not root")


def ensure_cluster() -> str:
    """Start the cluster if needed; skip with the reason (a failure under MILEHPC_REQUIRE_ALL=1) when it cannot."""
    ok, why = _start()
    if not ok:
        unavailable(f"multi-node test cluster unavailable: {why}")
    return SLURM_CONF


def host(i: int) -> str:
    return f"{PREFIX}{i}"


def node(action: str, i: int) -> None:
    """``kill``, ``cut`` or ``revive`` node ``i`` (1-based) through the cluster script."""
    subprocess.run(["bash", str(MN_SH), f"{action}-node", str(i)], check=True, capture_output=True, timeout=60)


def node_exec(i: int, *argv: str) -> str:
    return subprocess.run(["bash", str(MN_SH), "exec", str(i), *argv], check=True, capture_output=True, text=True,
                          timeout=60).stdout


def wait_nodes_idle(timeout: float = 120) -> None:
    """Every node back in service (a revived one registers again within seconds; ReturnToService=2)."""
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30,
                                env={**os.environ, "SLURM_CONF": SLURM_CONF}).stdout
        if sum(line.split()[-1] == "idle" for line in states.splitlines()) == NODES:
            return
        time.sleep(0.5)
    raise AssertionError(f"nodes not idle after {timeout} s: {states}")


def set_down(i: int) -> None:
    """Mark node ``i`` DOWN now, as slurmctld does itself ``SlurmdTimeout`` after it stopped answering."""
    subprocess.run(["scontrol", "update", f"NodeName={host(i)}", "State=DOWN", "Reason=milehpc-test-node-died"],
                   check=True, capture_output=True, timeout=30, env={**os.environ, "SLURM_CONF": SLURM_CONF})


def workdir(name: str) -> Path:
    """A fresh directory every node sees."""
    path = MN_DIR / "work" / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


class Cli(harness.Cli):
    """``milehpc`` against the multi-node cluster (the single-node harness's runner, this cluster's environment:
    the ranks run the real Python, no stand-in), with its own record of submissions."""

    def __init__(self, base: Path) -> None:  # not the parent's: no Python stand-in for the ranks here
        self.env = {**os.environ, "SLURM_CONF": SLURM_CONF, "MILEHPC_STATE_DIR": str(base / "state"),
                    "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}:{HERE.parent}"}
        self.env.pop("MILEHPC_PYTHON", None)
        self.submitted: list[str] = []

    def submit(self, job: Path, run_dir: Path, *args: str) -> str:
        out = self("submit", str(job), "--site", SITE, "--run-dir", str(run_dir), "--json", *args)
        job_id = json.loads(out.stdout)["job_id"]
        self.submitted.append(job_id)
        return job_id

    def plan_ranks(self, job: Path, *args: str) -> list[dict[str, Any]]:
        return json.loads(self("plan", str(job), "--site", SITE, "--ranks", "--json", *args).stdout)["ranks"]

    def cleanup(self) -> None:
        for job_id in self.submitted:
            subprocess.run(["scancel", job_id], capture_output=True, env=self.env, timeout=30)


def show_job(job_id: str) -> dict[str, str]:
    from milehpc.scheduler.slurm import show_job as show

    return show(job_id) or {}


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True,
                         timeout=30, env={**os.environ, "SLURM_CONF": SLURM_CONF}).stdout
    return out.split()


def node_processes(i: int, needle: str) -> list[str]:
    """Command lines of node ``i``'s processes (its network namespace's) that contain ``needle``."""
    pids = subprocess.run(["ip", "netns", "pids", f"milehpc-{host(i)}"], capture_output=True, text=True,
                          timeout=30).stdout.split()
    found = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if needle in cmd:
            found.append(cmd.strip())
    return found
