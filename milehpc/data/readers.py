"""The raw rows of a prompt file: JSONL, Parquet, or a ``datasets`` ``save_to_disk`` folder (read with pyarrow
alone: the ``datasets`` package is not needed on the ranks).

Each row comes with where it is, for error messages: ``line N`` (JSONL, counted from 1 like an editor) or
``row N`` (Parquet and Arrow, counted from 0 like ``dataset[N]``). Every problem is one :class:`ConfigError` that
names the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError, PluginError

Row = tuple[str, dict[str, Any]]  # (where in the file, the row)
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


def read_rows(path: str | Path, *, field: str = "data.source") -> list[Row]:
    """Every row of ``path`` by its format (a folder is a ``save_to_disk`` dataset)."""
    path = Path(path)
    try:
        return _read_rows(path, field)
    except (OSError, ValueError, KeyError, TypeError) as err:
        # A damaged or foreign file (not UTF-8, a broken state.json, a truncated Arrow stream): one line, not a
        # traceback on every rank. pyarrow's errors derive from these; json's and UTF-8's from ValueError.
        text = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ConfigError(f"cannot read the prompt data ({text})", file=str(path), field=field) from None


def _read_rows(path: Path, field: str) -> list[Row]:
    if path.is_dir():
        return _read_saved_dataset(path, field)
    if not path.is_file():
        raise ConfigError("prompt file not found", file=str(path), field=field)
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        pq = _pyarrow(path).parquet
        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for a file that is not Parquet
            raise ConfigError(f"not a readable Parquet file ({type(err).__name__}: {err})".splitlines()[0],
                              file=str(path), field=field) from None
        return _table_rows(table)
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path)
    raise ConfigError(f"expected a .jsonl, .parquet file or a datasets.save_to_disk folder, got '{suffix or path.name}'",
                      file=str(path), field=field)


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"line {lineno}: invalid JSON ({err.msg})", file=str(path)) from None
            if not isinstance(row, dict):
                raise ConfigError(f"line {lineno}: expected a JSON object, got {type(row).__name__}", file=str(path))
            rows.append((f"line {lineno}", row))
    return rows


def _read_saved_dataset(folder: Path, field: str) -> list[Row]:
    """A ``Dataset.save_to_disk`` folder: ``state.json`` lists the Arrow stream files, in order."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        raise ConfigError(f"a DatasetDict folder: expected one split's folder, e.g. {folder / (splits or ['train'])[0]}"
                          f" (splits: {', '.join(splits)})", file=str(folder), field=field)
    state = folder / "state.json"
    if not state.is_file():
        raise ConfigError("expected a datasets.save_to_disk folder (with state.json), a .jsonl or a .parquet file",
                          file=str(folder), field=field)
    files = [f["filename"] for f in json.loads(state.read_text(encoding="utf-8")).get("_data_files", [])]
    if not files:
        raise ConfigError("state.json lists no data files", file=str(state), field=field)
    pa = _pyarrow(folder)
    tables = []
    for name in files:
        with pa.memory_map(str(folder / name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return _table_rows(pa.concat_tables(tables))


def _table_rows(table: Any) -> list[Row]:
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401  (submodules used through ``pa``)
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise PluginError("reading Parquet and datasets folders needs the Python package 'pyarrow', which is not "
                          "installed (pip install pyarrow)", file=str(path), field="data.source") from None
    return pa
