"""The ``bubblewrap`` sandbox (Debian package ``bubblewrap``): new pid, network, IPC, UTS and mount namespaces; the
host's system directories read-only, a private size-limited ``/tmp`` (the working directory), nothing else.

Run as root (CI, a workstation container), bwrap keeps the host's uid 0 unless told otherwise, and the kernel
exempts uid 0 from RLIMIT_NPROC: so the program is started as ``uid`` (default 65534) with every capability
dropped (``setpriv``), which makes the process-count limit hold against a fork bomb. Run as a normal user, bwrap
creates an unprivileged user namespace and the limits are set inside it (they count the sandbox's own processes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from dataclasses import dataclass, field

from milehpc.sandbox.process import check_name, execute, prlimit_argv
from milehpc.sandbox.types import Limits, RunResult, SandboxError

SYSTEM_DIRS = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/alternatives", "/etc/ld.so.cache",
               "/etc/localtime"]
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONUNBUFFERED": "1"}


def _parents(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a/b", "/a"]`` (not ``/``)."""
    out = []
    while (path := os.path.dirname(path)) not in ("/", ""):
        out.append(path)
    return out


class _Status:
    """bwrap's status lines (``--json-status-fd``): the sandbox init's host pid as soon as it exists, and the exit
    record. A kill must hit that init itself: it left bwrap's session, and dropping privileges (setpriv) clears
    the parent-death signal that would otherwise take it down with bwrap. Its death ends the whole namespace."""

    def __init__(self, fd: int) -> None:
        self.fd, self.text, self.child = fd, "", -1  # child: a pidfd (no pid-reuse race when killing)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while chunk := os.read(self.fd, 4096):
            self.text += chunk.decode("utf-8", "replace")
            for line in self.text.split("\n")[:-1]:  # whole lines only: a record may arrive in pieces
                if '"child-pid"' in line and self.child < 0:
                    try:
                        self.child = os.pidfd_open(int(json.loads(line)["child-pid"]))
                    except ProcessLookupError:  # already gone: nothing to kill
                        self.child = -2

    def kill_child(self) -> None:
        if self.child >= 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(self.child, signal.SIGKILL)

    def close(self) -> None:
        if self.child >= 0:
            os.close(self.child)


def _drop_privileges(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--"]


@dataclass
class Bubblewrap:
    name: str = "bubblewrap"
    bwrap: str = "bwrap"
    python: str = "python3"
    ro_binds: list[str] = field(default_factory=lambda: list(SYSTEM_DIRS))
    uid: int = 65534
    as_root: bool | None = None  # None: whether this process is root

    def __post_init__(self) -> None:
        if self.as_root is None:
            self.as_root = os.geteuid() == 0

    def _mounts(self) -> list[str]:
        out: list[str] = []
        made: set[str] = set()
        for path in self.ro_binds:
            # bwrap makes missing parents (/etc for /etc/ld.so.cache) 0700 when root: the program could not
            # traverse them. Make them 0755 first.
            for parent in reversed(_parents(path)):
                if parent not in made and os.path.exists(path):
                    out += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            if os.path.islink(path):  # merged /usr: /lib -> usr/lib stays a link, not a second mount
                out += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                out += ["--ro-bind", path, path]
        return out

    def command(self, argv: list[str], *, files: dict[str, str] | None = None,
                limits: Limits = Limits()) -> list[str]:
        """The host command line; ``files`` maps a name in the private /tmp to a descriptor number (as a string)."""
        ns = (["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
              if self.as_root else ["--unshare-all", "--cap-drop", "ALL"])
        # --as-pid-1: the program is the namespace's init, so its exit ends every process it left behind and
        # bwrap's own wait reports the program's CPU use.
        cmd = [self.bwrap, *ns, "--as-pid-1", "--die-with-parent", "--new-session", "--hostname", "sandbox", *self._mounts(),
               "--dev", "/dev", "--proc", "/proc", "--size", str(limits.tmp_mb * 1024 * 1024), "--perms", "1777",
               "--tmpfs", "/tmp"]
        for name, fd in (files or {}).items():
            cmd += ["--perms", "0644", "--file", str(fd), f"/tmp/{name}"]
        cmd += ["--chdir", "/tmp", "--clearenv"]
        for key, value in ENV.items():
            cmd += ["--setenv", key, value]
        cmd += ["--remount-ro", "/"]
        inner = [*(_drop_privileges(self.uid) if self.as_root else []), *prlimit_argv(limits)]
        return [*cmd, "--", *inner, *argv]

    def run(self, argv: list[str], *, stdin: bytes = b"", files: dict[str, str | bytes] | None = None,
            limits: Limits = Limits()) -> RunResult:
        if shutil.which(self.bwrap) is None:
            raise SandboxError(f"sandbox 'bubblewrap': '{self.bwrap}' not found (install the bubblewrap package, "
                               "e.g. apt-get install bubblewrap)")
        fds: dict[str, str] = {}
        opened: list[int] = []
        try:
            for name, content in (files or {}).items():
                check_name(name)
                fd = os.memfd_create(f"sbx-{name}")  # bwrap copies it into the private /tmp
                opened.append(fd)
                os.write(fd, content.encode() if isinstance(content, str) else content)
                os.lseek(fd, 0, os.SEEK_SET)
                fds[name] = str(fd)
            status_r, status_w = os.pipe()
            opened += [status_r, status_w]
            cmd = self.command(argv, files=fds, limits=limits)
            cmd[1:1] = ["--json-status-fd", str(status_w)]
            status = _Status(status_r)
            result = execute(cmd, stdin=stdin, limits=limits, pass_fds=[*map(int, fds.values()), status_w],
                             kill_also=status.kill_child)
            os.close(status_w)
            opened.remove(status_w)
            status.thread.join(timeout=5.0)
            status.close()
        finally:
            for fd in opened:
                os.close(fd)
        # bwrap reports the child's exit on the status fd; without it the sandbox never started the program.
        if '"exit-code"' not in status.text and result.stopped not in ("wall_time", "output"):
            raise SandboxError(f"sandbox 'bubblewrap' could not start the program: {result.stderr.strip()[:300]}")
        return result
