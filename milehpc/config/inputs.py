"""Every input a job reads, checked on the login node before it queues (``plan``, ``render``, ``submit`` and ``run``
call :func:`check_inputs`): files and folders exist and are readable, the prompt field is in the first rows of a
JSONL, Parquet or ``datasets`` file, a ``module:function`` plugin imports, and a Hugging Face hub id (which compute
nodes cannot download) gets one line saying how to download it first.

A path that exists on the compute nodes only (node-local NVMe) cannot be looked at here: the site partition lists
such folders (``compute_only_paths``) and the job names the fields that point there
(``resources.compute_only_inputs``); those paths must then lie under one of the site's folders.

Login-safe: stdlib, plus pyarrow for a Parquet or Arrow schema; the prompt rows themselves are read by
:mod:`milehpc.data.readers` on the ranks.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.config.shape import check_vocabulary
from milehpc.errors import ConfigError

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec
    from milehpc.config.site import Partition

DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".pq")  # a relative file path, not a hub id
FIRST_ROWS = 16  # rows of a prompt file looked at here (the ranks read all of them)
# "org/name" (optionally @revision): what `from_pretrained` would fetch from the hub.
HUB_ID = r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"


def job_inputs(job: JobSpec) -> list[tuple[str, str, str]]:
    """(field, path, kind) of every local path the ranks read; kind is 'model', 'tokenizer' or 'data'."""
    out = []
    if job.model.path:
        out.append(("model.path", job.model.path, "model"))
    if job.model.tokenizer != "toy":
        out.append(("model.tokenizer", job.model.tokenizer, "tokenizer"))
    teacher = job.trainer.options.get("teacher_path")
    if isinstance(teacher, str) and teacher:
        out.append(("trainer.options.teacher_path", teacher, "model"))
    sources = [("data.source", job.data.source), ("data.val_source", job.data.val_source)]
    for name, adapter in (job.trainer.lora.adapters.items() if job.trainer.lora else ()):
        sources += [(f"trainer.lora.adapters.{name}.source", adapter.source),
                    (f"trainer.lora.adapters.{name}.val_source", adapter.val_source)]
    out += [(field, src, "data") for field, src in sources if src and not src.startswith("task:")]
    return out + reward_model_inputs(job)


# The model rewards' parameters that name a host folder, and its kind (milehpc.builtin.rewards: ClassifierParams,
# JudgeParams): the rollout ranks load them, so they are checked here and bound into a container.
MODEL_REWARD_FOLDERS = {"reward_model": (("path", "model"),), "judge": (("path", "model"), ("tokenizer", "tokenizer"))}


def reward_tables(job: JobSpec) -> Iterator[tuple[str, str, Any]]:
    """(field naming it, name, params) of every reward the job names, ``combine``'s parts included."""
    from milehpc.config.job import reward_route

    tables = [("reward.name", job.reward.name, job.reward.params)]
    for source, route in job.reward.by_source.items():
        tables.append((f"reward.by_source.{source}", *reward_route(route)))
    for name, adapter in job.trainer.lora.adapters.items() if job.trainer.lora else ():
        if adapter.reward != "":
            tables.append((f"trainer.lora.adapters.{name}.reward", *reward_route(adapter.reward)))
    for field, name, params in tables:
        yield field, name, params
        parts = params.get("rewards") if name == "combine" and isinstance(params, dict) else None
        for i, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict) and isinstance(part.get("name"), str):
                yield f"{field.removesuffix('.name')}.params.rewards[{i}].name", part["name"], part.get("params")


def reward_model_inputs(job: JobSpec) -> list[tuple[str, str, str]]:
    """(field, path, kind) of the folders the job's reward models and judges load (:data:`MODEL_REWARD_FOLDERS`)."""
    out = []
    for field, name, params in reward_tables(job):
        for key, kind in MODEL_REWARD_FOLDERS.get(name, ()):
            value = params.get(key) if isinstance(params, dict) else None
            if isinstance(value, str) and value not in ("", "toy"):
                out.append((f"{field.removesuffix('.name')}.params.{key}", value, kind))
    return out


