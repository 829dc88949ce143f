"""The entry point of every rank inside the job: ``milehpc launch RUN_DIR`` under srun or mpirun.

Reads ``RUN_DIR/plan.json`` and ``RUN_DIR/job.json`` (written by ``milehpc submit``), checks that the MPI world is
the one the plan was made for, brings up the communicators (``milehpc.comm.world.bootstrap``) and calls the
entry (``milehpc.runtime.loop:run`` unless one is given as ``module:function``, by ``--entry`` or by the job's
``[env] MILEHPC_ENTRY``, which reaches the ranks through the rendered job script) with a ``RunContext``.

On failure this function does not return: it reports (rank 0, and the rank that saw the failure first) and ends the
process with the error's exit code via ``os._exit``, because MPI_Finalize would wait for a rank that is gone. The
other ranks are told by the watchdog and end within its timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError, MilehpcError
from milehpc.runtime.run_files import load_run_dir

DEFAULT_ENTRY = "milehpc.runtime.loop:run"


def _mpi_rank_from_env() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


# Set by launch(): where rank 0 marks that it reported the job's failure (render.script.FAILED_FILE).
_failed_marker: Path | None = None


def _say(message: str, rank: int) -> None:
    print(f"milehpc: error: rank {rank}: {message}", file=sys.stderr, flush=True)
    if rank == 0:
        _mark_failed()


def _mark_failed() -> None:
    """Rank 0 has reported the failure: the job script need not wait for the launcher beyond a grace (it may wait for
    a step on a node it cannot reach until Slurm declares the node down)."""
    if _failed_marker is not None:
        with contextlib.suppress(OSError):  # the report itself is what matters
            _failed_marker.parent.mkdir(parents=True, exist_ok=True)
            _failed_marker.touch()


def _end(code: int, message: str | None, rank: int) -> None:
    if message:
        _say(message, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_before_mpi(err: MilehpcError, rank: int) -> None:
    """Every rank met the same error before the ranks could talk: rank 0 says it in one line. The launcher tears the
    job down at the first non-zero exit, so the other ranks leave a moment later, not before rank 0 has spoken."""
    if rank != 0:
        time.sleep(1.0)
    _end(err.exit_code, str(err) if rank == 0 else None, rank)


def _check_interfaces(world: Any, run_dir: str | os.PathLike[str], timeout: float) -> None:
    """The site's socket interfaces (GLOO_/NCCL_SOCKET_IFNAME) on every node, before gloo or NCCL would fail on
    them with a C++ traceback or a hang. Every rank checks its node and the ranks compare (a timed nonblocking
    allgather of one flag): rank 0 speaks when every node lacks them, else each rank whose node does; all end."""
    from array import array

    from milehpc.comm.net import check_socket_ifnames

    try:
        check_socket_ifnames(os.environ, file=str(Path(run_dir) / "site.json"))
        error = None
    except MilehpcError as err:
        error = err
    rank, size = world.Get_rank(), world.Get_size()
    flags = array("i", [0] * size)
    request = world.Iallgather(array("i", [int(error is not None)]), flags)
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:  # a rank that never came: the start-up barrier will name it
            break
        time.sleep(0.01)
    if error is None and not any(flags):
        return
    speak = error is not None and (rank == 0 or not all(flags))
    if rank != 0:
        time.sleep(1.0)  # as in _end_before_mpi: rank 0's line first
    _end(2, str(error) if speak and error is not None else None, rank)


def launch(run_dir: str | os.PathLike[str], entry: str | None = None, *, elastic: str | None = None,
           engine_base: int = 0) -> None:
    """Run this rank of the job in ``run_dir``; returns only on success (see the module docstring).
    ``elastic``: ``"trainer"``, the trainer ranks' step of an elastic-rollout job (their own world); ``"engine"``,
    one engine of a rollout node's step (engine ``engine_base`` + its task's local id; no MPI)."""
    if elastic == "engine":
        _launch_engine(run_dir, engine_base + int(os.environ.get("SLURM_LOCALID", "0") or 0))
        return
    import faulthandler

    from milehpc.hygiene import install_log_masking
    from milehpc.runtime.signals import install_rank_handlers

    global _failed_marker
    from milehpc.render.script import FAILED_FILE

    _failed_marker = Path(run_dir) / FAILED_FILE
    faulthandler.enable()  # a rank that dies in native code (segfault, abort) still says where, in the job's log
    install_log_masking()
    install_rank_handlers(run_dir)  # scancel's TERM: checkpoint at the next step boundary, do not die (signals 8)
    try:
        job, plan, partition = load_run_dir(run_dir)
        if elastic == "trainer":
            plan = plan.trainer_only()
        from milehpc.config.requirements import check_requirements

        check_requirements(job)  # here, not at submit: the login node lacks the container's GPU packages
    except MilehpcError as err:
        rank = _mpi_rank_from_env()
        _end_before_mpi(err, rank)
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size != plan.world_size:
        hint = (" (every rank alone in a world of 1: the launcher's MPI plugin does not match this MPI library, "
                "e.g. srun --mpi=pmix for Open MPI)" if size == 1 else "")
        err = ConfigError(f"expected an MPI world of {plan.world_size} ranks, got {size}: start the job with "
                          f"`mpirun -np {plan.world_size}` or `srun -n {plan.world_size}`{hint}",
                          file=str(Path(run_dir) / "plan.json"), field="world_size")
        _end_before_mpi(err, rank)
        return

    _check_interfaces(world, run_dir, job.resources.startup_timeout_s)

    from milehpc.comm.context import RunContext
    from milehpc.comm.world import bootstrap
    from milehpc.plugin_types import load_ref
    from milehpc.runtime.signals import RequeueExit

    comms = None
    try:
        run_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("MILEHPC_RUN_ID") or Path(run_dir).resolve().name
        comms = bootstrap(plan, job, run_id=run_id, master_addr=partition.get("master_addr"))
        comms.watchdog.on_report = _mark_failed  # rank 0's report from the watchdog's thread
        if rank == 0:
            _record_hosts(run_dir, [p.host for p in comms.peers])
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        ctx = RunContext(job=job, plan=plan, comms=comms, run_dir=Path(run_dir),
                         restart_count=int(restarts) if restarts.isdigit() else 0, partition=partition)
        load_ref(entry or os.environ.get("MILEHPC_ENTRY") or DEFAULT_ENTRY)(ctx)
        comms.close()
        if rank == 0:
            _mark_done(run_dir)
        _end_past_the_saver()
    except RequeueExit as err:  # every rank checkpointed on request (runtime.signals): end quietly with 75
        if comms is not None:
            comms.watchdog.stop()
        _end(err.exit_code, None, rank)
    except MilehpcError as err:
        _fail(comms, rank, str(err), err.exit_code)
    except SystemExit as err:  # sys.exit() in the entry: the others must not wait for this rank
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if code == 0 and comms is not None:
            comms.close()
            if rank == 0:
                _mark_done(run_dir)
            _end_past_the_saver()
            return
        _fail(comms, rank, f"exited with status {code} (sys.exit in the entry)", code or 1)
    except (Exception, KeyboardInterrupt) as err:  # a bug or an interrupt: show where, and end the others too
        traceback.print_exc()
        _fail(comms, rank, f"{type(err).__name__}: {err}", 1)


def _launch_engine(run_dir: str | os.PathLike[str], engine_id: int) -> None:
    """An elastic engine's process (:mod:`milehpc.runtime.elastic.engine`): its failure is one line and its own exit
    status; the trainer goes on without it."""
    import faulthandler

    from milehpc.runtime.elastic.engine import run_engine

    faulthandler.enable()
    try:
        run_engine(run_dir, engine_id)
    except MilehpcError as err:
        print(f"milehpc: error: engine {engine_id}: {err}", file=sys.stderr, flush=True)
        os._exit(err.exit_code)
    except (Exception, KeyboardInterrupt) as err:
        traceback.print_exc()
        print(f"milehpc: error: engine {engine_id}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def _end_past_the_saver() -> None:
    """A colocated rank's clean end: the interpreter's teardown would fail in torch_memory_saver (see
    :func:`milehpc.runtime.offload.end_process`), so a rank that used it ends here with 0."""
    import sys

    if "torch_memory_saver" in sys.modules:
        from milehpc.runtime.offload import end_process, saver_initialised

        if saver_initialised():
            from mpi4py import MPI

            if MPI.Is_initialized() and not MPI.Is_finalized():
                MPI.Finalize()  # what the skipped teardown would do: a rank ending without it fails under mpirun
            end_process(0)


HOSTS_FILE = ".milehpc/hosts.json"


def _record_hosts(run_dir: str | os.PathLike[str], hosts: list[str]) -> None:
    """Where every rank runs, as each reported its host name at start-up (``RUN_DIR/.milehpc/hosts.json``, one
    entry per run of the job): what ``milehpc plan --ranks`` promised, checked against what the launcher did."""
    import json

    path = Path(run_dir) / HOSTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append({"job_id": os.environ.get("SLURM_JOB_ID"), "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                 "nodelist": os.environ.get("SLURM_JOB_NODELIST"), "hosts": hosts})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(runs, indent=1) + "\n")
    tmp.replace(path)


def _mark_done(run_dir: str | os.PathLike[str]) -> None:
    """Tell the job script the ranks really ran and finished (a launcher can exit 0 without starting them)."""
    from milehpc.render.script import DONE_FILE

    marker = Path(run_dir) / DONE_FILE
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def _fail(comms: Any, rank: int, message: str, code: int) -> None:
    if comms is None:
        _end(code, message, rank)
        return
    dog = comms.watchdog
    if dog.failure is not None and not dog.detected_here and message.endswith(dog.failure):
        # Another rank's failure, already reported by whoever saw it: only rank 0 repeats it.
        if rank == 0:
            _say(message, rank)
    else:
        dog.declare(message if message.startswith(f"rank {rank}") else f"rank {rank} failed: {message}")
        _say(message, rank)
    # The launcher ends every rank at the first non-zero exit: not before the others heard and rank 0 said it.
    dog.settle()
    _end(code, None, rank)


def main(argv: list[str] | None = None) -> None:
    """``python -m milehpc.runtime.launch RUN_DIR [--entry module:function]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="milehpc launch")
    parser.add_argument("run_dir")
    parser.add_argument("--entry", default=None, help="module:function called with the RunContext")
    parser.add_argument("--elastic", choices=("trainer", "engine"), default=None)
    parser.add_argument("--engine-base", type=int, default=0)
    args = parser.parse_args(argv)
    launch(args.run_dir, args.entry, elastic=args.elastic, engine_base=args.engine_base)


if __name__ == "__main__":
    main()
