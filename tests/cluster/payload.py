"""Tiny entries for the Slurm tests, run by milehpc's real launch (``milehpc launch RUN_DIR --entry payload:NAME``)
inside jobs of the test cluster. ``python_standin`` writes the stand-in for the ranks' Python that adds the
``--entry`` (the rendered script runs ``<python> -m milehpc launch RUN_DIR``; MILEHPC_PYTHON points at it).

Each entry gets the RunContext (job, plan, comms, run_dir, restart_count) and writes what the test checks into
``RUN_DIR/out/``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _out(ctx: Any) -> Path:
    out = Path(ctx.run_dir) / "out"
    out.mkdir(exist_ok=True)
    return out


def hello(ctx: Any) -> None:
    """Every rank says who it is (stdout: the batch log) and writes it to a file; the world must be the plan's."""
    world = ctx.comms.world
    size = world.Get_size()
    assert size == ctx.plan.world_size, f"world {size} != plan {ctx.plan.world_size}"
    print(f"payload hello from rank {ctx.comms.rank} of {size} (restart {ctx.restart_count})", flush=True)
    (_out(ctx) / f"hello-{ctx.comms.rank}.json").write_text(json.dumps({
        "rank": ctx.comms.rank, "size": size, "job_id": os.environ.get("SLURM_JOB_ID"),
        "array_task": os.environ.get("SLURM_ARRAY_TASK_ID"), "env": os.environ.get("SWEEP_VALUE"),
        "lr": ctx.job.trainer.lr}))


def sleep(ctx: Any) -> None:
    """Runs until cancelled (at most 5 minutes), printing a heartbeat."""
    for i in range(600):
        print(f"payload sleeping {i}", flush=True)
        time.sleep(0.5)


def count(ctx: Any) -> None:
    """Counts steps into RUN_DIR/out/steps.txt (one line per step: step, restart), 0.2 s per step, keeping its
    cursor in a small state file written atomically. At a checkpoint request (milehpc.runtime.signals: the
    batch shell's trap on Slurm's USR1 creates the file) it saves the cursor after the step it finished,
    acknowledges and exits 75 so that the batch script requeues the job. After a restart, or when it finds a
    saved cursor (`milehpc submit --resume`), it counts ``COUNT_AFTER_RESTART`` more steps and ends."""
    from milehpc.runtime.signals import EXIT_REQUEUE, RequestWatcher

    out = _out(ctx)
    state = out / "state.json"
    step = json.loads(state.read_text())["next"] if state.exists() else 0
    resumed = ctx.restart_count or state.exists()
    stop = step + int(os.environ.get("COUNT_AFTER_RESTART", "10")) if resumed else None
    watcher = RequestWatcher(ctx.run_dir, rank=ctx.comms.rank)
    print(f"payload count: starting at step {step}, restart {ctx.restart_count}", flush=True)
    with (out / "steps.txt").open("a") as fh:
        while stop is None or step < stop:
            fh.write(f"{step} {ctx.restart_count}\n")
            fh.flush()
            os.fsync(fh.fileno())
            step += 1
            _save(state, step)
            time.sleep(0.2)
            if watcher.requested():
                time.sleep(float(os.environ.get("COUNT_CHECKPOINT_S", "0")))  # a checkpoint that takes a while
                watcher.acknowledge(step, state)
                print(f"payload count: checkpoint request after step {step - 1}; exiting {EXIT_REQUEUE}", flush=True)
                sys.stdout.flush()
                ctx.comms.close()
                os._exit(EXIT_REQUEUE)
            if step > 2000:
                raise RuntimeError("never signalled")
    print(f"payload count: done at step {step}", flush=True)


def _save(path: Path, step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"next": step}))
    os.replace(tmp, path)


def python_standin(path: Path, python: str = sys.executable) -> Path:
    """Write an executable that the rendered launch line calls as the ranks' Python: for
    ``-m milehpc launch RUN_DIR`` it runs milehpc's launch with ``--entry $MILEHPC_TEST_ENTRY``."""
    path.write_text(f"""#!/bin/bash
if [ "$1 $2 $3" = "-m milehpc launch" ] && [ -n "${{MILEHPC_TEST_ENTRY:-}}" ]; then
    exec {python} -m milehpc launch "$4" --entry "$MILEHPC_TEST_ENTRY"
fi
exec {python} "$@"
""")
    path.chmod(0o755)
    return path


def digit_share(samples: list[Any]) -> list[float]:
    """A reward that differs within almost every group (the share of digits in the response), so that every step of
    a tiny untrained model trains and changes the weights: for jobs that check the weights reach the engines."""
    return [sum(ch.isdigit() for ch in s.response_text) / max(1, len(s.response_text)) for s in samples]


digit_share.reward_kind = "batch"  # type: ignore[attr-defined]
