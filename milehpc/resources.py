"""Where the shipped templates and site configs are: the repo (editable install) or the wheel's data dir."""

from __future__ import annotations

import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """Return the folder ``name`` (``sbatch`` or ``site-configs``) shipped with milehpc."""
    for base in (_REPO_ROOT, Path(sys.prefix) / "share" / "milehpc"):
        candidate = base / name
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"milehpc data folder '{name}' not found next to the package or in {sys.prefix}/share")
