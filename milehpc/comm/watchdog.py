"""Rank liveness: a heartbeat ring over MPI plus a process check for ranks on the same host.

Each rank sends a heartbeat to its successor and watches its predecessor (O(1) messages per rank, so it scales to
any world size); ranks on the same host are also checked by pid + start time (a killed neighbour is seen within one
tick). Whoever sees a rank vanish sends a notice naming it to every rank; a rank that receives a notice, or sees a
failure itself, ends within ``grace`` seconds even when its main thread is stuck inside a collective — the RL loop
never hangs on a dead peer. Notices also carry failures the main thread found (a timeout, an exception).

Rank 0 speaks for the job, and launchers (``mpirun``, ``srun --kill-on-bad-exit``) tear the job down at the first
non-zero exit: a rank that failed by itself therefore sends its notices synchronously and waits (bounded,
:meth:`Watchdog.settle`) until rank 0 has repeated its error (``TAG_REPORTED``) or is gone, before it exits.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TAG_HEARTBEAT, TAG_NOTICE, TAG_BYE, TAG_REPORTED = 31001, 31002, 31003, 31004


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int
    started: int  # start time in clock ticks after boot, so that a reused pid is not taken for our peer


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` from field 3 (state) on: the command name before it may hold spaces and parentheses."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].decode().split()


def _start_ticks(pid: int) -> int:
    # The kernel's start time in ticks after boot never changes. psutil's create_time() adds /proc/stat's btime,
    # which moves by a whole second when the clock is slewed or stepped: a live neighbour then looked dead.
    return int(_stat_fields(pid)[19])


def this_peer(rank: int) -> Peer:
    import socket

    return Peer(rank, socket.gethostname(), os.getpid(), _start_ticks(os.getpid()))


def _alive(peer: Peer) -> bool:
    try:
        fields = _stat_fields(peer.pid)
    except (OSError, IndexError, ValueError):  # no such process
        return False
    return fields[0] != "Z" and int(fields[19]) == peer.started


class Watchdog:
    """Background liveness checks for one rank. ``failure`` is the first failure seen (a one-line message)."""

    def __init__(self, comm: Any, peers: list[Peer], *, dead_after: float, interval: float = 0.5,
                 grace: float = 2.0, on_failure: Callable[[Watchdog], None] | None = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.peers = peers
        self.dead_after = dead_after
        self.interval = interval
        self.grace = grace
        self.on_failure = on_failure or default_on_failure
        self.failure: str | None = None
        self.on_report: Callable[[], None] | None = None  # called once rank 0 has printed the failure here
        self.failed_ranks: set[int] = set()
        self.detected_here = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sent: list[Any] = []
        me = peers[self.rank]
        # Only check pids we can verify now (a container with its own pid namespace would make them meaningless).
        self._local = [p for p in peers if p.rank != self.rank and p.host == me.host and _alive(p)]

    # ---- control ----------------------------------------------------------
    def start(self) -> None:
        if self.size > 1:
            self._thread = threading.Thread(target=self._run, name="milehpc-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (clean shutdown): tell the successor first, so it does not take our silence for death."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 1)
        if self.size > 1 and self.failure is None:
            with contextlib.suppress(Exception):  # a dead successor cannot be told
                self._sent.append(self.comm.isend(None, (self.rank + 1) % self.size, TAG_BYE))

    def declare(self, message: str, ranks: set[int] | frozenset[int] = frozenset(), *, notify: bool = True,
                detected: bool = True) -> bool:
        """Record a failure (first one wins) and tell every other rank. Returns False if one was already known."""
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = message
            self.failed_ranks |= set(ranks)
            self.detected_here = detected
        if notify:
            for dest in range(self.size):
                if dest == self.rank or dest in self.failed_ranks:
                    continue
                with contextlib.suppress(Exception):  # best effort: that rank may be gone as well
                    # Synchronous: complete only once the peer took it, so settle() knows it arrived.
                    self._sent.append(self.comm.issend(message, dest, TAG_NOTICE))  # keep the buffer alive
        return True

    def flush(self, timeout: float = 1.0) -> None:
        """Wait (at most ``timeout``) until the peers took the notices sent so far."""
        deadline = time.monotonic() + timeout
        while self._sent and time.monotonic() < deadline:
            try:
                self._sent = [r for r in self._sent if not r.Test()]
            except Exception:  # noqa: BLE001 - a dead destination: nothing more to do
                return
            time.sleep(0.01)

    def settle(self, timeout: float | None = None) -> None:
        """Before a rank that failed by itself exits (it has printed its error): stop the thread (its grace exit
        would cut this short) and wait until rank 0 has repeated the error or is gone — the launcher kills the
        others at this rank's exit; rank 0 itself waits until the peers took its notice. Meanwhile take the
        peers' notices: they may be settling too. Bounded by ``timeout`` (a frozen peer; default: the time rank 0
        needs to notice and report, with room for a loaded machine)."""
        self._halt()
        if self.rank == 0:
            self.reported()
        local0 = next((p for p in self._local if p.rank == 0), None)
        deadline = time.monotonic() + (self.grace + 10 * self.interval + 10.0 if timeout is None else timeout)
        while self.size > 1 and time.monotonic() < deadline:
            self._drain_notices()
            try:
                self._sent = [r for r in self._sent if not r.Test()]
            except Exception:  # noqa: BLE001 - a dead destination: nothing more will complete
                self._sent = []
            if (not self._sent) if self.rank == 0 else self._rank0_done(local0):
                return
            time.sleep(0.01)

    def reported(self) -> None:
        """Rank 0 has printed the failure: the ranks waiting in :meth:`settle` may exit now."""
        if self.rank != 0:
            return
        for dest in range(1, self.size):
            if dest not in self.failed_ranks:
                with contextlib.suppress(Exception):  # it may be gone already
                    self._sent.append(self.comm.isend(None, dest, TAG_REPORTED))
        self.flush(1.0)

    def _rank0_done(self, local0: Peer | None) -> bool:
        from mpi4py import MPI

        try:
            if self.comm.improbe(0, TAG_REPORTED) is not None or 0 in failed_ranks(self.comm):
                return True
        except MPI.Exception:  # with ULFM: rank 0 is gone
            return True
        return local0 is not None and not _alive(local0)

    def _drain_notices(self) -> None:
        from mpi4py import MPI

        try:
            while (msg := self.comm.improbe(MPI.ANY_SOURCE, TAG_NOTICE)) is not None:
                msg.recv()
        except MPI.Exception:  # ULFM refuses any-source while a failure is unacknowledged: ask each live peer
            for src in range(self.size):
                if src != self.rank and src not in self.failed_ranks:
                    with contextlib.suppress(MPI.Exception):
                        while (msg := self.comm.improbe(src, TAG_NOTICE)) is not None:
                            msg.recv()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval + 1)

    # ---- the thread -------------------------------------------------------
    def _run(self) -> None:
        from mpi4py import MPI

        pred, succ = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        watching_pred = True
        last_seen = time.monotonic()
        pending: list[Any] = []
        failed_at: float | None = None
        warned = False
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if self.failure is None:
                    pending = [r for r in pending if not r.Test()]
                    if len(pending) < 64:  # a dead successor on shared memory never drains them
                        pending.append(self.comm.isend(None, succ, TAG_HEARTBEAT))
                while (msg := self.comm.improbe(pred, TAG_HEARTBEAT)) is not None:
                    msg.recv()
                    last_seen = now
                while (msg := self.comm.improbe(MPI.ANY_SOURCE, TAG_BYE)) is not None:
                    st = MPI.Status()
                    msg.recv(status=st)
                    if st.Get_source() == pred:
                        watching_pred = False
                status = MPI.Status()
                while (msg := self.comm.improbe(MPI.ANY_SOURCE, TAG_NOTICE)) is not None:
                    text = msg.recv(status=status)
                    self.declare(text, notify=False, detected=False)
                for peer in self._local:
                    if peer.rank not in self.failed_ranks and not _alive(peer):
                        self.declare(f"rank {peer.rank} (pid {peer.pid} on {peer.host}) is gone: "
                                     f"its process exited or was killed", {peer.rank})
                if watching_pred and self.failure is None and now - last_seen > self.dead_after:
                    host = self.peers[pred].host
                    self.declare(f"rank {pred} (on {host}) stopped responding: no heartbeat for "
                                 f"{now - last_seen:.0f} s (dead, hung, or its node is gone)", {pred})
            except MPI.Exception as err:  # with ULFM, talking to a dead rank raises instead of hanging
                dead = failed_ranks(self.comm)
                if dead:
                    names = ", ".join(str(r) for r in sorted(dead))
                    self.declare(f"rank{'s' if len(dead) > 1 else ''} {names} gone (MPI reports the process failed)",
                                 dead)
                else:
                    self.declare(f"MPI error in the liveness checks: {err}")
            except Exception as err:  # noqa: BLE001 - a bug here must not silently stop the checks
                if not warned:
                    report(self.rank, f"warning: liveness check error (continuing): {err!r}")
                    warned = True
            if self.failure is not None:
                failed_at = failed_at or now
                if now - failed_at >= self.grace:
                    self.on_failure(self)
                    return
            self._stop.wait(self.interval)


def failed_ranks(comm: Any) -> set[int]:
    try:
        from mpi4py import MPI

        group = comm.Get_failed()
        if group.Get_size() == 0:
            return set()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), comm.Get_group())
        return {r for r in ranks if r >= 0}
    except Exception:  # noqa: BLE001 - MPI without ULFM
        return set()


def report(rank: int, message: str) -> None:
    prefix = "" if message.startswith("warning:") else "error: "
    print(f"milehpc: {prefix}rank {rank}: {message}", file=sys.stderr, flush=True)


def default_on_failure(dog: Watchdog) -> None:
    """The main thread did not end by itself (it is stuck in a collective): report and end the process.
    ``os._exit`` skips MPI_Finalize, which would wait for the dead rank."""
    if dog.detected_here or dog.rank == 0:
        report(dog.rank, dog.failure or "failure")
        if dog.rank == 0 and dog.on_report is not None:
            dog.on_report()
    dog.settle()  # the launcher ends the others at this exit: not before rank 0 has said what failed
    sys.stdout.flush()
    os._exit(1)
