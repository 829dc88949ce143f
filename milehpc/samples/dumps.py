"""HDF5 rollout dumps: one file per step, ``RUN_DIR/rollouts/step_NNNNNN.h5``.

The samples are written by the shared codec (:mod:`milehpc.samples.h5`) in compact mode (int32 ids, float32
logprobs) into the file's root group, so any HDF5 tool sees flat datasets (``prompt_ids`` + ``prompt_ids_offsets``,
``reward``, ``response_text``...); the file's attributes hold ``step`` and the caller's attrs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from milehpc.samples import Sample
from milehpc.samples.h5 import read_samples, write_samples


def rollout_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step:06d}.h5"


def write_rollouts(run_dir: str | Path, step: int, samples: list[Sample], attrs: dict[str, Any] | None = None) -> Path:
    """Write one step's samples (atomically: a temp file renamed into place)."""
    import h5py

    path = rollout_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            write_samples(f, samples, compact=True)
            f.attrs["step"] = step
            for key, value in (attrs or {}).items():
                f.attrs[key] = value
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_rollouts(run_dir: str | Path, step: int) -> tuple[list[Sample], dict[str, Any]]:
    """The samples of one step and the file's attributes."""
    import h5py

    path = rollout_path(run_dir, step)
    if not path.is_file():
        from milehpc.errors import MilehpcError

        have = list_steps(run_dir)
        hint = f"have steps {have[0]}..{have[-1]}" if have else "no rollout dumps in this run"
        raise MilehpcError(f"no rollouts for step {step} ({hint})", file=str(path))
    with h5py.File(path, "r") as f:
        samples = read_samples(f)
        attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    return samples, attrs


def list_steps(run_dir: str | Path) -> list[int]:
    d = Path(run_dir) / "rollouts"
    return sorted(int(p.stem.split("_")[1]) for p in d.glob("step_*.h5")) if d.is_dir() else []


def drop_from(run_dir: str | Path, step: int) -> list[int]:
    """Remove the dumps of ``step`` and later (a resumed run writes them again from its own samples, which after a
    crash past the checkpoint may differ from the lost run's). Returns the steps removed."""
    gone = [s for s in list_steps(run_dir) if s >= step]
    for s in gone:
        rollout_path(run_dir, s).unlink(missing_ok=True)
    return gone
