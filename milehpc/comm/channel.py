"""An authenticated TCP channel for control messages between processes that share no MPI world (elastic rollout:
trainer rank 0 and the engines of rollout steps started on their own, :mod:`milehpc.runtime.elastic`).

Frames are an 8-byte length and a pickle. Pickles run code when loaded, so nothing is read from a peer before it
proved it holds the job's secret (a file of the private run directory, :func:`milehpc.rollout.endpoint_auth
.job_token`): the server sends a random challenge, the client answers with its HMAC under the secret, and the server
answers the client's own challenge the same way (a client talks only to the job's trainer). Both challenges are
fresh per connection, so a recorded answer is worth nothing. The server listens on the job's interface only
(:func:`milehpc.comm.net.listen_on`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import pickle
import secrets
import socket
import struct
import threading
from typing import Any

from milehpc.errors import RuntimeFailure

MAGIC = b"milehpc-elastic-1"
NONCE_BYTES = 32
HANDSHAKE_S = 10.0  # a peer that does not answer the challenge within this is dropped
_LEN = struct.Struct("!Q")


def _proof(secret: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), MAGIC + role + nonce, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class Connection:
    """One authenticated end: :meth:`send` (thread-safe) and :meth:`recv` (one reader) of pickled objects."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.sock.sendall(_LEN.pack(len(data)) + data)

    def recv(self) -> Any:
        (n,) = _LEN.unpack(_read_exact(self.sock, _LEN.size))
        return pickle.loads(_read_exact(self.sock, n))  # noqa: S301 - the peer proved it holds the job's secret

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already closed by the peer
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def accept(sock: socket.socket, secret: str) -> Connection:
    """Server side of the handshake on an accepted socket; raises PermissionError for a peer without the secret."""
    host, port = sock.getpeername()[:2]
    peer = f"{host}:{port}"
    sock.settimeout(HANDSHAKE_S)
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(mine)
    answer = _read_exact(sock, 32)
    theirs = _read_exact(sock, NONCE_BYTES)
    if not hmac.compare_digest(answer, _proof(secret, b"client", mine)):
        sock.close()
        raise PermissionError(f"{peer} does not hold the job's secret")
    sock.sendall(_proof(secret, b"server", theirs))
    sock.settimeout(None)
    return Connection(sock, peer)


def connect(address: str, port: int, secret: str, timeout: float) -> Connection:
    """Client side: connect (retrying until ``timeout``: the server may be starting) and authenticate both ways."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=min(HANDSHAKE_S, timeout))
            break
        except OSError as err:
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"cannot reach the trainer at {address}:{port} within {timeout:.0f} s: "
                                     f"{err}") from None
            time.sleep(0.2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        theirs = _read_exact(sock, NONCE_BYTES)
        mine = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(_proof(secret, b"client", theirs) + mine)
        if not hmac.compare_digest(_read_exact(sock, 32), _proof(secret, b"server", mine)):
            raise PermissionError("the server does not hold the job's secret")
    except (OSError, PermissionError) as err:
        sock.close()
        raise RuntimeFailure(f"handshake with the trainer at {address}:{port} failed: {err}") from None
    sock.settimeout(None)
    return Connection(sock, f"{address}:{port}")
