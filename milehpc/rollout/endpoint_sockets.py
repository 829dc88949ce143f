"""Audit of a job's listening sockets on a shared node: which ones another user could reach and use.

The listening TCP sockets come from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (state LISTEN), matched to the job's
processes by the socket inodes their ``/proc/<pid>/fd`` links name. Each one is probed with an HTTP request that
carries no token: an HTTP server must answer 401 (milehpc's endpoint does). A socket that does not speak HTTP
(torch's TCPStore, gloo) cannot check a secret, so it must at least not listen on every interface.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"
_WILDCARD = {"0.0.0.0", "::"}


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str
    port: int

    @property
    def everywhere(self) -> bool:
        """Listening on every interface of the node (reachable from other hosts and users)."""
        return self.address in _WILDCARD


def _address(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:  # /proc prints the 32-bit word in host (little-endian) order
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    text = socket.inet_ntop(socket.AF_INET6, words)
    return text[7:] if text.startswith("::ffff:") and "." in text else text


def _listening_inodes() -> dict[int, tuple[str, int]]:
    out: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != _LISTEN:
                continue
            host, port = cols[1].split(":")
            out[int(cols[9])] = (_address(host), int(port, 16))
    return out


def listeners(pids: Iterable[int]) -> list[Listener]:
    """The listening TCP sockets held by ``pids``."""
    table = _listening_inodes()
    found: set[Listener] = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in table:
                found.add(Listener(pid, *table[int(link[8:-1])]))
    return sorted(found, key=lambda x: (x.pid, x.port))


def http_status_without_token(listener: Listener, timeout: float = 2.0) -> int | None:
    """The HTTP status a request without credentials gets, or None when the socket does not answer HTTP."""
    host = "127.0.0.1" if listener.address == "0.0.0.0" else "::1" if listener.address == "::" else listener.address
    try:
        with socket.create_connection((host, listener.port), timeout=timeout) as conn:
            conn.sendall(b"GET /v1/models HTTP/1.0\r\nHost: localhost\r\n\r\n")
            head = conn.recv(64)
    except OSError:
        return None
    parts = head.split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return None


def unprotected(pids: Iterable[int]) -> list[str]:
    """One line per listening socket of ``pids`` that another user of the node could use: an HTTP server that
    serves without the token, or a socket that cannot check one and listens on every interface."""
    from concurrent.futures import ThreadPoolExecutor

    found = listeners(pids)
    problems = []
    with ThreadPoolExecutor(max(1, min(16, len(found)))) as pool:  # a silent socket costs its timeout: in parallel
        statuses = list(pool.map(http_status_without_token, found))
    for lst, status in zip(found, statuses, strict=True):
        if status is not None and status != 401:
            problems.append(f"pid {lst.pid}: {lst.address}:{lst.port} answers HTTP {status} without a token")
        elif status is None and lst.everywhere:
            problems.append(f"pid {lst.pid}: {lst.address}:{lst.port} (not HTTP: no token possible) listens on "
                            f"every interface")
    return problems
