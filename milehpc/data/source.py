"""Prompt sources: a generated task (``task:NAME``) or a local file (JSONL, Parquet, a ``datasets`` folder), in a
seeded order, with a cursor that can be saved and restored (the loop checkpoints it with the rest of its state).
A file source checks its prompts against the tokenizer at the start (chat messages need a chat template) and
drops prompts longer than ``data.max_prompt_tokens``, counting them in :attr:`PromptSource.summary`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError


@dataclass
class Prompt:
    ids: list[int]
    text: str  # as the model sees it (chat messages rendered with the template)
    label: Any
    index: int  # position in the stream (cursor value when drawn): unique within a run
    metadata: dict[str, Any] = field(default_factory=dict)
    raw: Any = None  # the prompt as the file gave it (text or chat messages): what an agent generator starts from


def read_examples(path: str | Path, prompt_key: str = "prompt", label_key: str = "label", *,
                  field: str = "data.source") -> list[dict[str, Any]]:
    """Examples ``{prompt, label, metadata, where}`` of a JSONL / Parquet file or a ``save_to_disk`` folder (see
    :mod:`milehpc.data.readers` and :mod:`milehpc.data.fields`); every problem is one error naming the file."""
    from milehpc.data.fields import to_examples
    from milehpc.data.readers import read_rows

    rows = read_rows(path, field=field)
    if not rows:
        raise ConfigError("no prompts in file", file=str(path), field=field)
    return to_examples(rows, file=str(path), prompt_key=prompt_key, label_key=label_key)


class PromptSource:
    """An endless stream over ``examples``: epoch ``e`` visits them in a permutation seeded by ``(seed, e)``.

    The stream is a pure function of ``(examples, seed, shuffle)`` and the cursor, so ranks that build the same
    source agree on every prompt, and restoring the cursor resumes the exact sequence.
    """

    def __init__(self, examples: Sequence[dict[str, Any]], tokenizer: Any, *, seed: int = 0, shuffle: bool = True,
                 chat_template: bool = False, name: str = "") -> None:
        if len(examples) == 0:
            raise ConfigError("the prompt source is empty", field="data.source")
        self.examples, self.tokenizer = examples, tokenizer
        self.seed, self.shuffle, self.chat_template, self.name = seed, shuffle, chat_template, name
        self.cursor = 0
        self._epoch, self._order = -1, None
        self.summary = ""  # what was read and dropped, one line (file sources)
        self.data_sources: set[str] = set()  # the rows' data_source values (file sources)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.examples))
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            import numpy as np

            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            self._epoch = epoch
        return int(self._order[offset])

    def peek(self, position: int) -> Prompt:
        ex = self.examples[self._index(position)]
        ids, text = encode_example(self.tokenizer, ex, chat_template=self.chat_template)
        return Prompt(ids, text, ex.get("label"), position, dict(ex.get("metadata") or {}), raw=ex["prompt"])

    def take(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts; advances the cursor."""
        out = [self.peek(self.cursor + i) for i in range(k)]
        self.cursor += k
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "seed": self.seed, "size": len(self.examples), "name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("size") not in (None, len(self.examples)):
            raise ConfigError(
                f"the checkpoint's data cursor is for {state['size']} prompts, this source has {len(self.examples)}",
                field="data.source",
            )
        self.cursor = int(state["cursor"])


