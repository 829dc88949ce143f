"""`milehpc stop` for a job of the local site (no scheduler: the rendered local.sh runs mpirun): the ranks of a real
`milehpc launch` checkpoint at a step boundary (the payload's cursor, tests/cluster/payload.py:count), the script
exits 0 with the resume hint, and `milehpc submit --resume` continues: no step lost or counted twice. Also the
arguments `stop` refuses, each with one line and exit 2."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

pytestmark = pytest.mark.mpi


def _wait(what: str, done, timeout: float = 120) -> None:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def _ended(job_id: str) -> bool:
    return not Path(f"/proc/{job_id.removeprefix('local-')}").exists()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_stop_a_local_job_then_resume(tmp_path: Path) -> None:
    cli = harness.Cli(tmp_path)
    job = harness.write_job(tmp_path / "job.toml", "count", name="stop-local", env={"COUNT_AFTER_RESTART": "4"})
    run_dir = tmp_path / "run"
    job_id = json.loads(cli("submit", str(job), "--site", "local", "--run-dir", str(run_dir), "--json").stdout)["job_id"]
    steps = run_dir / "out" / "steps.txt"
    try:
        _wait("3 steps counted", lambda: _lines(steps) >= 3 or _ended(job_id))
        out = cli("stop", job_id).stdout
        assert f"asked job {job_id} to checkpoint" in out, out
        _wait("the job ended", lambda: _ended(job_id))
    finally:
        if not _ended(job_id):
            os.killpg(int(job_id.removeprefix("local-")), 9)
    log = (run_dir / "logs" / "local.out").read_text()
    assert "ranks checkpointed and stopped on request (milehpc stop); resume with: milehpc submit --resume" in log, log
    cursor = json.loads((run_dir / "out" / "state.json").read_text())["next"]
    assert json.loads((run_dir / ".milehpc" / "checkpointed").read_text())["step"] == cursor == _lines(steps)
    assert not (run_dir / ".milehpc" / "stop-request").exists()

    resumed = json.loads(cli("submit", "--resume", str(run_dir), "--site", "local", "--json").stdout)["job_id"]
    _wait("the resumed job ended", lambda: _ended(resumed))
    rows = [int(line.split()[0]) for line in steps.read_text().splitlines()]
    assert rows == list(range(cursor + 4)), "steps lost or counted twice"
    assert "payload count: done at step" in (run_dir / "logs" / "local.out").read_text()

    proc = cli("stop", job_id, check=False)  # ended now: one line, exit 2
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "is not running" in proc.stderr


@pytest.mark.parametrize(("arg", "expected"), [
    ("not-a-job", "expected a job id (1234, 1234_5, local-1234) or an existing milehpc run directory, got "),
    ("/etc/hostname", "/etc/hostname is not a milehpc run directory"),
    ("/etc", "/etc is not a milehpc run directory (no plan.json"),
    ("local-abc", "expected a job id like local-1234, got 'local-abc'"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path, arg: str, expected: str) -> None:
    proc = harness.Cli(tmp_path)("stop", arg, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_term_to_a_rank_becomes_a_checkpoint_request(tmp_path: Path) -> None:
    """What `milehpc launch` installs first (signals item 8): scancel's TERM must not kill a rank mid-step."""
    import signal

    from milehpc.runtime.signals import install_rank_handlers, request_path

    previous = install_rank_handlers(tmp_path)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert request_path(tmp_path).read_text().startswith("signal SIGTERM")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
