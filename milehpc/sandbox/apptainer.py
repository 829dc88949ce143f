"""The ``apptainer`` sandbox for clusters: ``apptainer exec --containall`` (pid and IPC namespaces, clean
environment, no home, a private /tmp) with ``--net --network none`` and ``--no-privs`` on a read-only image; the
program's files live in a per-run host directory bound at ``/sandbox`` and removed afterwards.

The limits are set by util-linux ``prlimit`` inside the image (it must have one). With Apptainer's user namespace
(its default where the kernel allows one) the process-count limit counts the sandbox's own processes. Without one
(a setuid installation) RLIMIT_NPROC counts every process and thread of the user on the node, the job's own ranks
included, so a program may be unable to start even one thread: nothing here adjusts ``max_procs`` for that yet.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

from milehpc.sandbox.process import execute, host_dir, prlimit_argv
from milehpc.sandbox.types import Limits, RunResult, SandboxError

WORK = "/sandbox"


@dataclass
class Apptainer:
    name: str = "apptainer"
    image: str = ""
    apptainer: str = "apptainer"
    python: str = "python3"
    flags: list[str] = field(default_factory=list)
    workdir_base: str = ""  # "" = the system temporary directory (node-local on compute nodes)

    def command(self, argv: list[str], *, files: dict[str, str] | None = None,
                limits: Limits = Limits()) -> list[str]:
        """``files`` here is ``{"": host_dir}``: the run's host directory, bound at /sandbox."""
        work = (files or {}).get("", "WORKDIR")
        return [self.apptainer, "exec", "--containall", "--no-home", "--cleanenv", "--no-privs", "--net",
                "--network", "none", "--bind", f"{work}:{WORK}", "--pwd", WORK,
                "--env", "PYTHONDONTWRITEBYTECODE=1,PYTHONUNBUFFERED=1,HOME=/sandbox", *self.flags, self.image,
                *prlimit_argv(limits), *argv]

    def run(self, argv: list[str], *, stdin: bytes = b"", files: dict[str, str | bytes] | None = None,
            limits: Limits = Limits()) -> RunResult:
        if not self.image:
            raise SandboxError("sandbox 'apptainer' needs an image: set [sandbox] image in the job or the site's "
                               "[partitions.NAME.sandbox] image")
        if shutil.which(self.apptainer) is None:
            raise SandboxError(f"sandbox 'apptainer': '{self.apptainer}' not found (module load apptainer?)")
        with host_dir(files, self.workdir_base) as work:
            return execute(self.command(argv, files={"": work}, limits=limits), stdin=stdin, limits=limits)

