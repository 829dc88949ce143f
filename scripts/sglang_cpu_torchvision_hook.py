"""Start-up hook installed (with a one-line ``.pth``) by scripts/setup-sglang-cpu.sh into the venv's site-packages.

torchvision from the package index is a CUDA build whose compiled ops do not load on a CPU-only torch; its
``_meta_registrations`` then fails at import with ``operator torchvision::nms does not exist``, and sglang's config
code imports torchvision. Defining the two op schemas (signatures from ``torchvision/_meta_registrations.py``) before
torchvision is imported lets the import finish. The hook is lazy: it waits for ``import torchvision`` instead of
importing torch at every interpreter start (login-node commands must not import torch)."""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any

_LIBS: list[Any] = []  # a Library is unregistered when collected: keep it alive


def define_schemas() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already defined (a working torchvision build, or a second call)
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_schemas()
        return None  # the normal finders import the module


if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
