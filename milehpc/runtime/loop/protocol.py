"""The loop's messages between ranks (separate trainer and rollout groups) and the mailbox that moves them.

Every message is a small pickled tuple over the control communicator (``comms.ctrl``), on one of these tags:

=============  ================================  ====================================================================
tag            direction                         messages
=============  ================================  ====================================================================
TAG_BATCH      engine leader → trainer rank 0    ``(BATCH, b, groups, stats)``; ``(RESYNC, b, [], {})`` after the
                                                 engine restarted; ``(BYE, step, [], {})`` after its last batch
TAG_NOTICE     trainer rank 0 → rollout ranks    ``(WEIGHTS, version)`` (a weight sync follows), ``(EVAL_WEIGHTS,
                                                 (version, step))`` (a sync, then evaluate: :mod:`.evaluation`),
                                                 ``(CHECKPOINT, {"step", "stop"})``, ``(STOP, -1)``; taken between
                                                 generations only
TAG_SHARE      trainer rank 0 → trainer ranks    ``(step, groups, last)``, or ``(step, RESYNC, version)``: an engine
                                                 restarted, join a re-sync of ``version`` first; SGLang: ``(step,
                                                 EVAL_DONE, False)`` after step ``step``'s evaluation is in
TAG_RESYNC     trainer rank 0 → rollout ranks    ``(WEIGHTS, version)`` of a re-sync (SGLang), ``(STOP, -1)``
TAG_ALIVE      engine leader ↔ engine leaders    ``(b, healthy)`` before batch ``b`` (SGLang router)
TAG_EVAL       engine leader → trainer rank 0    ``(step, EvalShare)``: its share of step ``step``'s evaluation;
                                                 ``(step, RESYNC)``: its engine restarted during it (SGLang)
=============  ================================  ====================================================================

Sends never block (a blocking send could deadlock against a peer busy in a weight broadcast): the mailbox keeps each
request and :meth:`Mailbox.flush` waits for all of them, with the deadline, before the rank ends. Receives poll a
matched probe against the comms' deadline, so a dead peer ends the wait with a message naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from milehpc.comm.world import Comms

TAG_BATCH, TAG_NOTICE, TAG_SHARE = 32101, 32102, 32103
TAG_RESYNC, TAG_ALIVE, TAG_EVAL = 32104, 32105, 32106

# Message kinds.
BATCH, RESYNC, BYE, EVAL_DONE = "batch", "resync", "bye", "eval-done"
WEIGHTS, CHECKPOINT, STOP, EVAL_WEIGHTS = "weights", "checkpoint", "stop", "weights+eval"
STOP_NOTICE = (STOP, -1)


class Mailbox:
    """One rank's end of the loop's control messages (see the module docstring)."""

    def __init__(self, comms: Comms) -> None:
        self.comms = comms
        self.pending: list[tuple[Any, int, str]] = []  # (request, destination, what) of sends not known complete

    def send(self, obj: Any, dest: int, tag: int, what: str) -> None:
        """Nonblocking send; completed requests are dropped here, the rest waited for by :meth:`flush`."""
        self.pending[:] = [p for p in self.pending if not p[0].Test()]
        self.pending.append((self.comms.ctrl.isend(obj, dest, tag), dest, what))

    def flush(self) -> None:
        """Wait (with the deadline) until every send was taken by its peer."""
        comms = self.comms
        while self.pending:
            req, dest, what = self.pending[0]
            comms.poll(req.Test, comms.timeout, lambda d=dest, w=what: f"{w}: rank {d} did not take the message "
                                                                      f"within {comms.timeout:.0f} s",
                       lambda d=dest: [d])
            self.pending.pop(0)

    def recv(self, src: int, tag: int, what: str, timeout: float | None = None) -> Any:
        """Wait for the next message from ``src`` on ``tag``."""
        return self._until(lambda: self.poll(src, tag), timeout, f"{what}: rank {self.comms.rank} heard nothing "
                           f"from rank {src}", [src])

    def poll(self, src: int, tag: int) -> tuple[Any] | None:
        """The next message from ``src`` on ``tag`` as a 1-tuple, or None when there is none yet."""
        msg = self.comms.ctrl.improbe(src, tag)
        return None if msg is None else (msg.recv(),)

    def wait(self, probe: Callable[[], tuple[Any] | None], what: str, peers: list[int]) -> Any:
        """Wait (with the deadline) until ``probe()`` returns a 1-tuple; its value."""
        return self._until(probe, None, f"{what}: rank {self.comms.rank} heard nothing", peers)

    def _until(self, probe: Callable[[], tuple[Any] | None], timeout: float | None, silence: str,
               peers: list[int]) -> Any:
        """Poll ``probe`` until it returns a 1-tuple (its value), or fail after ``timeout`` (default: the comms')
        with ``silence`` and the seconds waited, naming ``peers``."""
        comms = self.comms
        timeout = comms.timeout if timeout is None else timeout
        box: list[Any] = []

        def done() -> bool:
            got = probe()
            if got is not None:
                box.append(got[0])
            return bool(box)

        comms.poll(done, timeout, lambda: f"{silence} within {timeout:.0f} s", lambda: peers)
        return box[0]
