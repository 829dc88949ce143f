"""The one HDF5 codec of samples, used by checkpoints (their sample buffers) and by the rollout dumps.

:func:`write_samples` / :func:`read_samples` put a list of samples (or a list of groups of samples) into an
``h5py.Group``; :func:`write_samples_h5` / :func:`read_samples_h5` are a file of named buffers built on them.

Layout of a group (``n`` samples; any HDF5 tool can read it):

- ragged ``prompt_ids``, ``response_ids``, ``rollout_logprobs``, ``loss_mask``: flat, with ``<name>_offsets``
  (int64, ``n + 1``): ``x[offsets[i]:offsets[i+1]]`` is sample i;
- ``group``, ``index``, ``weight_version``: int64;
- ``status``, ``prompt_text``, ``response_text``: UTF-8 strings;
- ``reward``: ``Sample.scalar_reward`` as a float, for tools (the reader takes the reward from ``reward_detail``);
- ``reward_detail``, ``label``, ``metadata``, ``routed_experts``: JSON strings (``null`` for None);
- ``group_sizes`` (int64) when the samples are a list of groups;
- ``<text>_json`` (JSON strings), only when a text holds what an HDF5 string cannot (NUL, a lone surrogate): the
  exact text; the string dataset then holds a readable copy (U+FFFD / ``?`` in place of those characters).

Exact mode (the default; checkpoints) stores ids as int64 and logprobs as float64, so Python floats come back
bit-for-bit and a resumed run trains on the numbers the uninterrupted one would have. Compact mode (the dumps)
stores ids as int32 and logprobs / ``reward`` as float32. The reader takes the dtypes from the file.

The reader also reads the two previous layouts: checkpoints with one ``extra`` JSON dataset per sample (reward,
label, texts, metadata, routed_experts) and no text datasets; rollout dumps without ``metadata`` / ``routed_experts``.
h5py and numpy are imported lazily (login-node code imports the checkpoint package).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure
from milehpc.samples.sample import Sample, Status

if TYPE_CHECKING:
    import h5py

# name -> (exact dtype, compact dtype)
RAGGED = {"prompt_ids": ("int64", "int32"), "response_ids": ("int64", "int32"),
          "rollout_logprobs": ("float64", "float32"), "loss_mask": ("int8", "int8")}
SCALARS = ("group", "index", "weight_version")
TEXTS = ("status", "prompt_text", "response_text")
# dataset name -> Sample field, stored as JSON; the value when the dataset is absent (an older file)
JSONS = {"reward_detail": ("reward", None), "label": ("label", None), "metadata": ("metadata", dict),
         "routed_experts": ("routed_experts", None)}
# the previous checkpoint layout: one JSON per sample of reward, label, texts, metadata and routed_experts
_LEGACY_EXTRA = "extra"

Buffer = list[Sample] | list[list[Sample]]


def write_samples(g: h5py.Group, samples: Buffer, *, compact: bool = False) -> None:
    """Write ``samples`` (a list of samples or a list of groups of samples) as datasets of ``g``."""
    import h5py
    import numpy as np

    nested = bool(samples) and isinstance(samples[0], list)
    flat: list[Sample] = [s for grp in samples for s in grp] if nested else list(samples)  # type: ignore[union-attr]
    if nested:
        g.create_dataset("group_sizes", data=np.asarray([len(grp) for grp in samples], dtype=np.int64))
    for key, dtypes in RAGGED.items():
        rows = [getattr(s, key) for s in flat]
        g.create_dataset(key, data=np.asarray([x for r in rows for x in r], dtype=dtypes[compact]))
        g.create_dataset(f"{key}_offsets", data=np.cumsum([0, *map(len, rows)], dtype=np.int64))
    for key in SCALARS:
        g.create_dataset(key, data=np.asarray([getattr(s, key) for s in flat], dtype=np.int64))
    rewards = [s.scalar_reward for s in flat]
    g.create_dataset("reward", data=np.asarray(rewards, dtype="float32" if compact else "float64"))
    strings = h5py.string_dtype()
    for key in TEXTS:
        texts = [s.status.value if key == "status" else getattr(s, key) for s in flat]
        safe = [_h5_string(t) for t in texts]
        g.create_dataset(key, data=safe, dtype=strings)
        if safe != texts:
            g.create_dataset(f"{key}_json", data=[json.dumps(t) for t in texts], dtype=strings)
    for key, (attr, _) in JSONS.items():
        try:
            values = [json.dumps(getattr(s, attr)) for s in flat]
        except (TypeError, ValueError) as err:
            raise RuntimeFailure(f"samples in HDF5 group {g.name!r}: a sample's {attr} is not JSON-serialisable "
                                 f"({err})") from None
        g.create_dataset(key, data=values, dtype=strings)


def read_samples(g: h5py.Group) -> Buffer:
    """Inverse of :func:`write_samples` (also reads the previous checkpoint and dump layouts)."""
    import numpy as np

    n = len(g["prompt_ids_offsets"]) - 1
    fields: list[dict[str, Any]] = [{} for _ in range(n)]
    for key in RAGGED:
        values, off = g[key][()].tolist(), g[f"{key}_offsets"][()].tolist()
        for i, f in enumerate(fields):
            f[key] = values[off[i]:off[i + 1]]
    for key in SCALARS:
        for f, v in zip(fields, g[key][()].tolist(), strict=True):
            f[key] = v
    for key in TEXTS:
        if key not in g:
            continue  # the previous checkpoint layout keeps the texts in ``extra``
        exact = f"{key}_json"
        values = [json.loads(x) for x in g[exact].asstr()[()]] if exact in g else g[key].asstr()[()].tolist()
        for f, v in zip(fields, values, strict=True):
            f[key] = Status(v) if key == "status" else v
    if _LEGACY_EXTRA in g:
        for f, x in zip(fields, g[_LEGACY_EXTRA].asstr()[()], strict=True):
            f.update(json.loads(x))
    else:
        for key, (attr, default) in JSONS.items():
            values = [json.loads(x) for x in g[key].asstr()[()]] if key in g else [default() if default else None] * n
            for f, v in zip(fields, values, strict=True):
                f[attr] = v
    flat = [Sample(**f) for f in fields]
    if "group_sizes" not in g:
        return flat
    bounds = np.cumsum([0, *g["group_sizes"][()].tolist()]).tolist()
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def write_samples_h5(path: Path, buffers: dict[str, Buffer]) -> None:
    """Write named sample buffers (e.g. ``carry``, ``ready``) to one HDF5 file, one group per buffer, exactly."""
    import h5py

    with h5py.File(path, "w") as f:
        for name, buffer in buffers.items():
            write_samples(f.create_group(name), buffer)


def read_samples_h5(path: Path) -> dict[str, Buffer]:
    """Inverse of :func:`write_samples_h5`."""
    import h5py

    with h5py.File(path, "r") as f:
        return {name: read_samples(g) for name, g in f.items()}


def _h5_string(text: str) -> str:
    """``text`` if an HDF5 variable-length UTF-8 string can hold it, else a readable copy (NUL -> U+FFFD, lone
    surrogates -> ``?``)."""
    if "\x00" not in text:
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            pass
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
