"""Loading job specs and sites from TOML, with ``--set`` overrides going through the same validation."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from milehpc.config.job import JobSpec
from milehpc.config.schema import build, deep_merge
from milehpc.config.site import Partition, Site, expand_partitions
from milehpc.errors import ConfigError


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file or a syntax error is one line naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read: {err.__class__.__name__}", file=str(path)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML: {err}", file=str(path)) from None


def parse_value(text: str) -> Any:
    """A ``--set`` value in TOML syntax (``4``, ``1e-4``, ``true``, ``["a","b"]``); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides to a copy of ``data``."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"expected key.path=value, got {item!r}", field="--set")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"'{part}' is not a table, cannot set {key}", field="--set")
            node = child
        node[parts[-1]] = parse_value(value)
    return data


def job_label(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """How errors name a job: its file, marked when ``--set`` overrides changed what the file says."""
    return f"{path} (with --set)" if overrides else str(path)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read, override and validate a job spec."""
    data = apply_overrides(read_toml(path), overrides)
    # An override error names the option, a file error the file; both name the field.
    return build(JobSpec, data, file=job_label(path, overrides))


def job_from_dict(data: dict[str, Any], file: str = "<job>") -> JobSpec:
    return build(JobSpec, data, file=file)


def site_data(name: str) -> tuple[dict[str, Any], str]:
    """The raw site dict and where it came from (a TOML path or a plugin)."""
    from milehpc import plugins

    spec = plugins.lookup("site", name, field="--site")
    impl = spec.impl
    if isinstance(impl, str | Path):
        raw, origin = read_toml(impl), str(impl)
    else:
        raw, origin = impl(), f"plugin {name}"
    return expand_partitions(raw, file=origin), origin


def load_site(name: str, job: JobSpec | None = None, job_file: str | None = None) -> tuple[Site, Partition]:
    """The site and the partition the job runs on, with the job's ``[site]`` overrides applied and validated.

    Errors in the site file name the site file; errors the job caused (its partition, its ``[site]`` table)
    name the job file."""
    raw, origin = site_data(name)
    site = build(Site, raw, file=origin)
    part_name = job.resources.partition if job else None
    partition = site.partition(part_name, file=job_file or origin)
    if job and job.site:
        part_raw = raw["partitions"][part_name or site.default_partition]
        partition = build(Partition, deep_merge(part_raw, job.site), file=job_file or "job [site]", prefix="site")
    return site, partition
