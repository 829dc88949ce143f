"""The OpenAI endpoint's per-job bearer token.

Other users of a compute node can connect to its loopback ports, so every request must carry the job's secret.
The token lives in a file of the private run directory (mode 0600, created atomically by the first rank that gets
there; the others read it). It is never put on a command line, in an environment variable or in the job script:
a process of the job reads the file, and anything else the user runs (an agent in another process) does too.
"""

from __future__ import annotations

import hmac
import os
import secrets
import time
from pathlib import Path

TOKEN_FILE = "endpoint.token"


def job_token(directory: str | os.PathLike[str], *, wait_s: float = 10.0, name: str = TOKEN_FILE) -> str:
    """The job's token in ``directory``/``name`` (created with mode 0600 if absent). A token file readable by others
    is refused: it would no longer be a secret."""
    path = Path(directory) / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path, wait_s)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")  # the newline marks a complete write for the ranks that read it
    return token


def _read(path: Path, wait_s: float) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{path}: expected mode 0600 for the job's token, got {mode:04o}")
    deadline = time.monotonic() + wait_s
    while True:  # another rank created it and may still be writing
        text = path.read_text()
        if text.endswith("\n"):
            return text.strip()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: the job's token was not written within {wait_s:.0f} s")
        time.sleep(0.05)


def authorized(header: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>`` with the job's token (compared in constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())
