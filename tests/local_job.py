"""``milehpc run JOB --site local`` from a test: the job written from a TOML body plus the tiny model, run under the
real mpirun by the CLI, its metrics read back (shared by the SGLang and colocated loop tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tiny_model import TINY_MODEL


def run_local_job(tmp_path: Path, body: str, env: dict[str, str], *, timeout: float = 240,
                  tiny_model: bool = True) -> tuple[list[dict], str]:
    """Run the job in ``tmp_path/run``; returns (the metrics records, the command's stdout + stderr)."""
    job, rdir = tmp_path / "job.toml", tmp_path / "run"
    job.write_text(textwrap.dedent(body) + (TINY_MODEL if tiny_model else ""))
    milehpc = Path(sys.executable).with_name("milehpc")
    proc = subprocess.run([str(milehpc), "run", str(job), "--site", "local", "--run-dir", str(rdir)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain", **env})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    return records, proc.stdout + proc.stderr
