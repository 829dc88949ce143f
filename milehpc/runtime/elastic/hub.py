"""Trainer rank 0's end of the elastic engines: it listens on the job's interface, authenticates each engine
(:mod:`milehpc.comm.channel`), reads every engine's messages on a thread of its own into one queue, and reports an
engine lost when its connection drops or nothing (not even a heartbeat) came from it for ``timeout`` seconds.

Messages, engine -> trainer: ``("hello", engine, host)`` first, ``("hb",)`` every :data:`~milehpc.runtime.elastic
.HEARTBEAT_S`, ``("result", step, index, groups, stats)`` per prompt; trainer -> engine: ``("group", address, port,
name, backend)`` (join the weight-update group ``name`` at the trainer's store), ``("weights", version, metas)`` (one
broadcast per bucket follows on that group, :mod:`.weights`), ``("work", step, [index, ...])``, ``("hb",)`` every
second (an engine that hears nothing for the timeout ends), ``("stop",)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milehpc.comm.channel import Connection, accept
from milehpc.runtime.elastic import HEARTBEAT_S


@dataclass
class Link:
    """One joined engine."""

    engine: int
    host: str
    conn: Connection
    serial: int
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    group: Any = None  # its weight-sync group, once made
    version: int = -1  # the weights it holds

    @property
    def name(self) -> str:
        return f"engine {self.engine} (on {self.host})"


class Hub:
    """See the module docstring. Events from :meth:`next_event`: ``("join", link)``, ``("msg", link, obj)``,
    ``("lost", link, why)``."""

    def __init__(self, listen_fd: int, secret: str, timeout: float) -> None:
        self.secret, self.timeout = secret, timeout
        self.server = socket.socket(fileno=listen_fd)
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.links: dict[int, Link] = {}  # serial -> link, live ones
        self._serial = 0
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept_loop, name="milehpc-elastic-accept", daemon=True).start()
        threading.Thread(target=self._beat_loop, name="milehpc-elastic-heartbeat", daemon=True).start()

    # ---- threads ----------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock,), daemon=True).start()

    def _beat_loop(self) -> None:
        """The trainer's heartbeat to every engine: an engine cut off from it ends by its own timeout."""
        while not self._closing:
            for link in self.live():
                self.send(link, ("hb",))
            time.sleep(HEARTBEAT_S)

    def _greet(self, sock: socket.socket) -> None:
        try:
            conn = accept(sock, self.secret)
            kind, engine, host = conn.recv()
            assert kind == "hello"
        except Exception as err:  # noqa: BLE001 - a stranger or a broken start: drop it, say who
            with contextlib.suppress(OSError):
                sock.close()
            print(f"milehpc: elastic: refused a connection: {err}", flush=True)
            return
        with self._lock:
            self._serial += 1
            link = Link(int(engine), str(host), conn, self._serial)
        self.events.put(("join", link))
        while True:
            try:
                msg = conn.recv()
            except Exception as err:  # noqa: BLE001 - EOF, reset: the engine is gone
                self.events.put(("lost", link, f"its connection ended ({err})"))
                return
            link.last_seen = time.monotonic()
            if msg[0] != "hb":
                self.events.put(("msg", link, msg))

    # ---- the trainer's thread ---------------------------------------------------------------------------------
    def next_event(self, wait_s: float) -> tuple[Any, ...] | None:
        """The next event within ``wait_s`` s; a live engine silent for ``timeout`` s comes as ``lost``."""
        now = time.monotonic()
        for link in list(self.links.values()):
            if link.alive and now - link.last_seen > self.timeout:
                return ("lost", link, f"no heartbeat for {now - link.last_seen:.0f} s")
        try:
            return self.events.get(timeout=wait_s)
        except queue.Empty:
            return None

    def add(self, link: Link) -> None:
        link.last_seen = time.monotonic()
        self.links[link.serial] = link

    def drop(self, link: Link) -> None:
        """Forget an engine (its group is abandoned with it: the others' are untouched)."""
        link.alive = False
        self.links.pop(link.serial, None)
        link.conn.close()

    def live(self) -> list[Link]:
        # list() copies the dict in one step: the heartbeat thread calls this while the trainer's thread changes it
        return sorted((lk for lk in list(self.links.values()) if lk.alive), key=lambda lk: lk.engine)

    def send(self, link: Link, msg: Any) -> bool:
        """False when the engine cannot be written to (it is gone; the reader reports it)."""
        try:
            link.conn.send(msg)
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.server.close()
        for link in list(self.links.values()):
            self.send(link, ("stop",))
            link.conn.close()
        self.links.clear()


def write_address(run_dir: Path, where: dict[str, Any]) -> None:
    """Trainer rank 0's address for the engines (atomically: an engine never reads half of it)."""
    path = run_dir / ".milehpc" / "elastic.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"elastic.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(where) + "\n")
    tmp.replace(path)
