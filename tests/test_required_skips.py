"""MILEHPC_REQUIRE_ALL: the Slurm and ULFM preconditions skip, with their reason, on a developer run and fail, with
the same reason, when CI sets the flag. Run through a real pytest in a subprocess on a tiny test file whose cluster
and MPI are made unavailable by replacing the two probes (the real ones would start daemons or need another MPI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from required import REQUIRE_ENV

TESTS = Path(__file__).resolve().parent

TINY = """
import harness
import test_runtime_mpi


def test_needs_the_cluster():
    harness._start = lambda: (False, "fake: no slurmctld in this test")
    harness.ensure_cluster()


def test_needs_ulfm():
    test_runtime_mpi._has_ulfm = lambda: False
    test_runtime_mpi.needs_ulfm()
"""


def run_tiny(tmp_path: Path, flag: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_tiny.py").write_text(TINY)
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS / "cluster")])
    env["COLUMNS"] = "400"  # -ra's summary lines carry the whole reason
    if flag is not None:
        env[REQUIRE_ENV] = flag
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-p", "no:warnings",
                           "test_tiny.py"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


REASONS = ("test Slurm cluster unavailable: fake: no slurmctld in this test",
           "this Open MPI has no ULFM (FT MPI support)")


@pytest.mark.parametrize("flag", [None, "0"], ids=["unset", "zero"])
def test_a_developer_run_skips_saying_why(tmp_path: Path, flag: str | None) -> None:
    proc = run_tiny(tmp_path, flag)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "2 skipped" in out, out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    for reason in REASONS:
        assert any(reason in line for line in skipped), out


def test_the_flag_turns_those_skips_into_failures_with_the_same_reason(tmp_path: Path) -> None:
    proc = run_tiny(tmp_path, "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "2 failed" in out and "skipped" not in out, out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    for reason in REASONS:
        assert any(reason in line and f"{REQUIRE_ENV}=1" in line for line in failed), out


def test_ci_sets_the_flag() -> None:
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert f"export {REQUIRE_ENV}=1" in ci
