"""Typed config sections as dataclasses, built from TOML tables with one-line errors.

A field's type hint is the schema; ``field(metadata=...)`` adds ``min``, ``max``, ``pattern`` and ``help``.
Unknown keys, missing fields and wrong types all raise :class:`ConfigError` naming the file and the dotted
field, what was expected and what was got. A number is finite (NaN and ±inf are refused) unless its field says
``nonfinite=True`` and documents what NaN or infinity mean there.

Plugins declare their parameters the same way: a dataclass of :func:`opt` fields given as the registered entry's
``schema`` (:class:`milehpc.plugin_types.Registered`); :func:`check_params` validates a job's params against it
on the login node, and :func:`schema_rows` is what ``milehpc plugins show`` prints.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from milehpc.errors import ConfigError, did_you_mean
from milehpc.plugin_types import Registered

T = TypeVar("T")

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if tp in _TYPE_NAMES:
        return _TYPE_NAMES[tp]
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a table"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _refuse_nonfinite(value: Any, where: str, file: str | None) -> None:
    """NaN or ±inf anywhere in a free-form value (a table or list of ``Any``): no free-form option means them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"expected a finite number, got {value!r}", file=file, field=where)
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_nonfinite(item, f"{where}.{key}", file)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_nonfinite(item, f"{where}[{i}]", file)


def convert(tp: Any, value: Any, where: str, file: str | None, *, finite: bool = True) -> Any:
    """Check ``value`` against the type ``tp`` and return it (nested dataclasses built). ``finite=False`` lets a
    number field take NaN and ±inf (only for a field that documents what they mean)."""
    origin = get_origin(tp)
    if tp is Any:
        if finite:
            _refuse_nonfinite(value, where, file)
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, where, file, finite=finite)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:  # one type besides None: its own message (e.g. "expected a finite number")
            raise errors[0]
        raise ConfigError(f"expected {_describe(tp)}, got {_got(value)}", file=file, field=where)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"expected {_describe(tp)}, got {_got(value)}", file=file, field=where)
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, file=file, prefix=where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"expected {_describe(tp)}, got {_got(value)}", file=file, field=where)
        (item,) = get_args(tp)
        return [convert(item, v, f"{where}[{i}]", file, finite=finite) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, got {_got(value)}", file=file, field=where)
        key_tp, val_tp = get_args(tp)
        return {str(k): convert(val_tp, v, f"{where}.{k}", file, finite=finite) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"expected a number, got {_got(value)}", file=file, field=where)
        if finite and not math.isfinite(value):
            # NaN passes every range check (all comparisons are false) and inf overflows later: refuse both here.
            raise ConfigError(f"expected a finite number, got {value!r}", file=file, field=where)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, got {_got(value)}", file=file, field=where)
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(f"expected {_describe(tp)}, got {_got(value)}", file=file, field=where)
        return value
    raise TypeError(f"schema type {tp!r} at {where} is not supported")


def _check_constraints(f: dataclasses.Field, value: Any, where: str, file: str | None) -> None:
    meta = f.metadata
    if value is None:
        return
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"expected a value >= {meta['min']}, got {value!r}", file=file, field=where)
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"expected a value <= {meta['max']}, got {value!r}", file=file, field=where)
    if "pattern" in meta:
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not re.fullmatch(meta["pattern"], str(item)):
                desc = meta.get("expect", f"a value matching {meta['pattern']}")
                raise ConfigError(f"expected {desc}, got {item!r}", file=file, field=where)