def check_inputs(job: JobSpec, partition: Partition, *, file: str | None = None) -> None:
    """Each input path readable here (or declared compute-node-only), each prompt file's prompt field present, each
    ``module:function`` plugin importable; the first problem is one :class:`ConfigError` line."""
    declared = set(job.resources.compute_only_inputs)
    for field, path, kind in job_inputs(job):
        if field in declared:
            _under_compute_only(path, partition, file=file, field=field)
            continue
        _exists(path, kind, file=file, field=field)
        if kind == "data":
            check_prompt_field(path, job.data.prompt_key, file=file, field=field)
    known = {f for f, _, _ in job_inputs(job)}
    for field in sorted(declared - known):
        raise ConfigError(f"expected fields of this job that name a path ({', '.join(sorted(known)) or 'none'}), got "
                          f"{field!r}", file=file, field="resources.compute_only_inputs")
    # The ranks import with the job's own PYTHONPATH ([env]) in front; the login-side import looks there too.
    extra = [p for p in job.env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra
    try:
        for field, ref in _plugin_refs(job):
            check_import(ref, file=file, field=field)
    finally:
        for p in extra:
            sys.path.remove(p)
    if "model.tokenizer" not in declared and "model.path" not in declared:
        check_vocabulary(job, file=file)
    check_tool_parser(job, file=file)


def check_tool_parser(job: JobSpec, *, file: str | None) -> None:
    """The agent generator knows the tool-call format of the model's replies: named, or its family's."""
    if job.rollout.generator != "agent":
        return
    from milehpc.config.families import job_model_type, parser_name

    model_type = job_model_type(job)
    option = job.rollout.generator_params.get("tool_parser")
    if model_type is None and not option:
        return  # a folder only the compute nodes read: the ranks resolve its family
    try:
        parser_name(option, model_type)
    except ValueError as err:
        raise ConfigError(str(err), file=file, field="rollout.generator_params.tool_parser") from None


def absolute_inputs(job: JobSpec) -> JobSpec:
    """The job with every relative input path that exists here (and each relative ``[env] PYTHONPATH`` entry) made
    absolute against this directory: :func:`check_inputs` looked them up here, while the ranks run in the run
    directory, where a relative path names something else (or nothing)."""
    from milehpc.config.load import job_from_dict
    from milehpc.config.schema import to_dict

    data = to_dict(job)
    declared = set(job.resources.compute_only_inputs)
    changed = False
    for field, path, _ in job_inputs(job):
        local = Path(path)
        if field not in declared and not local.is_absolute() and not path.startswith("~") and local.exists():
            changed |= _set_field(data, field, str(local.absolute()))
    entries = job.env.get("PYTHONPATH", "").split(os.pathsep)
    absolute = [str(Path(e).absolute()) if e and not os.path.isabs(e) and "$" not in e and Path(e).exists() else e
                for e in entries]
    if absolute != entries:
        data["env"]["PYTHONPATH"] = os.pathsep.join(absolute)
        changed = True
    return job_from_dict(data) if changed else job


def _set_field(data: dict[str, Any], field: str, value: str) -> bool:
    """Set ``a.b[2].c`` (a field name as :func:`job_inputs` spells it) in the job's dict; False where it is not one."""
    keys: list[str | int] = []
    for part in field.split("."):
        name, *indexes = re.split(r"\[(\d+)\]", part)
        keys += [name, *(int(i) for i in indexes if i)]
    node: Any = data
    for key in keys[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False
    if not isinstance(node, dict) or not isinstance(node.get(keys[-1]), str):
        return False
    node[keys[-1]] = value
    return True


def _under_compute_only(path: str, partition: Partition, *, file: str | None, field: str) -> None:
    roots = [os.path.expandvars(r) for r in partition.compute_only_paths]
    full = os.path.normpath(os.path.expandvars(os.path.expanduser(path)))
    if not any(full == r.rstrip("/") or full.startswith(r.rstrip("/") + "/") for r in roots):
        raise ConfigError(f"listed in resources.compute_only_inputs: expected a path under the site partition's "
                          f"compute_only_paths ({', '.join(partition.compute_only_paths) or 'none'}), got {path!r}",
                          file=file, field=field)


def _exists(path: str, kind: str, *, file: str | None, field: str) -> None:
    full = Path(path).expanduser()
    if full.exists():
        if not os.access(full, os.R_OK) or (full.is_dir() and not os.access(full, os.X_OK)):
            raise ConfigError(f"expected a readable path, got {path!r} (permission denied)", file=file, field=field)
        if kind in ("model", "tokenizer") and not full.is_dir():
            raise ConfigError(f"expected a local Hugging Face folder (save_pretrained), got the file {path!r}",
                              file=file, field=field)
        if kind == "model" and not (full / "config.json").is_file():
            raise ConfigError(f"expected a checkpoint folder with a config.json, got {path!r}", file=file, field=field)
        return
    if re.fullmatch(HUB_ID + r"(@[A-Za-z0-9._/-]+)?", path) and not path.lower().endswith(DATA_SUFFIXES):
        # "org/name" that is no local path: what from_pretrained / load_dataset would fetch from the hub
        name = path.split("@")[0]
        repo = " --repo-type dataset" if kind == "data" else ""
        what = "a dataset folder (datasets.save_to_disk, or one of its .parquet files)" if kind == "data" else \
            "that folder"
        raise ConfigError(f"{path!r} is not a local path but looks like a Hugging Face hub id, which compute nodes "
                          f"cannot download: download it first (huggingface-cli download{repo} {name} --local-dir "
                          f"/path/{name.split('/')[1]}) and set {field} to {what}", file=file, field=field)
    raise ConfigError(f"{path!r} not found on this node (if it exists on the compute nodes only, add {field!r} to "
                      "resources.compute_only_inputs)", file=file, field=field)


# ---- the prompt field ----------------------------------------------------------------------------------------------

def _lookup(row: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(row, dict) or part not in row:
            return False
        row = row[part]
    return True


def check_prompt_field(path: str, prompt_key: str, *, file: str | None, field: str) -> None:
    """The first rows of a prompt file (JSONL, Parquet, a save_to_disk folder) have the prompt field."""
    full = Path(path).expanduser()
    suffix = full.suffix.lower()
    if full.is_dir():
        rows, what = _arrow_folder_rows(full, file=file, field=field), "rows"
    elif suffix in DATA_SUFFIXES[:3]:
        rows, what = _jsonl_rows(full, file=file, field=field), "lines"
    elif suffix in DATA_SUFFIXES[3:]:
        rows, what = _parquet_rows(full, file=file, field=field), "rows"
    else:
        raise ConfigError(f"expected a .jsonl or .parquet file or a datasets.save_to_disk folder, got {path!r}",
                          file=file, field=field)
    if not rows:
        raise ConfigError(f"expected prompts, got an empty file {path!r}", file=file, field=field)
    missing = [where for where, row in rows if not _lookup(row, prompt_key)]
    if missing:
        keys = sorted(rows[0][1]) if isinstance(rows[0][1], dict) else []
        raise ConfigError(f"expected the prompt field data.prompt_key = {prompt_key!r} in the first {what} of "
                          f"{path!r}, missing at {missing[0]} (its keys: {', '.join(keys[:12]) or 'none'})",
                          file=file, field="data.prompt_key")


def _jsonl_rows(path: Path, *, file: str | None, field: str) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ConfigError(f"expected a JSON object on each line of {str(path)!r}, got "
                                          f"{type(row).__name__} on line {lineno}", file=file, field=field)
                    rows.append((f"line {lineno}", row))
                if len(rows) >= FIRST_ROWS:
                    break
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {str(path)!r} as JSONL ({type(err).__name__}: {err})".splitlines()[0],
                          file=file, field=field) from None
    return rows


def _pyarrow(file: str | None, field: str) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401  (submodules used through ``pa``)
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError("reading a Parquet or Arrow prompt file needs the Python package 'pyarrow' (pip install "
                          "pyarrow)", file=file, field=field) from None
    return pa


def _parquet_rows(path: Path, *, file: str | None, field: str) -> list[tuple[str, Any]]:
    pa = _pyarrow(file, field)
    try:
        reader = pa.parquet.ParquetFile(path)
        batch = next(reader.iter_batches(batch_size=FIRST_ROWS), None)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a file that is not Parquet
        raise ConfigError(f"not a readable Parquet file {str(path)!r} ({type(err).__name__}: {err})".splitlines()[0],
                          file=file, field=field) from None
    return [] if batch is None else [(f"row {i}", r) for i, r in enumerate(batch.to_pylist())]


def _arrow_folder_rows(folder: Path, *, file: str | None, field: str) -> list[tuple[str, Any]]:
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        first = folder / state["_data_files"][0]["filename"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"expected a datasets.save_to_disk folder (state.json listing its data files), a .jsonl or "
                          f"a .parquet file, got {str(folder)!r}", file=file, field=field) from None
    pa = _pyarrow(file, field)
    try:
        with pa.memory_map(str(first)) as source:
            batch = next(iter(pa.ipc.open_stream(source)), None)
    except Exception as err:  # noqa: BLE001 - a damaged Arrow stream
        raise ConfigError(f"cannot read {str(first)!r} ({type(err).__name__}: {err})".splitlines()[0], file=file,
                          field=field) from None
    return [] if batch is None else [(f"row {i}", r) for i, r in enumerate(batch.slice(0, FIRST_ROWS).to_pylist())]


# ---- module:function plugins ---------------------------------------------------------------------------------------

def _plugin_refs(job: JobSpec) -> list[tuple[str, str]]:
    """(field, 'module:function') of every plugin the job names by import path."""
    refs = [(field, ref) for field, ref, _ in reward_tables(job) if isinstance(ref, str) and ":" in ref]
    agent = job.rollout.generator_params.get("agent") if job.rollout.generator == "agent" else None
    if isinstance(agent, str) and ":" in agent:  # the agent generator's user code, imported by every rollout rank
        refs.append(("rollout.generator_params.agent", agent))
    return refs


def check_import(ref: str, *, file: str | None, field: str) -> None:
    """``module:function`` imports here (the ranks import it the same way) and names a callable."""
    from milehpc.plugin_types import load_ref

    try:
        obj = load_ref(ref)
    except Exception as err:  # noqa: BLE001 - any import failure of user code is the user's one line
        raise ConfigError(f"expected an importable module:function, got {ref!r} ({type(err).__name__}: "
                          f"{err})".splitlines()[0], file=file, field=field) from None
    if not callable(obj):
        raise ConfigError(f"expected {ref!r} to name a function, got {type(obj).__name__}", file=file, field=field)
