"""``none``: the program runs on the host under the same rlimits, in a private temporary directory, with the
host's network and files. :mod:`milehpc.sandbox.choice` builds it only when the job says
``allow_unsandboxed = true``."""

from __future__ import annotations

from dataclasses import dataclass

from milehpc.sandbox.process import execute, host_dir, prlimit_argv
from milehpc.sandbox.types import Limits, RunResult


@dataclass
class Unsandboxed:
    name: str = "none"
    python: str = "python3"

    def command(self, argv: list[str], *, files: dict[str, str] | None = None,
                limits: Limits = Limits()) -> list[str]:
        return [*prlimit_argv(limits), *argv]

    def run(self, argv: list[str], *, stdin: bytes = b"", files: dict[str, str | bytes] | None = None,
            limits: Limits = Limits()) -> RunResult:
        with host_dir(files) as cwd:
            return execute(self.command(argv, limits=limits), stdin=stdin, limits=limits, cwd=cwd)
