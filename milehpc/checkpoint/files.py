"""Durable files: names inside a checkpoint directory, sha256, fsync of files and directories, and writes that
are complete on disk before anyone may rely on them."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

FORMAT = 1
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def rank_file(rank: int, suffix: str) -> str:
    return f"rank-{rank:05d}.{suffix}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def torch_save_durable(obj: Any, path: Path) -> None:
    """torch.save + fsync. torch turns a failed write (disk full) into a RuntimeError while closing its zip
    writer; hand the underlying OSError on so the caller reports it with the path."""
    import torch

    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        except RuntimeError as err:
            cause = err.__context__ or err.__cause__
            if isinstance(cause, OSError):
                cause.filename = cause.filename or str(path)
                raise cause from err
            raise