def build(cls: type[T], data: Any, *, file: str | None = None, prefix: str = "") -> T:
    """Build the dataclass ``cls`` from a TOML table, validating every key."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"expected a table, got {_got(data)}", file=file, field=prefix or None)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"unknown key (expected one of: {', '.join(sorted(fields))}){did_you_mean(unknown[0], fields)}",
                          file=file, field=where)
    kwargs = {}
    for name, f in fields.items():
        where = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing (expected {_describe(hints[name])})", file=file, field=where)
            continue
        raw = data[name]
        if "coerce" in f.metadata:  # e.g. a TOML time-of-day read as a Slurm time string (config.slurm_time)
            raw = f.metadata["coerce"](raw)
        value = convert(hints[name], raw, where, file, finite=not f.metadata.get("nonfinite", False))
        _check_constraints(f, value, where, file)
        kwargs[name] = value
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(file=file, prefix=prefix)
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass tree back to plain TOML/JSON-able data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``over`` laid on top: tables merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def opt(default: Any = dataclasses.MISSING, *, help: str = "", **meta: Any) -> Any:
    """A field with a help text and constraints (``min``, ``max``, ``pattern``, ``expect``, ``nonfinite``: NaN/±inf
    allowed, say in ``help`` what they mean; ``coerce``: a function applied to the raw TOML value first)."""
    meta["help"] = help
    if isinstance(default, list | dict):
        # Each instance gets its own copy of a mutable default.
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_params(declared: Registered | dict[str, Any], params: dict[str, Any], *, file: str | None,
                 prefix: str) -> dict[str, Any]:
    """Validate a plugin's params against what it declares; returns every parameter with its value.

    ``declared`` is the registered entry (its ``schema`` dataclass: types, ranges, the schema's own ``validate``)
    or, for a plugin that declares ``defaults`` only, those defaults (each value's type is the parameter's)."""
    schema = getattr(declared, "schema", None)
    if schema is not None:
        known = sorted(f.name for f in dataclasses.fields(schema) if f.init)
        for key in params if isinstance(params, dict) else ():
            if key not in known:
                raise ConfigError(f"unknown parameter (expected one of: {', '.join(known) or 'none'})"
                                  f"{did_you_mean(key, known)}", file=file, field=f"{prefix}.{key}")
        built = build(schema, params, file=file, prefix=prefix)
        return {f.name: to_dict(getattr(built, f.name)) for f in dataclasses.fields(schema) if f.init}
    defaults = declared.defaults if isinstance(declared, Registered) else declared
    out = dict(defaults)
    for key, value in params.items():
        where = f"{prefix}.{key}"
        if key not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            raise ConfigError(f"unknown parameter (expected one of: {known}){did_you_mean(key, defaults)}", file=file,
                              field=where)
        default = defaults[key]
        if default is not None:
            tp = float if isinstance(default, float) else type(default)
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
                raise ConfigError(f"expected {_describe(tp)}, got {_got(value)}", file=file, field=where)
        _refuse_nonfinite(value, where, file)
        out[key] = value
    return out


def schema_rows(declared: Registered | type) -> list[dict[str, str]]:
    """One row per parameter (name, type, default, range, help): a schema dataclass's fields, or for a plugin
    that declares ``defaults`` only, those with each default's type."""
    schema = declared if isinstance(declared, type) else declared.schema
    if schema is None:
        assert isinstance(declared, Registered)
        return [{"name": k, "type": "any value" if v is None else _describe(float if isinstance(v, float) else type(v)),
                 "default": repr(v), "range": "", "help": ""} for k, v in sorted(declared.defaults.items())]
    hints = get_type_hints(schema)
    rows = []
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        default = (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        meta = f.metadata
        limits = [f">= {meta['min']}" if "min" in meta else "", f"<= {meta['max']}" if "max" in meta else "",
                  meta.get("expect", f"matches {meta['pattern']}") if "pattern" in meta else ""]
        rows.append({"name": f.name, "type": _describe(hints[f.name]),
                     "default": "required" if default is dataclasses.MISSING else repr(to_dict(default)),
                     "range": ", ".join(x for x in limits if x), "help": meta.get("help", "")})
    return rows


def merge_params(defaults: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A plugin's params over its declared defaults, unchecked: for the ranks, where the login node has checked
    them with :func:`check_params` (milehpc.config.rules)."""
    return {**defaults, **params}
