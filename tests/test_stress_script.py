"""scripts/stress.sh, the flake hunt's runner: per-test counts over the repetitions, one summary line, exit 1 on any
failure, and no busy loop left behind — it runs here on a tiny test file with one repetition and one loop."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = """
def test_passes():
    pass


def test_fails():
    assert False
"""


def _session_processes(sid: int) -> list[str]:
    ps = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(sid)], capture_output=True, text=True)
    return [line for line in ps.stdout.splitlines() if line.strip()]


def test_counts_per_test_summarises_and_stops_its_load(tmp_path: Path) -> None:
    tiny = tmp_path / "test_tiny.py"
    tiny.write_text(TINY)
    log = tmp_path / "stress.out"
    with log.open("w") as fh:  # a file, not a pipe: a leftover busy loop would hold a pipe open forever
        proc = subprocess.Popen(["bash", "scripts/stress.sh", "-n", "2", "-l", "1", str(tiny)], cwd=ROOT,
                                stdout=fh, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            assert proc.wait(timeout=300) == 1
        finally:
            leftover = _session_processes(proc.pid)
            subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], capture_output=True)  # only this session
    out = log.read_text()
    # The test's id carries the path of tmp_path relative to pytest's rootdir, which depends on where the
    # checkout is (a clone under /tmp gives "pytest-of-root.pytest-N.<test dir>.test_tiny::..."): keep its end.
    rows = {line.split()[0].rsplit(".", 1)[-1]: line.split()[1:4] for line in out.splitlines()
            if "test_tiny::" in line.split()[0]}
    assert rows == {"test_tiny::test_passes": ["2", "0", "0"], "test_tiny::test_fails": ["0", "2", "0"]}, out
    assert out.splitlines()[-1].startswith("stress: 2 tests x 2 repetitions under 1 busy loops: 2 passed, 2 failed")
    last = out.splitlines()[-1]
    assert "failing: " in last and last.endswith("test_tiny::test_fails"), last
    assert leftover == []  # the busy loop is gone with the script


def test_bad_arguments_exit_2() -> None:
    for args in (["-n", "0"], ["-l", "x"], ["tests/no_such_test.py"]):
        proc = subprocess.run(["bash", "scripts/stress.sh", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
