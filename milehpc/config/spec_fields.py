"""The job spec's fields as rows (``milehpc spec``): every table of :class:`JobSpec`, nested tables by dotted name,
each field's type, default, range and help, from the same dataclasses that validate a job (one source)."""

from __future__ import annotations

import dataclasses
from typing import Any, get_args, get_origin, get_type_hints

from milehpc.config.job import JobSpec
from milehpc.config.schema import schema_rows
from milehpc.config.site import Partition
from milehpc.errors import ConfigError, did_you_mean


def _table(tp: Any) -> type | None:
    """The dataclass a field holds (``LoraSpec | None`` too), or None for a plain value."""
    for arg in (tp, *get_args(tp)):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def _tables(cls: type, prefix: str = "") -> dict[str, type]:
    """Dotted table name -> its dataclass ("" is the top level)."""
    out = {prefix: cls}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = _table(hints[f.name])
        if inner is not None:  # a table of named tables (trainer.lora.adapters) lists its NAME's fields
            name = f"{prefix}.{f.name}" if prefix else f.name
            out.update(_tables(inner, f"{name}.NAME" if get_origin(hints[f.name]) is dict else name))
    return out


def spec_rows(section: str | None = None) -> list[dict[str, str]]:
    """Rows ``{name, type, default, range, help}`` of every field (``section``: one table and those inside it)."""
    # A job's [site] table overrides the site partition's values with the same keys (milehpc.config.load.load_site),
    # so its fields are the partition's: listed as site.* (defaults: the site model's, where a site file sets none).
    tables = {**_tables(JobSpec), **_tables(Partition, "site")}
    if section is not None and section not in tables:
        known = sorted(t for t in tables if t)
        raise ConfigError(f"unknown job-spec table {section!r} (expected one of: {', '.join(known)})"
                          f"{did_you_mean(section, known)}", field="SECTION")
    rows = []
    for name, cls in tables.items():
        if section and not (name == section or name.startswith(section + ".")):
            continue
        hints = get_type_hints(cls)
        for row in schema_rows(cls):
            if _table(hints[row["name"]]) is None:  # tables are listed by their own fields
                rows.append({**row, "name": f"{name}.{row['name']}" if name else row["name"]})
    return rows
