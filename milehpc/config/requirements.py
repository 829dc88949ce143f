"""The optional GPU packages a job spec needs, checked before anything heavy is imported.

A job that selects SGLang (``rollout.engine = "sglang"``), colocated SGLang (``resources.colocate = true``, which
offloads with torch_memory_saver) or FP8 (``trainer.precision = "fp8"``, transformer-engine) fails with one line
naming the setting and the package (exit code 2) when the package is absent. Only ``importlib.util.find_spec`` is
used: importing transformer_engine without a GPU raises RuntimeError, and sglang pulls a CUDA torch.

Call :func:`check_requirements` where the job runs (``milehpc run`` locally, ``milehpc launch`` on every rank);
on a login node whose Python lacks the GPU stack that the container provides, submit must not call it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from milehpc.errors import missing_dependency

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec


def requirements(job: JobSpec) -> list[tuple[str, str]]:
    """(setting, module) pairs this job needs beyond the CPU stack."""
    out: list[tuple[str, str]] = []
    if job.rollout.engine == "sglang":
        out.append(("rollout.engine = 'sglang'", "sglang"))
        if job.resources.colocate:
            out.append(("resources.colocate = true with the sglang engine", "torch_memory_saver"))
    if job.trainer.precision == "fp8":
        out.append(("trainer.precision = 'fp8'", "transformer_engine"))
    return out


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_requirements(job: JobSpec) -> None:
    """Raise the one-line PluginError for the first missing package."""
    for what, module in requirements(job):
        if not _installed(module):
            raise missing_dependency(what, module.replace("_", "-"))
