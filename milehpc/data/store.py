"""HDF5 rollout dumps: one file per step, ``RUN_DIR/rollouts/step_NNNNNN.h5``.

Ragged per-sample arrays are stored flat with an ``offsets`` array (``x[offsets[i]:offsets[i+1]]`` is sample i),
so a dump of thousands of samples is a handful of contiguous datasets that any HDF5 tool can read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from milehpc.rollout.sample import Sample, Status

_RAGGED = {"prompt_ids": "int32", "response_ids": "int32", "rollout_logprobs": "float32", "loss_mask": "int8"}


def rollout_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step:06d}.h5"


def write_rollouts(run_dir: str | Path, step: int, samples: list[Sample], attrs: dict[str, Any] | None = None) -> Path:
    """Write one step's samples (atomically: a temp file renamed into place)."""
    import h5py
    import numpy as np

    path = rollout_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with h5py.File(tmp, "w") as f:
        for key, dtype in _RAGGED.items():
            rows = [getattr(s, key) for s in samples]
            f.create_dataset(key, data=np.asarray([x for r in rows for x in r], dtype=dtype))
            f.create_dataset(f"{key}_offsets", data=np.cumsum([0, *map(len, rows)]).astype("int64"))
        f.create_dataset("reward", data=np.asarray([s.scalar_reward for s in samples], dtype="float32"))
        f.create_dataset("group", data=np.asarray([s.group for s in samples], dtype="int64"))
        f.create_dataset("index", data=np.asarray([s.index for s in samples], dtype="int64"))
        f.create_dataset("weight_version", data=np.asarray([s.weight_version for s in samples], dtype="int64"))
        strings = h5py.string_dtype()
        for key in ("prompt_text", "response_text"):
            f.create_dataset(key, data=[getattr(s, key) for s in samples], dtype=strings)
        f.create_dataset("status", data=[s.status.value for s in samples], dtype=strings)
        f.create_dataset("label", data=[json.dumps(s.label) for s in samples], dtype=strings)
        f.create_dataset("reward_detail", data=[json.dumps(s.reward) for s in samples], dtype=strings)
        f.attrs["step"] = step
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
    os.replace(tmp, path)
    return path


def read_rollouts(run_dir: str | Path, step: int) -> tuple[list[Sample], dict[str, Any]]:
    """The samples of one step and the file's attributes."""
    import h5py

    path = rollout_path(run_dir, step)
    if not path.is_file():
        from milehpc.errors import MilehpcError

        have = sorted(int(p.stem.split("_")[1]) for p in path.parent.glob("step_*.h5")) if path.parent.is_dir() else []
        hint = f"have steps {have[0]}..{have[-1]}" if have else "no rollout dumps in this run"
        raise MilehpcError(f"no rollouts for step {step} ({hint})", file=str(path))
    with h5py.File(path, "r") as f:
        n = len(f["reward"])
        ragged = {}
        for key in _RAGGED:
            flat, off = f[key][()].tolist(), f[f"{key}_offsets"][()].tolist()
            ragged[key] = [flat[off[i]:off[i + 1]] for i in range(n)]

        def strs(key: str) -> list[str]:
            return [x.decode() if isinstance(x, bytes) else x for x in f[key][()]]

        prompts, responses, status = strs("prompt_text"), strs("response_text"), strs("status")
        labels, details = strs("label"), strs("reward_detail")
        samples = [
            Sample(
                prompt_ids=ragged["prompt_ids"][i], response_ids=ragged["response_ids"][i],
                rollout_logprobs=ragged["rollout_logprobs"][i], loss_mask=ragged["loss_mask"][i],
                reward=json.loads(details[i]), status=Status(status[i]), group=int(f["group"][i]),
                index=int(f["index"][i]), weight_version=int(f["weight_version"][i]), label=json.loads(labels[i]),
                prompt_text=prompts[i], response_text=responses[i],
            )
            for i in range(n)
        ]
        attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    return samples, attrs


def list_steps(run_dir: str | Path) -> list[int]:
    d = Path(run_dir) / "rollouts"
    return sorted(int(p.stem.split("_")[1]) for p in d.glob("step_*.h5")) if d.is_dir() else []
