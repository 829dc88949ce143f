"""What a containerised rank must see of the host: every path the job reads or writes, bound into the container.

A container started with a clean view of the host (Apptainer with the site's binds) sees only what is bound, so a job
whose model, data or checkpoint directory lies outside the run directory fails on every rank at the first read,
after the queue. :func:`job_paths` lists those paths (with the job field that names each), :func:`auto_binds` turns
them into binds (nested paths deduplicated to the outermost one, and nothing that a site or job bind already covers),
and :func:`check_binds` refuses, in one line naming the field, a path that the container would not see or that lies
outside what the site lets a container bind. Login-node safe: standard library only.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from milehpc.errors import ConfigError

# Environment variables that name a directory a rank writes (model/kernel caches): bound when absolute and literal.
_CACHE_NAME = re.compile(r".*(_CACHE|_CACHE_DIR|_CACHE_HOME|_HOME|_DIR)$|^XDG_CACHE_HOME$")


@dataclass(frozen=True)
class JobPath:
    field: str  # the job field (or site/job env variable) that names it
    path: str  # absolute, as the ranks will use it
    writable: bool = False


def _absolute(path: str) -> str:
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def _is_file_source(source: str | None) -> bool:
    return bool(source) and not str(source).startswith("task:")


def _module_dir(module: str, search: list[str]) -> str | None:
    """The PYTHONPATH entry (of ``search``) that holds the top-level package of ``module``, found without
    importing it; None when it is not there (then it comes with the container's own Python)."""
    top = module.split(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top, search)
    if spec is None or not spec.origin and not spec.submodule_search_locations:
        return None
    where = Path(spec.origin) if spec.origin and spec.origin != "namespace" else Path(
        next(iter(spec.submodule_search_locations or [])))
    return str(where.parent.parent if where.name == "__init__.py" else where.parent)


def job_paths(job: Any, run_dir: str, env: dict[str, str] | None = None) -> list[JobPath]:
    """Every host path a rank reads or writes, with the field that names it (see the module docstring).

    ``env`` is the environment the ranks get (site and job ``env``): its cache directories are written, and its
    ``PYTHONPATH`` is where a ``module:function`` reward file is looked for (an installed reward module comes with
    the container's Python instead)."""
    from milehpc.config.inputs import reward_model_inputs, reward_tables

    env = dict(env or {})
    out = [JobPath("run.run_dir", _absolute(run_dir), writable=True)]

    def add(field: str, value: str | None, *, writable: bool = False) -> None:
        if value:
            out.append(JobPath(field, _absolute(value), writable))

    add("model.path", job.model.path)
    if job.model.tokenizer != "toy":
        add("model.tokenizer", job.model.tokenizer)
    for field in ("source", "val_source"):
        value = getattr(job.data, field)
        if _is_file_source(value):
            add(f"data.{field}", value)
    for name, adapter in job.trainer.lora.adapters.items() if job.trainer.lora else ():
        for field in ("source", "val_source"):
            if _is_file_source(getattr(adapter, field)):
                add(f"trainer.lora.adapters.{name}.{field}", getattr(adapter, field))
    for key, value in job.trainer.options.items():
        if key.endswith("_path") and isinstance(value, str):  # teacher_path, a critic's or reference's folder
            add(f"trainer.options.{key}", value)
    add("checkpoint.dir", job.checkpoint.dir, writable=True)
    search = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "$" not in p]
    for field, name, _ in reward_tables(job):
        if name and ":" in name and search:
            add(field, _module_dir(name.split(":", 1)[0], [_absolute(p) for p in search]))
    for field, value, _ in reward_model_inputs(job):  # a reward model's or judge's folder
        add(field, value)
    for key, value in sorted(env.items()):
        if _CACHE_NAME.fullmatch(key) and value.startswith(("/", "~")) and "$" not in value:
            add(f"env.{key}", value, writable=True)
    return out


def _under(path: str, root: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(root))


def bind_targets(binds: Iterable[str]) -> list[str]:
    """Where each bind spec ``src[:dst[:opts]]`` appears inside the container."""
    targets = []
    for spec in binds:
        parts = spec.split(":")
        targets.append(os.path.normpath(parts[1] if len(parts) > 1 and parts[1] else parts[0]))
    return targets


def _bind_source(p: JobPath) -> str | None:
    """The host directory to bind for ``p``: the folder itself, or a file's folder; a directory the job will write
    is bound as it is (:func:`create_writable` makes it before the job starts: a bind source must exist); None for a
    path the job only reads that does not exist here (the input checks report it)."""
    path = Path(p.path)
    if path.is_dir() or (p.writable and not path.exists()):
        return str(path)
    if path.exists():
        return str(path.parent)
    return None


def create_writable(paths: list[JobPath]) -> None:
    """Make the directories the job writes (checkpoint dir, caches) that do not exist yet, so that their binds have
    a source when the container starts (on the login node: they are on the file systems compute nodes share)."""
    for p in paths:
        if p.writable:
            try:
                Path(p.path).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"cannot create {p.path}: {err.strerror}", field=p.field) from None


def auto_binds(paths: list[JobPath], existing: Iterable[str]) -> list[str]:
    """Binds (same path inside and out) for the paths no existing bind covers, each covered once: a bind under
    another one is dropped (a model folder inside the data's project directory needs no bind of its own)."""
    covered = bind_targets(existing)
    sources = (_bind_source(p) for p in paths if not any(_under(p.path, root) for root in covered))
    wanted = sorted({s for s in sources if s}, key=lambda s: (len(PurePosixPath(s).parts), s))
    out: list[str] = []
    for source in wanted:
        if source == "/":
            continue  # never the host's root: check_binds names the path that led here
        if not any(_under(source, root) for root in [*covered, *out]):
            out.append(source)
    return out


def check_binds(paths: list[JobPath], binds: Iterable[str], *, allowed: Iterable[str] = (), site: str = "",
                file: str | None = None) -> None:
    """One line (exit 2) for the first path the container would not see through ``binds``, or that lies outside the
    site's ``allowed`` roots (the host paths its container platform may bind; empty = any)."""
    targets = bind_targets(binds)
    roots = [os.path.normpath(r) for r in allowed]
    for p in paths:
        if not p.writable and not Path(p.path).exists():
            continue  # an input that is not here: the input checks say so (or the ranks, where only they see it)
        if not Path(*Path(p.path).parts[:2]).exists():
            continue  # under no top directory of this machine: `plan`'s placeholder run dir
        if roots and not any(_under(p.path, r) for r in roots):
            raise ConfigError(f"expected a path the site{' ' + site if site else ''} lets a container bind (under "
                              f"{', '.join(roots)}), got {p.path}", file=file, field=p.field)
        if not any(_under(p.path, t) for t in targets):
            raise ConfigError(f"{p.path} is not bound into the container (binds: {', '.join(targets) or 'none'}): "
                              "add its directory to container.binds, or leave container.auto_binds on",
                              file=file, field=p.field)
