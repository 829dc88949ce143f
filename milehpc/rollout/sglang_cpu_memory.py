"""A CPU engine's memory as an explicit byte budget, not the host's free memory.

On a CPU, sglang 0.5.23 takes the host's *free* memory as its device memory (``get_available_gpu_memory("cpu")`` ->
``get_free_cpu_memory()``: ``psutil``'s available bytes, per NUMA node) and sizes the KV pool as the free memory after
loading the weights minus ``(1 - mem_fraction_static)`` of the free memory before
(``KVCacheConfigurator._profile_available_bytes``). Whatever other processes allocate between those two readings is
charged to the engine: on a busy machine the engine refuses to start ("Loaded weights leave no GPU memory for the KV
cache"), and the pool's size depends on what else runs.

A CPU engine therefore gets a fixed device of ``rollout.options.cpu_memory_gib``: milehpc passes the budget to the
scheduler in ``MEMORY_ENV``, and the scheduler, which imports :mod:`milehpc.rollout.sglang_engine` when it unpickles
the SIGQUIT handler (before the model loads), reports the budget less what its own process has grown by since then.
The pool is then ``mem_fraction_static * budget - weights``, capped by ``max_total_tokens``: the same on every
machine, whatever else holds memory. Stdlib only at import; sglang and psutil are imported by the call.
"""

from __future__ import annotations

import os
from typing import Any

MEMORY_ENV = "MILEHPC_SGLANG_CPU_MEMORY_BYTES"


def budget_env(gib: float) -> dict[str, str]:
    """The environment a CPU engine's scheduler reads its budget from."""
    return {MEMORY_ENV: str(int(gib * (1 << 30)))}


def budgeted_free_memory(budget: int, numa_nodes: int) -> Any:
    """A ``get_free_cpu_memory`` for one engine process: the budget (times the NUMA nodes, which sglang divides the
    free memory by) less the process's resident-memory growth since this call."""
    import psutil

    proc = psutil.Process()
    start = proc.memory_info().rss

    def free() -> int:
        return max(0, budget * numa_nodes - max(0, proc.memory_info().rss - start))

    return free


def apply_if_asked() -> None:
    """In an engine's scheduler (``MEMORY_ENV`` set): sglang's free-memory reading becomes the budget's. Idempotent."""
    raw = os.environ.get(MEMORY_ENV)
    if not raw:
        return
    from sglang.srt.utils import common

    if getattr(common.get_free_cpu_memory, "_milehpc_budget", None) == raw:
        return
    free = budgeted_free_memory(int(raw), max(1, len(common.get_cpu_ids_by_node())))
    free._milehpc_budget = raw  # type: ignore[attr-defined]
    common.get_free_cpu_memory = free
