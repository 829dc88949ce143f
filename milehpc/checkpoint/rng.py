"""The process RNG (python, numpy, torch CPU and every CUDA/ROCm device): captured with every checkpoint shard and
restored once, last, on resume; or derived from (seed, rank, step) where no saved stream exists. The only save and
restore of the process RNG: engines and trainers keep their own *sampling* or layout-specific generators in their
own state."""

from __future__ import annotations

import random
from typing import Any


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (CPU, and every CUDA/ROCm device) RNG states of this process, in types
    ``torch.load(weights_only=True)`` accepts."""
    import numpy as np
    import torch

    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def derive_rng(seed: int, rank: int, step: int) -> None:
    """Seed python/numpy/torch from (seed, rank, step): a rank resumed at another layout has no saved stream."""
    import numpy as np
    import torch

    value = ((seed * 1_000_003 + rank) * 1_000_003 + step) % (2**63)
    random.seed(value)
    np.random.seed(value % (2**32))
    torch.manual_seed(value)


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
