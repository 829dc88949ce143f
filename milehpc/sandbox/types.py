"""What a sandbox run takes and returns: the limits, the result record, and the protocol every backend meets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from milehpc.errors import MilehpcError

# Why a run ended (RunResult.stopped): the program exited by itself, or one of the limits stopped it.
EXITED, WALL, CPU, MEMORY, OUTPUT, SIGNAL = "exited", "wall_time", "cpu_time", "memory", "output", "signal"


class SandboxError(MilehpcError):
    """The sandbox itself could not run the program (missing tool, bad mount): not the program's fault."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Memory is the address-space limit (RLIMIT_AS) of each process; ``max_procs`` counts the
    processes of the sandbox (RLIMIT_NPROC, enforced because the program runs as an unprivileged user)."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_procs: int = 32
    max_output_bytes: int = 64 * 1024  # kept per stream; more stops the run
    tmp_mb: int = 64  # size of the private writable /tmp (memory-backed: nothing lands on the host's disk)
    max_open_files: int = 64


@dataclass
class RunResult:
    """One run: exit status (``None`` if we killed it), the (truncated) output, resource use, why it stopped."""

    exit_code: int | None
    stdout: str
    stderr: str
    stopped: str = EXITED
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0
    truncated: bool = False
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.stopped == EXITED and self.exit_code == 0

    def line(self) -> str:
        """One line for logs and reports."""
        tail = (self.stderr.strip().splitlines() or [""])[-1][:120]
        why = f" ({self.detail})" if self.detail else ""
        return (f"stopped={self.stopped}{why} exit={self.exit_code} wall={self.wall_s:.2f}s cpu={self.cpu_s:.2f}s "
                f"rss={self.max_rss_mb:.0f}MB out={len(self.stdout)}B{'+truncated' if self.truncated else ''}"
                + (f" stderr: {tail}" if tail else ""))


class Sandbox(Protocol):
    """A backend: ``run`` executes ``argv`` (resolved inside the sandbox) with ``stdin`` and ``files`` (name ->
    content, placed in the private writable directory, which is also the working directory) under ``limits``.
    No network; everything outside the private directory is read-only or absent."""

    name: str

    def run(self, argv: list[str], *, stdin: bytes = b"", files: dict[str, str | bytes] | None = None,
            limits: Limits = Limits()) -> RunResult: ...

    def command(self, argv: list[str], *, files: dict[str, str] | None = None,
                limits: Limits = Limits()) -> list[str]:
        """The full host command line for ``argv`` (``files`` maps a name inside to a host path or descriptor)."""
        ...
