"""Shared-cluster hygiene: private run directories, no secrets in what milehpc writes, one-line storage errors.

* Run directories are created with ``run.dir_mode`` (default ``0700``) whatever the umask: on a shared
  login node other users must not read prompts, checkpoints or logs.
* Secrets are passed by environment, never written: any environment variable whose *name* contains
  TOKEN, KEY, SECRET or PASSWORD is masked (``***``) in everything milehpc prints or writes — job scripts,
  resolved job files, logs. :func:`mask_env` masks a mapping, :func:`mask_text` masks the *values* of such
  variables wherever they occur in a text, :func:`install_log_masking` does it for every log record.
* Disk full (ENOSPC / EDQUOT) and permission errors (EACCES / EPERM / EROFS) become one line that names the
  path: :func:`storage_errors` wraps any write.

This module is imported by login-node code: standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from milehpc.errors import StorageError

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)
MASK = "***"
# Shorter values are not substituted inside free text: masking every "1" or "on" would garble logs.
_MIN_SECRET_LEN = 4


def is_secret_name(name: str) -> bool:
    """True for environment variable names that hold credentials (HF_TOKEN, WANDB_API_KEY, DB_PASSWORD...)."""
    return bool(SECRET_NAME.search(name))


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with the values of secret-named variables replaced by ``***``."""
    return {key: (MASK if is_secret_name(key) and value else value) for key, value in env.items()}


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The values of the secret-named variables in ``env`` (default: the process environment), longest first."""
    env = os.environ if env is None else env
    values = {v for k, v in env.items() if is_secret_name(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def mask_text(text: str, env: Mapping[str, str] | None = None) -> str:
    """Replace every occurrence of a secret's value in ``text``, and the value in ``NAME=value`` assignments
    of secret-named variables (a script that sets one inline), by ``***``."""
    for value in secret_values(env):
        text = text.replace(value, MASK)
    return _ASSIGNMENT.sub(_mask_assignment, text)


_ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"\n]*\"|'[^'\n]*'|[^\s;]+)")


def _mask_assignment(match: re.Match[str]) -> str:
    name, value = match.group(1), match.group(2)
    if not is_secret_name(name) or value in (MASK, f'"{MASK}"', f"'{MASK}'") or value.startswith(("\"$", "$")):
        return match.group(0)  # a reference like TOKEN="$HF_TOKEN" passes the secret by environment: fine
    return f"{name}={MASK}"


def split_secret_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Split a job's ``env`` table into what may be written into a script and the names of secrets, which a
    renderer must pass by environment only (Slurm's default ``--export=ALL`` carries them from the submitting
    shell) — never by value."""
    plain = {k: v for k, v in env.items() if not is_secret_name(k)}
    return plain, sorted(k for k in env if is_secret_name(k))


class SecretMaskingFilter(logging.Filter):
    """Masks secret values in every record that passes through (attach to handlers or loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def install_log_masking(logger: logging.Logger | None = None) -> SecretMaskingFilter:
    """Attach a :class:`SecretMaskingFilter` to ``logger`` (default: the ``milehpc`` logger) once."""
    logger = logger or logging.getLogger("milehpc")
    for existing in logger.filters:
        if isinstance(existing, SecretMaskingFilter):
            return existing
    filt = SecretMaskingFilter()
    logger.addFilter(filt)
    return filt


# ---- storage ---------------------------------------------------------------------------------------------

_STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}


def describe_os_error(err: OSError, path: str | os.PathLike[str] | None = None, *, doing: str = "writing") -> str:
    """One line for an OSError: what happened, to which path, and what to do."""
    where = path if path is not None else (err.filename or "?")
    what = _STORAGE_ERRNOS.get(err.errno or 0, err.strerror or err.__class__.__name__)
    hint = ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = " (free space, or point checkpoint.dir / run.run_dir at a file system with room)"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = " (check the directory's owner and mode, or choose another run.run_dir)"
    return f"{what} {doing} {where}{hint}"


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike[str], *, doing: str = "writing") -> Iterator[None]:
    """Turn disk-full and permission OSErrors raised inside the block into a one-line StorageError."""
    try:
        yield
    except StorageError:
        raise
    except OSError as err:
        if err.errno in _STORAGE_ERRNOS:
            raise StorageError(describe_os_error(err, err.filename or path, doing=doing)) from err
        raise


def parse_mode(mode: str | int) -> int:
    """``"0700"`` / ``"700"`` / ``0o700`` -> 0o700."""
    return mode if isinstance(mode, int) else int(str(mode), 8)


def make_private_dir(path: str | os.PathLike[str], mode: str | int = "0700") -> Path:
    """Create ``path`` (and missing parents) and give it exactly ``mode``, whatever the umask. An existing
    directory is tightened to ``mode`` too (it holds this run's data). Storage errors are one line."""
    path = Path(path)
    bits = parse_mode(mode)
    with storage_errors(path, doing="creating"):
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, bits)
    return path
