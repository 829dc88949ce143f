"""A colocated job with ``rollout.engine = "sglang"`` under real mpirun, against the REAL sglang engine on the CPU
(memory saving off: torch_memory_saver cannot run there) and, on the trainer side, the real torch_memory_saver with
its CUDA binding faked (tests/tms_real.py, loaded through tests/standin_gpu_stack/). Every rank's calls into the
engine, the memory saver and the checkpointer are recorded in order by tests/sglang_call_log/sitecustomize.py.
Used by tests/test_sglang_colocated_real.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import tms_real
from local_job import run_local_job
from sglang_real import require_real_sglang

ROOT = Path(__file__).resolve().parent.parent


def run_colocated_job(tmp_path: Path, body: str, env: dict[str, str] | None = None,
                      timeout: float = 480) -> tuple[list[dict], dict[int, list[dict]], str]:
    """Run the job; returns (metrics records, each rank's recorded calls, the command's output)."""
    require_real_sglang()
    tms_real.require_real()
    log = tmp_path / "calls"
    log.mkdir()
    path = [ROOT / "tests" / "sglang_call_log", ROOT / "tests" / "standin_gpu_stack", ROOT]
    records, out = run_local_job(tmp_path, body, {"MILEHPC_STANDIN_LOG": str(log), **(env or {}),
                                                  "PYTHONPATH": os.pathsep.join(map(str, path))}, timeout=timeout)
    calls = {int(f.stem[4:]): [json.loads(line) for line in f.read_text().splitlines()] for f in log.iterdir()}
    return records, calls, out


def story(calls: list[dict]) -> list[str]:
    """``call`` or ``call:tag,tag`` per recorded call (the memory saver's and the engine's tags alike)."""
    out = []
    for c in calls:
        tags = c.get("tags") or c.get("tag")
        out.append(f"{c['call']}:{','.join(tags) if isinstance(tags, list) else tags}" if tags else c["call"])
    return out
