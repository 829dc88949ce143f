"""Addresses and ports a rank offers to its peers: the host's address after the site's ``master_addr`` mode, ports
seeded by the job id (so co-located jobs on one node do not collide) and checked free by binding them."""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from milehpc.errors import ConfigError, RuntimeFailure

PORT_BASE, PORT_SPAN, PORT_TRIES = 20000, 40000, 64


def resolve_address(mode: str) -> str:
    """The address this host offers to peers, after the site's ``master_addr`` (hostname | hostname -i | 127.0.0.1)."""
    if mode == "127.0.0.1":
        return mode
    host = socket.gethostname()
    if mode == "hostname -i":
        return socket.gethostbyname(host)
    return host


def seeded_port(key: str, attempt: int = 0) -> int:
    """A port derived from the job id, so co-located jobs on one node do not collide (20000 + crc32 % 40000)."""
    return PORT_BASE + (zlib.crc32(key.encode()) + attempt) % PORT_SPAN


def host_store(address: str, key: str, world_size: int, timeout: float) -> tuple[Any, int]:
    """Start a TCPStore server on the first free port from the seeded one (binding is the check)."""
    from torch.distributed import TCPStore

    def start(fd: int, port: int) -> Any:
        return TCPStore(address, port, world_size, True, timedelta(seconds=timeout), wait_for_workers=False,
                        master_listen_fd=fd)

    return listen_seeded(address, key, start, what="the TCPStore")


def listen_seeded(address: str, key: str, start: Callable[[int, int], Any] | None = None, *, what: str,
                  ) -> tuple[Any, int]:
    """Listen on ``address`` at the first free port from the one seeded by ``key`` (binding is the check);
    ``start(fd, port)`` makes the server of the socket (a RuntimeError: try the next port). Returns (the server, or
    the listening descriptor without ``start``, port)."""
    last: Exception | None = None
    for attempt in range(PORT_TRIES):
        port = seeded_port(key, attempt)
        try:
            fd = listen_on(address, port)
        except OSError as err:  # address in use
            last = err
            continue
        if start is None:
            return fd, port
        try:
            return start(fd, port), port
        except RuntimeError as err:  # DistNetworkError
            os.close(fd)
            last = err
    raise RuntimeFailure(f"no free port for {what} on {address} after {PORT_TRIES} tries from "
                         f"{seeded_port(key)}: {last}")


def listen_on(address: str, port: int) -> int:
    """A listening socket's descriptor on ``address`` only (handed to the TCPStore, which owns it from then on).
    Given just a host name, torch's TCPStore listens on every interface of the node, where other users can reach
    it; the store cannot check who connects, so it is kept to the one interface its peers use."""
    import ipaddress

    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    if ipaddress.ip_address(sockaddr[0]).is_loopback and address not in ("127.0.0.1", "::1", "localhost"):
        # A host name this node maps to loopback (/etc/hosts' 127.0.1.1) that peers on other nodes resolve to its
        # real address: only every interface reaches them (what the store did before).
        sockaddr = ("::" if family == socket.AF_INET6 else "0.0.0.0", port)
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def free_port() -> int:
    """A port free on this host right now (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


# The variables that pin a collective library to named interfaces (comma-separated; NCCL's may start with ^ to
# exclude, = for exact names, and otherwise matches prefixes: NCCL's env docs, "NCCL_SOCKET_IFNAME").
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def check_socket_ifnames(env: Mapping[str, str], have: list[str] | None = None, *, file: str | None = None) -> None:
    """Refuse, in one line naming the variable, a socket interface this node does not have: gloo would fail later
    with a C++ traceback ("Unable to find address for"), NCCL would hang or fall back silently. ``have``: the
    node's interfaces (default: the ones this process can bind)."""
    if have is None:  # this network namespace's (a container's /sys/class/net may show another's)
        have = sorted(name for _, name in socket.if_nameindex())
    for var in SOCKET_IFNAME_VARS:
        value = env.get(var, "").strip()
        if not value or value.startswith("^"):  # an exclusion list matches whatever is left
            continue
        exact = value.startswith("=")
        wanted = [w for w in value.lstrip("=").split(",") if w]
        # gloo takes exact names; NCCL prefixes unless '='.
        prefix = var == "NCCL_SOCKET_IFNAME" and not exact
        missing = [w for w in wanted if not any(h.startswith(w) if prefix else h == w for h in have)]
        if missing:
            raise ConfigError(f"expected {var} to name interfaces of this node ({socket.gethostname()}: "
                              f"{', '.join(have) or 'none'}), got {value!r} ({', '.join(missing)} not found)",
                              file=file, field=f"env.{var}")
