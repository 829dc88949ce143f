"""One elastic engine: a process of a rollout node's job step (no MPI), joining trainer rank 0 over TCP (see the
package docstring and :mod:`.hub` for the messages). It builds its engine, finds the trainer's address in the run
directory, proves it holds the job's secret, joins a weight-sync group when told, and generates the prompts it is
given, one group per prompt, each from the prompt's own seed."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from milehpc.errors import RuntimeFailure
from milehpc.runtime.elastic import ADDRESS_FILE, HEARTBEAT_S, SECRET_FILE, prompt_seed


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
    import torch
    from torch.distributed import TCPStore

    from milehpc.comm.channel import connect
    from milehpc.rollout.endpoint_auth import job_token
    from milehpc.rollout.reference import build_engine
    from milehpc.runtime.elastic import weights as ew
    from milehpc.runtime.loop.rollout_side import RolloutSide
    from milehpc.runtime.run_files import load_run_dir

    rdir = Path(run_dir)
    job, _, _ = load_run_dir(rdir)
    timeout = float(job.resources.collective_timeout_s)
    engine = build_engine(job, rank=engine_id)
    # engine_index only decides who prints the data summary (once: engine 0)
    side = RolloutSide(job, engine, engine_index=min(engine_id, 1), num_engines=2, file=str(rdir / "job.toml"))
    where = trainer_address(rdir, job.resources.startup_timeout_s)
    conn = connect(where["address"], int(where["port"]), job_token(rdir / ".milehpc", name=SECRET_FILE), timeout)
    conn.sock.settimeout(timeout)  # the trainer's heartbeat comes every second: silence this long means it is gone
    stop = threading.Event()
    conn.send(("hello", engine_id, socket.gethostname()))
    threading.Thread(target=_heartbeat, args=(conn, stop), daemon=True).start()
    store: Any = None
    group: Any = None
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
                if store is None:
                    store = TCPStore(where["address"], int(where["store_port"]), 1, False, timedelta(seconds=timeout))
                group = ew.make_group(store, msg[1], 1, timeout)
            elif kind == "weights":
                _, version, meta = msg
                buf = torch.empty(sum(m[3] for m in meta), dtype=torch.uint8)
                ew.wait(ew.start_broadcast(group, buf), timeout, f"engine {engine_id}: weights {version}")
                side.update_weights(ew.unpack(meta, buf), version)
            elif kind == "work":
                _, step, indices = msg
                for index in indices:
                    group_out, stats = side.generate_one(side.source.peek(index), prompt_seed(job.run.seed, index))
                    conn.send(("result", step, index, group_out, stats))
    finally:
        stop.set()
        conn.close()
