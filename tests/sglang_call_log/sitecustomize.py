"""Put on the PYTHONPATH of a job's ranks by the colocated loop tests (tests/colocated_job.py): records what each
rank asks of the REAL ``sglang.Engine`` (and of milehpc's checkpointer) as one JSON line per call in
``$MILEHPC_STANDIN_LOG/rank<R>.jsonl``, the same file the faked torch_memory_saver binding records its region/pause/
resume into (tests/tms_real.py), so a test reads one per-rank story in call order.

The engine's own methods are wrapped per instance when milehpc starts one (``SGLangEngine._start``): ``generate``,
``release_memory_occupation``, ``resume_memory_occupation``, ``flush_cache``, ``shutdown``, and the weight-update
requests milehpc sends through the engine's tokenizer manager (``begin_weight_update``,
``update_weights_from_tensor``, ``update_weights_from_distributed``, ``end_weight_update``, with the engine's
answer). Nothing is faked: every call goes on to the real engine.

``MILEHPC_TEST_SCHEDULER_KILL="RANK:CALL:N[:before],..."`` SIGKILLs the real scheduler process of MPI rank RANK's
engine after (or just before, i.e. with the request in flight) the rank's N-th call of CALL, counted over the
engine's restarts, as a scheduler dying of a kernel fault would.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from milehpc.checkpoint.checkpointer import Checkpointer
from milehpc.rollout.sglang_engine import SGLangEngine

ENGINE_CALLS = ("generate", "release_memory_occupation", "resume_memory_occupation", "flush_cache", "shutdown")
REQUESTS = ("begin_weight_update", "update_weights_from_tensor", "update_weights_from_distributed", "end_weight_update")
RANK = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
_started = [0]
_counts: dict[str, int] = {}  # calls of this rank, over engine restarts


def record(call: str, **info: Any) -> None:
    with open(os.path.join(os.environ["MILEHPC_STANDIN_LOG"], f"rank{RANK}.jsonl"), "a") as f:
        f.write(json.dumps({"call": call, **info}) + "\n")


def _kills() -> set[tuple[str, int, bool]]:
    """This rank's staged kills: (call, n, before)."""
    out = set()
    for spec in filter(None, os.environ.get("MILEHPC_TEST_SCHEDULER_KILL", "").split(",")):
        rank, call, n, *when = spec.split(":")
        if rank == RANK:
            out.add((call, int(n), when == ["before"]))
    return out


KILLS = _kills()


def _ok(result: Any) -> bool:
    if isinstance(result, tuple):
        return bool(result[0])
    return bool(getattr(result, "success", True))


def _wrap(owner: SGLangEngine, target: Any, name: str) -> None:
    real = getattr(target, name)
    counts = _counts

    def staged(before: bool) -> None:
        if (name, counts[name], before) in KILLS:
            record("killed_scheduler", before=name if before else None, after=None if before else name)
            owner.kill_scheduler()

    def info(kwargs: dict[str, Any], args: tuple) -> dict[str, Any]:
        tags = kwargs.get("tags", args[0] if args and name.endswith("occupation") else None)
        return {"tags": tags} if tags is not None else {}

    if name in REQUESTS:
        @functools.wraps(real)
        async def request(obj: Any, *args: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            staged(True)
            result = await real(obj, *args)
            record(name, ok=_ok(result))
            staged(False)
            return result
        setattr(target, name, request)
        return

    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        counts[name] = counts.get(name, 0) + 1
        staged(True)
        out = real(*args, **kwargs)
        record(name, **info(kwargs, args))
        staged(False)
        return out
    setattr(target, name, call)


_start = SGLangEngine._start


def start(self: SGLangEngine) -> None:
    _start(self)
    _started[0] += 1
    record("Engine", instance=_started[0], memory_saver=bool(self.server_args.get("enable_memory_saver")))
    for name in ENGINE_CALLS:
        _wrap(self, self._engine, name)
    for name in REQUESTS:
        _wrap(self, self._engine.tokenizer_manager, name)


SGLangEngine._start = start
_save = Checkpointer.save


def save(self: Checkpointer, step: int, state: Any, **kw: Any) -> Any:
    record("checkpoint", tag=str(step))
    return _save(self, step, state, **kw)


Checkpointer.save = save
