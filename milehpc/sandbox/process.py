"""Running a sandbox's host command: wall-clock kill of the whole process group, capped output, resource use.

Shared by every backend (they differ only in the command line). Threads, not asyncio: a run is a blocking call that
the async pool (:class:`milehpc.sandbox.choice.Pool`) moves to a worker thread, so one event loop never owns a child.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from milehpc.sandbox.types import CPU, EXITED, MEMORY, OUTPUT, SIGNAL, WALL, Limits, RunResult, SandboxError

_CHUNK = 65536
# What a Python process prints when RLIMIT_AS refused an allocation (the memory limit, not a bug in the code).
_MEMORY_MARKS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc")


def _kill_group(pid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _reader(stream: IO[bytes], keep: bytearray, cap: int, over: threading.Event, kill: Callable[[], None]) -> None:
    """Keep the first ``cap`` bytes; on more, flag it and kill the run (a flood must not fill the host's memory)."""
    while True:
        chunk = stream.read1(_CHUNK)  # type: ignore[attr-defined]
        if not chunk:
            return
        room = cap - len(keep)
        keep += chunk[:max(room, 0)]
        if len(chunk) > room:
            over.set()
            kill()


def _writer(stream: IO[bytes], data: bytes) -> None:
    try:
        stream.write(data)
    except (BrokenPipeError, OSError):  # the program did not read its input: not our failure
        pass
    finally:
        with suppress(OSError):
            stream.close()


def classify(code: int | None, stderr: str, *, timed_out: bool, flooded: bool, cpu_used: float = 0.0,
             cpu_limit: float = float("inf")) -> tuple[str, str]:
    """(stopped, detail) from how the run ended. Backends return 128+N when their child died of signal N. A
    namespace's pid 1 ignores SIGXCPU, so the CPU limit shows as SIGKILL at the hard limit with the CPU used."""
    if timed_out:
        return WALL, "killed at the wall-clock limit"
    if flooded:
        return OUTPUT, "killed at the output limit"
    if code is not None and code > 128:
        sig = code - 128
        if sig == signal.SIGXCPU or sig == signal.SIGKILL and cpu_used >= cpu_limit:
            return CPU, f"CPU-time limit ({signal.Signals(sig).name} after {cpu_used:.1f} s of CPU)"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return SIGNAL, f"killed by {name}"
    if code and any(mark in stderr for mark in _MEMORY_MARKS):
        return MEMORY, "allocation refused by the memory limit"
    return EXITED, ""


def execute(cmd: Sequence[str], *, stdin: bytes, limits: Limits, pass_fds: Sequence[int] = (),
            user: int | None = None, cwd: str | None = None, kill_also: Callable[[], None] | None = None) -> RunResult:
    """Run ``cmd`` in a new session; kill the session at ``limits.wall_s`` or when an output stream passes
    ``limits.max_output_bytes``. ``user``: run the host command as this uid/gid (root dropping privileges).
    ``kill_also``: what else a kill must hit (the sandbox's init, which left the session)."""
    start = time.monotonic()
    extra = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=tuple(pass_fds), start_new_session=True, close_fds=True, cwd=cwd, **extra)
    out, err, over = bytearray(), bytearray(), threading.Event()
    assert proc.stdin and proc.stdout and proc.stderr

    def kill() -> None:
        if kill_also is not None:
            kill_also()
        _kill_group(proc.pid)

    threads = [threading.Thread(target=_reader, args=(proc.stdout, out, limits.max_output_bytes, over, kill)),
               threading.Thread(target=_reader, args=(proc.stderr, err, limits.max_output_bytes, over, kill)),
               threading.Thread(target=_writer, args=(proc.stdin, stdin))]
    for t in threads:
        t.daemon = True
        t.start()
    timed_out = threading.Event()

    def on_wall() -> None:
        timed_out.set()
        kill()

    timer = threading.Timer(limits.wall_s, on_wall)
    timer.daemon = True
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    _kill_group(proc.pid)  # anything left in the host-side group (the sandbox's namespace died with its init)
    for t in threads[:2]:
        t.join(timeout=5.0)
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    stderr = err.decode("utf-8", "replace")
    cpu = usage.ru_utime + usage.ru_stime
    stopped, detail = classify(code, stderr, timed_out=timed_out.is_set(), flooded=over.is_set(), cpu_used=cpu,
                               cpu_limit=limits.cpu_s)
    return RunResult(exit_code=None if stopped in (WALL, OUTPUT) else code, stdout=out.decode("utf-8", "replace"),
                     stderr=stderr, stopped=stopped, wall_s=time.monotonic() - start,
                     cpu_s=cpu, max_rss_mb=usage.ru_maxrss / 1024,
                     truncated=over.is_set(), detail=detail)


def prlimit_argv(limits: Limits) -> list[str]:
    """util-linux ``prlimit`` in front of the program: the limits are set inside the sandbox, after its user
    namespace exists, so the process count is the sandbox's own (not every process of the user on the node)."""
    mem = limits.memory_mb * 1024 * 1024
    return ["prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={mem}:{mem}",
            f"--nproc={limits.max_procs}:{limits.max_procs}", f"--nofile={limits.max_open_files}:"
            f"{limits.max_open_files}", f"--fsize={limits.tmp_mb * 1024 * 1024}", "--core=0", "--"]


def check_name(name: str) -> None:
    """A file given to a sandbox is placed in its private directory: its name must be a plain name."""
    if "/" in name or "\0" in name or name in ("", ".", ".."):
        raise SandboxError(f"sandbox file name must be a plain name, got {name!r}")


@contextmanager
def host_dir(files: dict[str, str | bytes] | None, base: str | None = None) -> Iterator[str]:
    """A fresh private host directory holding ``files`` (for backends that bind a host directory), removed after."""
    for name in files or {}:
        check_name(name)  # before anything is made: a "../x" or "/abs" name would write outside the directory
    path = tempfile.mkdtemp(prefix="milehpc-sbx-", dir=base or None)
    try:
        for name, content in (files or {}).items():
            Path(path, name).write_bytes(content.encode() if isinstance(content, str) else content)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
