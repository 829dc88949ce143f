"""One elastic engine: a process of a rollout node's job step (no MPI), joining trainer rank 0 over TCP (see the
package docstring and :mod:`.hub` for the messages). It builds its engine through the job's engine plugin (the
factory the rollout ranks use, :mod:`.seat` gives it the context it reads), finds the trainer's address in the run
directory, proves it holds the job's secret, joins a weight-update group of two when told (the engine's own update
path: SGLang's schedulers take the buckets themselves, :mod:`.weights`), and generates the prompts it is
given, one group per prompt, each from the prompt's own seed."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from milehpc.errors import RuntimeFailure
from milehpc.faults import maybe_fail
from milehpc.runtime.elastic import ADDRESS_FILE, ENGINE_KEY, HEARTBEAT_S, SECRET_FILE, prompt_seed


def trainer_address(run_dir: Path, timeout: float) -> dict[str, Any]:
    """Trainer rank 0's address for this run of the job (written when it is listening)."""
    path = run_dir / ADDRESS_FILE
    job_id = os.environ.get("SLURM_JOB_ID", "")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    deadline = time.monotonic() + timeout
    while True:
        try:
            where = json.loads(path.read_text())
            if where.get("job_id", "") == job_id and str(where.get("restart")) == restart:
                return where
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"trainer rank 0 did not publish its address ({path}) within {timeout:.0f} s")
        time.sleep(0.2)


def _heartbeat(conn: Any, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            conn.send(("hb",))
        except OSError:
            return


def run_engine(run_dir: str | os.PathLike[str], engine_id: int) -> None:
    """Serve the trainer until it says stop; raises :class:`RuntimeFailure` when it is gone."""
    from milehpc.runtime.elastic.seat import build_engine
    from milehpc.runtime.run_files import load_run_dir

    rdir = Path(run_dir)
    job, plan, partition = load_run_dir(rdir)
    timeout = float(job.resources.collective_timeout_s)
    engine = build_engine(job, plan, partition, rdir, engine_id)
    try:
        _serve(job, rdir, engine, engine_id, timeout)
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:  # an SGLang engine's processes end with it, whatever ended the serving
            shutdown()


def _serve(job: Any, rdir: Path, engine: Any, engine_id: int, timeout: float) -> None:
    from milehpc.comm.channel import connect
    from milehpc.rollout.endpoint_auth import job_token
    from milehpc.runtime.elastic.weights import Receiver
    from milehpc.runtime.loop.rollout_side import RolloutSide

    # engine_index only decides who prints the data summary (once: engine 0)
    side = RolloutSide(job, engine, engine_index=min(engine_id, 1), num_engines=2, file=str(rdir / "job.toml"))
    receiver = Receiver(job, side, engine_id, timeout)
    where = trainer_address(rdir, job.resources.startup_timeout_s)
    conn = connect(where["address"], int(where["port"]), job_token(rdir / ".milehpc", name=SECRET_FILE), timeout)
    conn.sock.settimeout(timeout)  # the trainer's heartbeat comes every second: silence this long means it is gone
    stop = threading.Event()
    conn.send(("hello", engine_id, socket.gethostname()))
    threading.Thread(target=_heartbeat, args=(conn, stop), daemon=True).start()
    try:
        while True:
            try:
                msg = conn.recv()
            except TimeoutError:
                raise RuntimeFailure(f"heard nothing from trainer rank 0 within {timeout:.0f} s (it is gone, or this "
                                     f"node is cut off)") from None
            except (OSError, ConnectionError) as err:
                raise RuntimeFailure(f"lost trainer rank 0 ({err})") from None
            kind = msg[0]
            if kind == "hb":
                continue
            if kind == "stop":
                return
            if kind == "group":
                receiver.join(*msg[1:])
            elif kind == "weights":
                receiver.receive(*msg[1:])
            elif kind == "work":
                _, step, indices = msg
                maybe_fail("generate", step)  # MILEHPC_FAULT=generate:STEP: this engine dies as its node would
                for index in indices:
                    group_out, stats = side.generate_one(side.source.peek(index), prompt_seed(job.run.seed, index))
                    for s in group_out:  # which engine made it (the rollout dumps keep it)
                        s.metadata[ENGINE_KEY] = engine_id
                    conn.send(("result", step, index, group_out, stats))
    finally:
        stop.set()
        conn.close()
