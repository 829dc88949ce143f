"""The local launcher: runs the rendered script on this machine (no scheduler)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def start_detached(script: Path, run_dir: Path) -> str:
    """Start the job in its own session, output to RUN_DIR/logs/local.out; returns 'local-<pid>'."""
    log = (run_dir / "logs" / "local.out").open("ab")
    proc = subprocess.Popen(["bash", str(script)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=run_dir)
    (run_dir / ".milehpc").mkdir(exist_ok=True)
    (run_dir / ".milehpc" / "local.pid").write_text(f"{proc.pid}\n")
    return f"local-{proc.pid}"


def run_foreground(script: Path, run_dir: Path) -> int:
    """Run the job here and now, output to the terminal; returns its exit code."""
    return subprocess.call(["bash", str(script)], cwd=run_dir)
