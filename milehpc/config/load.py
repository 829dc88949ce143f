"""Loading job specs and sites from TOML, with ``--set`` overrides going through the same validation."""

from __future__ import annotations

import copy
import os
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

# A job spec or site file is a few KiB; anything near this is not one (and reading it all would cost the login node).
MAX_TOML_BYTES = 4 << 20
# Tables and arrays nested deeper than this are no job spec or site (every check below recurses through them).
MAX_DEPTH = 32
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def _decode(raw: bytes, path: Path) -> str:
    """TOML is UTF-8: anything else (binary, UTF-16, Latin-1) is one line saying what it is."""
    for bom, name in _BOMS:
        if raw.startswith(bom):
            raise ConfigError(f"expected UTF-8 text, got {name} (byte-order mark); save the file as UTF-8",
                              file=str(path))
    if b"\x00" in raw:
        raise ConfigError(f"expected a TOML text file, got binary data (a NUL byte at offset {raw.index(0)})",
                          file=str(path))
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")  # a UTF-8 byte-order mark is harmless
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"expected UTF-8 text, got byte 0x{raw[err.start]:02x} on line {line} (another encoding?"
                          " save the file as UTF-8)", file=str(path)) from None


def _depth(value: Any, where: str = "") -> tuple[int, str]:
    """How deep tables and arrays nest in ``value`` (iterative: a deep value must not exhaust the stack here)."""
    deepest, at = 0, where
    stack = [(value, 0, where)]  # the document (or a --set value) itself is level 0
    while stack:
        node, depth, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            # The path names the first few levels only: the error stays one readable line.
            child_path = (path if depth > 3 else f"{path}[{key}]" if isinstance(node, list) else
                          f"{path}.{key}" if path else str(key))
            if isinstance(child, dict | list):
                if depth + 1 > deepest:
                    deepest, at = depth + 1, child_path
                stack.append((child, depth + 1, child_path))
    return deepest, at


def check_depth(data: Any, *, file: str | None, field: str | None = None) -> None:
    """Refuse tables/arrays nested deeper than :data:`MAX_DEPTH` (one line naming where)."""
    depth, at = _depth(data, field or "")
    if depth > MAX_DEPTH:
        raise ConfigError(f"expected tables and arrays nested at most {MAX_DEPTH} deep, got {depth} levels",
                          file=file, field=at or field)


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; a missing, unreadable, huge, binary, non-UTF-8, malformed or absurdly nested file is one
    line naming the file."""
    path = Path(path)
    try:
        info = path.stat()
        if not path.is_file():  # a FIFO or a device would block or never end
            raise ConfigError("expected a regular file", file=str(path))
        if info.st_size > MAX_TOML_BYTES:
            raise ConfigError(f"expected a TOML file of at most {MAX_TOML_BYTES >> 20} MiB, got {info.st_size} bytes",
                              file=str(path))
        with path.open("rb") as fh:
            raw = fh.read(MAX_TOML_BYTES + 1)  # a file still growing is read no further than the limit
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except (IsADirectoryError, PermissionError, OSError) as err:
        raise ConfigError(f"cannot read: {err.__class__.__name__}", file=str(path)) from None
    if len(raw) > MAX_TOML_BYTES:
        raise ConfigError(f"expected a TOML file of at most {MAX_TOML_BYTES >> 20} MiB, got more", file=str(path))
    text = _decode(raw, path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML: {err}", file=str(path)) from None
    except RecursionError:
        # tomllib recurses once per nested array or inline table.
        raise ConfigError(f"invalid TOML: arrays or inline tables nested too deeply (at most {MAX_DEPTH})",
                          file=str(path)) from None
    check_depth(data, file=str(path))
    return data


def parse_value(text: str) -> Any:
    """A ``--set`` value in TOML syntax (``4``, ``1e-4``, ``true``, ``["a","b"]``); anything else is a string."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"expected a value nested at most {MAX_DEPTH} deep, got {text[:40]!r}...",
                          field="--set") from None
    depth, _ = _depth([value])  # the value sits one level down, as under its key in a file
    if depth > MAX_DEPTH:
        raise ConfigError(f"expected a value nested at most {MAX_DEPTH} deep, got {depth} levels", field="--set")
    return value


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
    check_depth(data, file=job_label(path, overrides))  # a long --set key path nests too
    # An override error names the option, a file error the file; both name the field.
    return build(JobSpec, data, file=job_label(path, overrides))


def job_from_dict(data: dict[str, Any], file: str = "<job>") -> JobSpec:
    return build(JobSpec, data, file=file)


def read_run_json(path: Path) -> dict[str, Any]:
    """A JSON object that ``milehpc submit`` wrote into a run directory (job.json, plan.json, site.json)."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("file not found (is this a run directory written by `milehpc submit`?)",
                          file=str(path)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read: {err}", file=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("expected a JSON object", file=str(path))
    return data


def run_job(run_dir: Path) -> JobSpec:
    """The job spec of a run directory (its ``job.json``)."""
    return job_from_dict(read_run_json(run_dir / "job.json"), file=str(run_dir / "job.json"))


def site_data(name: str) -> tuple[dict[str, Any], str]:
    """The raw site dict and where it came from (a TOML path or a plugin)."""
    from milehpc import plugins

    if name.endswith(".toml") or os.sep in name:  # --site path/to/site.toml: a site file used without packaging
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"expected a site name or an existing site TOML file, got {name!r}", field="--site")
        return expand_partitions(read_toml(path), file=str(path)), str(path)
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
