"""Start-up hook installed (with a one-line ``.pth``) by scripts/setup-sglang-cpu.sh into the venv's site-packages:
what the real sglang engine needs to run on a CPU-only torch. Lazy: it waits for the import it prepares instead of
importing torch at every interpreter start (login-node commands must not import torch).

* torchvision from the package index is a CUDA build whose compiled ops do not load on a CPU-only torch; its
  ``_meta_registrations`` then fails at import with ``operator torchvision::nms does not exist``, and sglang's config
  code imports torchvision. Defining the two op schemas (signatures from ``torchvision/_meta_registrations.py``)
  before torchvision is imported lets the import finish.
* On a CPU with AMX, sglang 0.5.23's CPU layers call the sgl_kernel ops, which take bf16/fp16 only (a float32 engine
  dies at its first forward: ``"rmsnorm_kernel" not implemented for 'Float'``), and it packs the weights for them at
  load, after which a weight update fails (``'Parameter' object has no attribute 'weight_loader'``): no RL on it.
  sglang decides once, at import (``cpu_has_amx_support()`` in 50-odd modules), so a process that has ``AMX_OFF_ENV``
  set (milehpc sets it before it starts a CPU engine; the scheduler inherits it) sees no AMX tiles when sglang is
  first imported, and takes the plain-torch path it takes on CPUs without AMX.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys
from typing import Any

AMX_OFF_ENV = "MILEHPC_SGLANG_CPU_NO_AMX"  # milehpc.rollout.sglang_engine.AMX_OFF_ENV
_LIBS: list[Any] = []  # a Library is unregistered when collected: keep it alive


def define_schemas() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already defined (a working torchvision build, or a second call)
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)


def hide_amx() -> None:
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


class _Before(importlib.abc.MetaPathFinder):
    """Runs ``prepare`` once, just before the first import of ``module``."""

    def __init__(self, module: str, prepare: Any) -> None:
        self.module, self.prepare = module, prepare

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == self.module:
            sys.meta_path.remove(self)
            self.prepare()
        return None  # the normal finders import the module


def _install(module: str, prepare: Any) -> None:
    if not any(isinstance(f, _Before) and f.module == module for f in sys.meta_path):
        sys.meta_path.insert(0, _Before(module, prepare))


_install("torchvision", define_schemas)
if os.environ.get(AMX_OFF_ENV) == "1":
    _install("sglang", hide_amx)
