"""One launch of a ``tests/*_checks.py`` script that writes its figures to a JSON file, and the figures read back:
``mpirun -np N python tests/SCRIPT OUT.json [ARGS...]`` (``np=None``: one plain process). Shared by the tests that
put many checks into one launch because importing megatron, torch and transformers costs seconds per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The scripts import their helpers from tests/; warnings from the libraries would bury the failure in the output.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}


def run_checks(script: str, out: Path, *args: str | Path, np: int | None, env: dict[str, str] | None = None,
               timeout: float = 600) -> Any:
    """Run ``tests/<script>`` (under mpirun on ``np`` ranks) with ``out`` and ``args``; returns the JSON in ``out``.
    ``env`` adds variables (e.g. ``MILEHPC_DEVICE_CHECK=nccl``: the launch's gloo groups checked as NCCL groups)."""
    cmd = [sys.executable, str(ROOT / "tests" / script), str(out), *map(str, args)]
    if np is not None:
        cmd = [str(BIN / "mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np),
               *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})}, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())
