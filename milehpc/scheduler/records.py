"""A small local record of what this user submitted with milehpc (for `milehpc jobs`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def records_file() -> Path:
    base = os.environ.get("MILEHPC_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "milehpc")
    return Path(base) / "jobs.jsonl"


def add_record(job_id: str, name: str, site: str, run_dir: str, **extra: Any) -> None:
    path = records_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    entry = {"job_id": job_id, "name": name, "site": site, "run_dir": run_dir, "submitted": time.time(), **extra}
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def read_records() -> list[dict[str, Any]]:
    path = records_file()
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line from a concurrent writer; the rest stays usable
    return out
