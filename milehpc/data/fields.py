"""Rows of a prompt file → examples ``{prompt, label, metadata}``, by the job's field mapping.

``data.prompt_key`` and ``data.label_key`` are dotted paths into a row (``reward_model.ground_truth``). A prompt is
text or chat messages ``[{"role": ..., "content": ...}]``. verl's and slime's prepared datasets read as they are:
``prompt`` holds messages, the answer is in ``reward_model.ground_truth`` (verl) or ``label`` (slime), and
``data_source`` (which routes the sample's reward, see ``reward.by_source``) stays in the metadata with every other
column (slime's own ``metadata`` column is taken as the metadata when a row has one).
"""

from __future__ import annotations

from typing import Any

from milehpc.data.images import IMAGES_KEY, has_images, split_images
from milehpc.data.readers import Row
from milehpc.errors import ConfigError

DEFAULT_LABEL_KEY = "label"
# Where prepared datasets keep the answer when the default key is absent: verl's layout (slime's is "label").
LABEL_FALLBACKS = ("reward_model.ground_truth",)
_MISSING = object()


def lookup(row: dict[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` of ``row`` (``_MISSING`` when any step is absent)."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def label_path(rows: list[Row], label_key: str) -> str | None:
    """The path labels are read from: ``label_key``; for the default key, the first of ``label`` and a prepared
    dataset's own answer column that some row has (a row without it is then an error naming that row); None (no
    labels: e.g. majority vote) when no row has any of them."""
    if label_key != DEFAULT_LABEL_KEY or not rows:
        return label_key
    for path in (DEFAULT_LABEL_KEY, *LABEL_FALLBACKS):
        if any(lookup(row, path) is not _MISSING for _, row in rows):
            return path
    return None


def to_examples(rows: list[Row], *, file: str, prompt_key: str, label_key: str) -> list[dict[str, Any]]:
    """Examples of ``rows``; a row without the prompt (or, when labels are read, the label) is one error naming the
    file, the row and the field."""
    labels = label_path(rows, label_key)
    # Columns the prompt and label were taken from whole are not metadata again.
    top_keys = {k for k in (prompt_key, labels) if k and "." not in k}
    out = []
    for where, row in rows:
        prompt = lookup(row, prompt_key)
        if prompt is _MISSING:
            raise ConfigError(f"{where}: no field '{prompt_key}' (data.prompt_key); the row has: "
                              f"{', '.join(sorted(row)) or 'nothing'}", file=file, field="data.prompt_key")
        images: list[str] = []
        if has_images(row, prompt):  # verl's images column or image parts: messages + image references
            prompt, images = split_images(prompt, row.get(IMAGES_KEY), where=where, file=file)
        elif not isinstance(prompt, str) and not is_messages(prompt):
            raise ConfigError(f"{where}: expected field '{prompt_key}' to be text or chat messages [{{role, content}}]"
                              f", got {type(prompt).__name__}", file=file, field="data.prompt_key")
        label = None
        if labels is not None:
            label = lookup(row, labels)
            if label is _MISSING:
                raise ConfigError(f"{where}: no field '{labels}' (data.label_key); the row has: "
                                  f"{', '.join(sorted(row))}", file=file, field="data.label_key")
        meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {
            k: v for k, v in row.items() if k not in top_keys}
        if "data_source" in row and "data_source" not in meta:
            meta = {**meta, "data_source": row["data_source"]}
        if images or IMAGES_KEY in meta:  # references, never the bytes (the metadata goes into every dump)
            meta = {**{k: v for k, v in meta.items() if k != IMAGES_KEY}, **({IMAGES_KEY: images} if images else {})}
        out.append({"prompt": prompt, "label": label, "metadata": meta, "where": where})
    return out
