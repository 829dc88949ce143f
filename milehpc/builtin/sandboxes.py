"""Built-in sandboxes for model-written programs and the tool environment that uses them (registered like any
third-party plugin). Each backend's parameters are declared once here, as its ``schema`` (types, ranges, defaults,
help; ``milehpc plugins show bubblewrap``); the job's ``[sandbox] params`` are checked against them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from milehpc.config.schema import opt
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import Generator, SandboxBackend
from milehpc.sandbox.bubblewrap import SYSTEM_DIRS  # stdlib-only module: cheap to import when listing plugins


@dataclass
class BubblewrapParams:
    bwrap: str = opt("bwrap", help="the bubblewrap executable")
    python: str = opt("python3", help="the Python interpreter inside the sandbox (resolved on its PATH)")
    uid: int = opt(65534, min=1, max=4294967294, help="when milehpc runs as root: the unprivileged uid the program "
                   "runs as (root is exempt from RLIMIT_NPROC)")
    ro_binds: list[str] = opt(list(SYSTEM_DIRS), pattern=r"/[^\0]*", expect="an absolute path",
                              help="host paths mounted read-only (a symlink stays a symlink); nothing else of the "
                                   "host is visible")


@dataclass
class ApptainerParams:
    image: str = opt("", help="the container image (.sif) the program runs in")
    apptainer: str = opt("apptainer", help="the apptainer executable")
    python: str = opt("python3", help="the Python interpreter inside the sandbox (resolved on its PATH)")
    flags: list[str] = opt([], help="extra apptainer exec options")
    workdir_base: str = opt("", pattern=r"(/[^,:\0]*)?", expect="an absolute path without ',' or ':' (they split "
                            "apptainer's --bind), or ''",
                            help="where the per-run host directory is made ('' = the system temporary directory)")


@dataclass
class UnsandboxedParams:
    python: str = opt("python3", help="the Python interpreter (resolved on the host's PATH)")


@dataclass
class PythonToolParams:
    max_turns: int = opt(3, min=1, help="policy turns per sample (each tool call's output starts the next)")
    open_tag: str = opt("<python>", pattern=r".+", expect="a non-empty tag", help="starts a tool call")
    close_tag: str = opt("</python>", pattern=r".+", expect="a non-empty tag", help="ends a tool call")
    output_open: str = opt("<output>", help="put before the program's output")
    output_close: str = opt("</output>", help="put after the program's output")
    max_output_chars: int = opt(256, min=1, help="the program's output is cut to this")
    wall_s: float = opt(5.0, min=0.001, help="wall-clock limit of one tool call, seconds")
    memory_mb: int = opt(512, min=1, help="memory limit of one tool call")


@hookimpl
def milehpc_sandboxes() -> Iterator[SandboxBackend]:
    yield SandboxBackend(name="bubblewrap", impl="milehpc.sandbox.bubblewrap:Bubblewrap",
                         schema=BubblewrapParams,
                         description="bwrap: new pid/net/ipc/uts/mount namespaces, system dirs read-only, private /tmp")
    yield SandboxBackend(name="apptainer", impl="milehpc.sandbox.apptainer:Apptainer", schema=ApptainerParams,
                         description="apptainer exec --containall --net --network none on the site's image")
    yield SandboxBackend(name="none", impl="milehpc.sandbox.unsandboxed:Unsandboxed", schema=UnsandboxedParams,
                         contained=False, description="no sandbox: only with [sandbox] allow_unsandboxed = true")


@hookimpl
def milehpc_generators() -> Iterator[Generator]:
    yield Generator(name="python_tool", impl="milehpc.rollout.python_tool:python_tool_generator",
                    schema=PythonToolParams,
                    description="multi-turn tool use: <python>code</python> runs in the sandbox, its output is "
                                "the observation")
