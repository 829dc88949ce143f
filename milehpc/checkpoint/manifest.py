"""Finding complete checkpoints: a ``step-N`` directory whose manifest is valid and whose files all exist with their
recorded sizes (a half-written ``.tmp-`` one, or a damaged one, is skipped with a warning)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milehpc.checkpoint.files import FORMAT, MANIFEST, STEP_PREFIX, TMP_PREFIX

log = logging.getLogger("milehpc.checkpoint")


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, or None when it is missing, unreadable or not ours."""
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return None
    return data


def _files_present(path: Path, manifest: dict[str, Any]) -> str | None:
    """None if every file of the manifest exists with its recorded size, else what is wrong."""
    for name, rec in manifest["files"].items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != rec.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {rec.get('bytes')}"
    return None


def list_checkpoints(root: Path, *, warn: bool = False) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root`` (manifest valid, all files present with their sizes), newest
    first. With ``warn``, each half-written or damaged one is reported once, with what is wrong."""
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(TMP_PREFIX):
            if warn:
                log.warning("ignoring half-written checkpoint %s (no manifest: the job stopped while writing it)",
                            entry)
            continue
        if not entry.name.startswith(STEP_PREFIX) or not entry.is_dir():
            continue
        manifest = read_manifest(entry)
        problem = "no valid manifest" if manifest is None else _files_present(entry, manifest)
        if problem:
            if warn:
                log.warning("ignoring incomplete checkpoint %s (%s)", entry, problem)
            continue
        found.append(CheckpointInfo(entry, int(manifest["step"]), manifest))
    return sorted(found, key=lambda c: c.step, reverse=True)