def build_source(data_spec: Any, tokenizer: Any, *, seed_offset: int = 0, file: str | None = None,
                 split: str = "train") -> PromptSource:
    """The job's prompt source: ``task:NAME`` (a registered task plugin) or a file; ``split = "validation"``
    reads ``data.val_source`` instead of ``data.source``."""
    seed = data_spec.seed + seed_offset
    field = "data.val_source" if split == "validation" else "data.source"
    source = data_spec.val_source if split == "validation" else data_spec.source
    if not source:
        raise ConfigError("no validation prompts: set data.val_source", file=file, field=field)
    if source.startswith("task:"):
        from milehpc import plugins
        from milehpc.config.schema import check_params

        name = source.split(":", 1)[1]
        spec = plugins.lookup("task", name, file=file, field=field)
        params = check_params(spec, data_spec.params, file=file, prefix="data.params")
        examples = spec.load()(seed=seed, **params)
        return PromptSource(examples, tokenizer, seed=seed, shuffle=data_spec.shuffle,
                            chat_template=data_spec.chat_template, name=source)
    rows = read_examples(source, data_spec.prompt_key, data_spec.label_key, field=field)
    kept = fit_tokenizer(rows, tokenizer, source, data_spec.max_prompt_tokens, chat_template=data_spec.chat_template)
    out = PromptSource(kept, tokenizer, seed=seed, shuffle=data_spec.shuffle and split == "train",
                       chat_template=data_spec.chat_template, name=source)
    out.data_sources = {str(ex["metadata"]["data_source"]) for ex in kept if "data_source" in ex["metadata"]}
    dropped = len(rows) - len(kept)
    out.summary = (f"data: {len(kept)} {split} prompts from {source}" + (
        f"; {dropped} of {len(rows)} dropped: longer than data.max_prompt_tokens = {data_spec.max_prompt_tokens} "
        "tokens" if dropped else ""))
    return out


def fit_tokenizer(examples: list[dict[str, Any]], tokenizer: Any, file: str, max_tokens: int, *,
                  chat_template: bool) -> list[dict[str, Any]]:
    """The examples that fit: chat messages need a tokenizer with a chat template (one error naming the first
    such row), and with ``max_tokens > 0`` prompts longer than that are left out (all of them: an error)."""
    from milehpc.data.fields import is_messages

    if not getattr(tokenizer, "has_chat_template", False):
        chat = next((ex for ex in examples if is_messages(ex["prompt"])), None)
        if chat is not None:
            raise ConfigError(f"{chat['where']}: the prompt is chat messages, but the tokenizer has no chat template "
                              "(expected model.tokenizer = a local folder whose tokenizer_config.json has one)",
                              file=file, field="model.tokenizer")
    if max_tokens <= 0:
        return examples
    kept = [ex for ex in examples
            if len(encode_example(tokenizer, ex, chat_template=chat_template)[0]) <= max_tokens]
    if not kept:
        raise ConfigError(f"every one of the {len(examples)} prompts is longer than data.max_prompt_tokens = "
                          f"{max_tokens} tokens", file=file, field="data.max_prompt_tokens")
    return kept


def register_images(data_spec: Any) -> None:
    """Read the images of the job's prompt files (``data.source``, ``data.val_source``) into this process: a rank
    that never builds the prompt source (a separate trainer rank) then resolves every reference the samples carry.
    Generated tasks (``task:NAME``) have no files."""
    for key in ("source", "val_source"):
        path = getattr(data_spec, key, None)
        if path and not path.startswith("task:"):
            read_examples(path, data_spec.prompt_key, data_spec.label_key, field=f"data.{key}")


def encode_example(tokenizer: Any, ex: dict[str, Any], *, chat_template: bool) -> tuple[list[int], str]:
    """(token ids, text as the model sees it) of an example; a prompt with images goes through the model's
    processor (milehpc.data.images), which widens each image placeholder to the image's token count."""
    from milehpc.data.images import IMAGES_KEY, encode_prompt

    images = (ex.get("metadata") or {}).get(IMAGES_KEY)
    if images:
        return encode_prompt(tokenizer, ex["prompt"], images)
    return (tokenizer.encode_prompt(ex["prompt"], chat_template=chat_template),
            tokenizer.render_prompt(ex["prompt"], chat_template=chat_template))


def task_reward_name(data_spec: Any) -> str:
    """The reward a ``task:NAME`` source names ("" for JSONL sources)."""
    if not data_spec.source.startswith("task:"):
        return ""
    from milehpc import plugins

    return plugins.lookup("task", data_spec.source.split(":", 1)[1]).reward
