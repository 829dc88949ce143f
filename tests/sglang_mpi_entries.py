"""Entry points that tests/test_sglang_sync.py launches on every rank with ``milehpc launch --entry`` (mpirun).

The engine leaders run milehpc's real :class:`SGLangEngine` around :class:`SchedulerStandInEngine` (SGLang's
scheduler side, written from its source: sglang cannot be installed here); the trainer stage leaders run the real
:mod:`milehpc.weights.sglang`. Each rank writes ``RUN_DIR/out/rank-N.json``.
"""

from __future__ import annotations

from typing import Any

from runtime_mpi_entries import _write, model_tensors
from sglang_standin_scheduler import SchedulerStandInEngine


def sglang_sync(ctx: Any) -> None:
    """Two syncs (versions 1 and 2) from a PP=2 trainer into 2 engines; engine 1 dies and is restarted in place
    before the second, which makes every stage rebuild its update group."""
    import torch

    from milehpc.config.sglang_options import parse_options
    from milehpc.rollout.sglang_engine import SGLangEngine, sigquit_handler
    from milehpc.weights.sglang import sync_weights

    comms, plan = ctx.comms, ctx.plan
    engine = None
    if comms.rank in plan.engine_leaders():
        index, engine_rank = plan.engine_of(comms.rank)
        engine = SGLangEngine(ctx.job, {"model_path": "/m", "tp_size": 1}, parse_options({}), engine=index,
                              engine_rank=engine_rank, version=-1, engine_factory=SchedulerStandInEngine)

    def weights(version: int) -> list[tuple[str, Any]]:
        return [(n, t) for n, t in model_tensors(seed=version, layers=6) if t.dtype != torch.bool]

    def by_stage(version: int) -> Any:
        full = weights(version)
        split = len(full) // plan.pp
        return lambda stage: full[stage * split: (stage + 1) * split if stage < plan.pp - 1 else None]

    data: dict[str, Any] = {"rank": comms.rank}
    for version in (1, 2):
        if version == 2 and engine is not None and engine.engine_index == 1:
            sigquit_handler(3, None)  # its scheduler died ...
            assert not engine.health()
            engine.restart()  # ... and came back with empty weights and no update group
        metrics = sync_weights(comms, version, named_tensors=by_stage(version) if comms.is_trainer else None,
                               engine=engine, bucket_bytes=4096, run_id=f"test-{ctx.run_dir.name}")
        if engine is not None:
            got, want = engine._engine.weights, dict(weights(version))
            exact = set(got) == set(want) and all(torch.equal(got[n], t) and got[n].dtype == t.dtype
                                                  for n, t in want.items())
            data[f"v{version}"] = {"exact": exact, "tensors": len(got), "version": engine.weight_version(),
                                   "flushes": engine._engine.flushes, "restarts": engine.restarts,
                                   "groups": sorted(engine.update_groups)}
        elif metrics:
            data[f"v{version}"] = {"bytes": metrics["sync/bytes"]}
    _write(ctx, data)
