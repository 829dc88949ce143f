"""``require_bwrap`` for the sandbox tests, and the hostile-program battery shared by the bubblewrap test (run for
real) and the Apptainer golden (command lines): each case is a program a policy could write, the limits it runs
under, and what "contained" means for its result.

Programs are templates: ``{token}`` (a marker unique to the test run), ``{run_dir}``, ``{ckpt}``, ``{secret_file}``,
``{other_file}``, ``{home}``, ``{port}`` (a host loopback listener), ``{host_pid}`` (the test process).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from required import unavailable

from milehpc.sandbox.types import Limits


def require_bwrap() -> None:
    """Skip without bwrap, except in CI (MILEHPC_REQUIRE_ALL=1), where a missing sandbox is a failure."""
    if shutil.which("bwrap") is None:
        unavailable("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


@dataclass(frozen=True)
class Hostile:
    name: str
    program: str
    limits: Limits
    stopped: tuple[str, ...]  # acceptable RunResult.stopped values
    expect_out: str = ""  # a line the program prints when every attempt inside it was blocked


_TRY = '''
import os, sys
def attempt(what, fn):
    try:
        fn()
        print("ESCAPED", what, flush=True)
    except Exception as err:
        print("blocked", what, type(err).__name__, flush=True)
'''

CASES = [
    # The wall-clock limit leaves room for the CPU limit to act first on a busy host.
    Hostile("infinite_loop", "while True:\n    pass\n", Limits(wall_s=30, cpu_s=1), ("cpu_time",)),
    Hostile("fork_bomb", '''
import os, time
n, root = 0, os.getpid()
while True:
    try:
        os.fork()
        n += 1
    except OSError as err:
        if os.getpid() == root:
            print("fork refused after", n, "forks:", err.strerror, flush=True)
            root = -1
        time.sleep(0.01)
''', Limits(wall_s=3, cpu_s=10, max_procs=16), ("wall_time",), "fork refused after"),
    Hostile("memory_balloon", "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 * 1024))\n",
            Limits(wall_s=10, memory_mb=256), ("memory",)),
    Hostile("huge_output", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
            Limits(wall_s=10, max_output_bytes=100_000), ("output",)),
    Hostile("write_outside_tmp", _TRY + '''
for path in ["{home}/milehpc-escape-{token}", "{run_dir}/escape-{token}", "{ckpt}/escape-{token}",
             "/etc/escape-{token}", "/usr/escape-{token}", "/escape-{token}"]:
    attempt("write " + path, lambda: open(path, "w").write("pwned"))
attempt("mkdir {run_dir}", lambda: os.makedirs("{run_dir}/sub", exist_ok=False))
open("/tmp/milehpc-escape-{token}", "w").write("private tmp only")  # the sandbox's own /tmp: allowed
print("all writes blocked", flush=True)
''', Limits(wall_s=10), ("exited",), "all writes blocked"),
    Hostile("read_secrets", _TRY + '''
for path in ["{secret_file}", "{other_file}", "/etc/shadow", "/etc/passwd", "{home}/.bash_history"]:
    attempt("read " + path, lambda: open(path).read())
attempt("list {run_dir}", lambda: os.listdir("{run_dir}"))
print("all reads blocked", flush=True)
''', Limits(wall_s=10), ("exited",), "all reads blocked"),
    Hostile("network", _TRY + '''
import socket
def connect(host, port):
    s = socket.create_connection((host, port), timeout=2)
    s.sendall(b"{token}")
attempt("connect host loopback 127.0.0.1:{port}", lambda: connect("127.0.0.1", {port}))
attempt("connect localhost:{port}", lambda: connect("localhost", {port}))
attempt("connect 1.1.1.1:53", lambda: connect("1.1.1.1", 53))
attempt("resolve example.com", lambda: socket.getaddrinfo("example.com", 80))
print("all connections blocked", flush=True)
''', Limits(wall_s=15), ("exited",), "all connections blocked"),
    Hostile("kill_parent", _TRY + '''
import signal
attempt("kill parent", lambda: os.kill(os.getppid(), signal.SIGKILL) if os.getppid() > 0 else 1 / 0)
attempt("kill host test process {host_pid}", lambda: os.kill({host_pid}, signal.SIGKILL))
attempt("kill every visible process", lambda: os.kill(-1, signal.SIGKILL))
''', Limits(wall_s=10), ("exited", "signal")),
    Hostile("daemon_left_behind", '''
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", "daemon-{token}"])
    os._exit(0)
time.sleep(0.5)
print("daemon started", flush=True)
''', Limits(wall_s=10), ("exited",), "daemon started"),
    Hostile("symlink_and_proc", _TRY + '''
os.symlink("{secret_file}", "/tmp/link")
attempt("read through symlink to the run dir", lambda: open("/tmp/link").read())
os.symlink("{run_dir}", "/tmp/dirlink")
attempt("write through symlinked dir", lambda: open("/tmp/dirlink/escape-{token}", "w").write("x"))
attempt("read /proc/1/root secret", lambda: open("/proc/1/root{secret_file}").read())
def scan_environ():
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if b"{token}" in open(f"/proc/{{pid}}/environ", "rb").read():
                    return
            except OSError:
                pass
    raise PermissionError("no process with the host secret is visible")
attempt("find the host's secret in /proc/*/environ", scan_environ)
attempt("write /proc/sys/kernel/hostname", lambda: open("/proc/sys/kernel/hostname", "w").write("pwned"))
attempt("read host /proc/{host_pid}/cmdline", lambda: open("/proc/{host_pid}/cmdline").read())
print("all tricks blocked", flush=True)
''', Limits(wall_s=10), ("exited",), "all tricks blocked"),
]
