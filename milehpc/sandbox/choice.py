"""Which sandbox a run uses, and the per-process pools that run programs in it.

The choice: the job's ``[sandbox] backend`` if set, else the site partition's ``[sandbox] backend`` (every shipped
site names one), else ``bubblewrap``; the image likewise. Inside a job the ranks read both from the run directory
(``$MILEHPC_RUN_DIR/job.json`` and ``site.json``, written by ``milehpc submit``), so a reward needs no wiring.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError
from milehpc.sandbox.types import Limits, RunResult, Sandbox

DEFAULT_BACKEND = "bubblewrap"


@dataclass(frozen=True)
class Choice:
    """A resolved sandbox choice (what the job and the site say, merged)."""

    backend: str = DEFAULT_BACKEND
    image: str | None = None
    allow_unsandboxed: bool = False
    workers: int = 0  # 0 = this rank's cores
    params: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        return json.dumps([self.backend, self.image, self.allow_unsandboxed, self.workers, self.params],
                          sort_keys=True)


def resolve(job_sandbox: dict[str, Any] | None, site_sandbox: dict[str, Any] | None) -> Choice:
    """Merge the job's ``[sandbox]`` table over the site partition's (both as plain dicts; missing = unset)."""
    job, site = job_sandbox or {}, site_sandbox or {}
    return Choice(backend=job.get("backend") or site.get("backend") or DEFAULT_BACKEND,
                  image=os.path.expandvars(job.get("image") or site.get("image") or "") or None,
                  allow_unsandboxed=bool(job.get("allow_unsandboxed", False)),
                  workers=int(job.get("workers", 0) or 0), params=dict(job.get("params") or {}))


def from_run_dir(run_dir: str | None = None) -> Choice:
    """The choice recorded in a run directory (default ``$MILEHPC_RUN_DIR``); the default choice outside a run."""
    run_dir = run_dir or os.environ.get("MILEHPC_RUN_DIR")
    if not run_dir:
        return Choice()

    def read(name: str) -> dict[str, Any]:
        path = Path(run_dir, name)
        try:
            return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read the sandbox choice ({err})", file=str(path)) from None

    return resolve(read("job.json").get("sandbox"), (read("site.json").get("partition") or {}).get("sandbox"))


def check(choice: Choice, *, file: str | None = None) -> dict[str, Any]:
    """The backend's checked params for a choice (one-line errors; login-safe: nothing is loaded). The login node
    runs it on the job's and the site's tables merged (milehpc.render.rundir), so a rank never meets a parameter it
    could have refused."""
    from milehpc import plugins
    from milehpc.config.schema import check_params

    spec = plugins.lookup("sandbox", choice.backend, file=file, field="sandbox.backend")
    if not getattr(spec, "contained", True) and not choice.allow_unsandboxed:
        raise ConfigError(f"expected allow_unsandboxed = true to run model output without a sandbox (backend "
                          f"{choice.backend!r}), got false", file=file, field="sandbox.allow_unsandboxed")
    params = check_params(spec, choice.params, file=file, prefix="sandbox.params")
    if choice.image and "image" in spec.defaults and not choice.params.get("image"):
        params["image"] = choice.image  # the job's own params.image wins over the site's image, like every job value
    return params


def build(choice: Choice, *, file: str | None = None) -> Sandbox:
    """The sandbox object for a choice: the backend plugin with its checked params (one-line errors)."""
    from milehpc import plugins

    params = check(choice, file=file)
    spec = plugins.lookup("sandbox", choice.backend, file=file, field="sandbox.backend")
    plugins.check_requires(spec, f"sandbox '{choice.backend}'")
    return spec.load()(**params)  # type: ignore[no-any-return]


def cores() -> int:
    """The cores this process may use (Slurm gives each rank its own: the node's pools add up to its cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Pool:
    """Runs programs in one sandbox, at most ``workers`` at once in this process; ``arun`` for async callers
    (the blocking run moves to a thread, so any event loop may call it)."""

    def __init__(self, sandbox: Sandbox, workers: int = 0) -> None:
        self.sandbox = sandbox
        self.workers = workers or cores()
        self._slots = threading.BoundedSemaphore(self.workers)  # not asyncio's: the reward runner makes new loops

    def run(self, argv: list[str], *, stdin: bytes = b"", files: dict[str, str | bytes] | None = None,
            limits: Limits = Limits()) -> RunResult:
        with self._slots:
            return self.sandbox.run(argv, stdin=stdin, files=files, limits=limits)

    async def arun(self, argv: list[str], *, stdin: bytes = b"", files: dict[str, str | bytes] | None = None,
                   limits: Limits = Limits()) -> RunResult:
        import asyncio  # here, not at the top: the login node imports this module (check/resolve) on every plan

        return await asyncio.to_thread(self.run, argv, stdin=stdin, files=files, limits=limits)


_pools: dict[str, Pool] = {}
_lock = threading.Lock()


def pool_for(choice: Choice | None = None) -> Pool:
    """This process's pool for ``choice`` (default: the run directory's choice), built once."""
    choice = choice or _run_choice()
    with _lock:
        if choice.key() not in _pools:
            _pools[choice.key()] = Pool(build(choice), choice.workers)
        return _pools[choice.key()]


@lru_cache(maxsize=1)
def _run_choice() -> Choice:
    return from_run_dir()


def reset() -> None:
    """Forget the pools and the run directory's choice (tests that switch run directories use this)."""
    with _lock:
        _pools.clear()
    _run_choice.cache_clear()
