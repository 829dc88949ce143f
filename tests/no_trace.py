"""The suite leaves no trace in the state of the user who runs it: before any test runs, conftest points milehpc's
job record (``MILEHPC_STATE_DIR``, :func:`milehpc.scheduler.records.records_file`) and every XDG cache (the
compiled-template cache of :mod:`milehpc.render.script`, matplotlib's) into one temporary folder for the session,
and after the session compares the user's own record, cache folder and ``runs/`` with what they were before."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _user_paths() -> dict[str, Path]:
    """Where milehpc would write for this user without the redirection (read from the untouched environment)."""
    state = os.environ.get("MILEHPC_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "milehpc")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return {"job record": Path(state) / "jobs.jsonl", "cache": cache / "milehpc", "run dirs": REPO / "runs"}


def fingerprint(path: Path) -> str:
    """A file's bytes, or a folder's file names, sizes and mtimes, as one hash ('absent' when missing)."""
    if not path.exists():
        return "absent"
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        stat = file.stat()
        digest.update(f"{file}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        if not path.is_dir():
            digest.update(file.read_bytes())
    return digest.hexdigest()


USER = _user_paths()
BEFORE = {what: fingerprint(path) for what, path in USER.items()}
TEMP = Path(tempfile.mkdtemp(prefix="milehpc-tests-"))


def isolate() -> None:
    """Point every per-user path milehpc writes into :data:`TEMP` (inherited by every subprocess and rank)."""
    os.environ["MILEHPC_STATE_DIR"] = str(TEMP / "state")
    os.environ["XDG_STATE_HOME"] = str(TEMP / "xdg-state")
    os.environ["XDG_CACHE_HOME"] = str(TEMP / "cache")
    # The user's own site files (milehpc.builtin.sites' search path) must not replace the shipped sites in tests.
    os.environ["XDG_CONFIG_HOME"] = str(TEMP / "config")
    os.environ.pop("MILEHPC_SITE_PATH", None)


def changed(what: tuple[str, ...] = tuple(USER)) -> list[str]:
    """Which of the user's own paths ``what`` the session changed (empty: none)."""
    return [f"{w} ({USER[w]})" for w in what if fingerprint(USER[w]) != BEFORE[w]]


def finish(session) -> None:
    """At the end of the session: fail it if the user's job record changed, say so if their cache or runs/ did
    (other processes of the same user, not the tests, may write those meanwhile), and remove :data:`TEMP`."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for touched, fatal in ((changed(("job record",)), True), (changed(("cache", "run dirs")), False)):
        if not touched:
            continue
        line = ("the test session changed the user's own " if fatal else "changed during the test session (by the "
                "tests, or by another milehpc process of this user): ") + ", ".join(touched)
        if reporter is not None:
            reporter.write_line(line, red=fatal, yellow=not fatal)
        if fatal:
            session.exitstatus = 1
    shutil.rmtree(TEMP, ignore_errors=True)
