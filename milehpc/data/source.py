"""Prompt sources: a generated task (``task:NAME``) or a local JSONL file, in a seeded order, with a cursor
that can be saved and restored (the loop checkpoints it with the rest of its state)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milehpc.errors import ConfigError


@dataclass
class Prompt:
    ids: list[int]
    text: str
    label: Any
    index: int  # position in the stream (cursor value when drawn): unique within a run
    metadata: dict[str, Any] = field(default_factory=dict)


def read_jsonl(path: str | Path, prompt_key: str = "prompt", label_key: str = "label") -> list[dict[str, Any]]:
    """Rows ``{prompt, label, metadata}`` of a JSONL file; a bad line is one error naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("prompt file not found", file=str(path), field="data.source")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"line {lineno}: invalid JSON ({err.msg})", file=str(path)) from None
            if not isinstance(row, dict) or prompt_key not in row:
                raise ConfigError(f"line {lineno}: expected an object with key '{prompt_key}'", file=str(path),
                                  field="data.prompt_key")
            meta = row.get("metadata") or {k: v for k, v in row.items() if k not in (prompt_key, label_key)}
            rows.append({"prompt": str(row[prompt_key]), "label": row.get(label_key), "metadata": meta})
    if not rows:
        raise ConfigError("no prompts in file", file=str(path), field="data.source")
    return rows


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
        ids = self.tokenizer.encode_prompt(ex["prompt"], chat_template=self.chat_template)
        return Prompt(ids, ex["prompt"], ex.get("label"), position, dict(ex.get("metadata") or {}))

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


def build_source(data_spec: Any, tokenizer: Any, *, seed_offset: int = 0, file: str | None = None) -> PromptSource:
    """The job's prompt source: ``task:NAME`` (a registered task plugin) or a JSONL path."""
    seed = data_spec.seed + seed_offset
    source = data_spec.source
    if source.startswith("task:"):
        from milehpc import plugins
        from milehpc.config.schema import check_params

        name = source.split(":", 1)[1]
        spec = plugins.lookup("task", name, file=file, field="data.source")
        params = check_params(spec, data_spec.params, file=file, prefix="data.params")
        examples = spec.load()(seed=seed, **params)
        return PromptSource(examples, tokenizer, seed=seed, shuffle=data_spec.shuffle,
                            chat_template=data_spec.chat_template, name=source)
    rows = read_jsonl(source, data_spec.prompt_key, data_spec.label_key)
    return PromptSource(rows, tokenizer, seed=seed, shuffle=data_spec.shuffle,
                        chat_template=data_spec.chat_template, name=source)


def task_reward_name(data_spec: Any) -> str:
    """The reward a ``task:NAME`` source names ("" for JSONL sources)."""
    if not data_spec.source.startswith("task:"):
        return ""
    from milehpc import plugins

    return plugins.lookup("task", data_spec.source.split(":", 1)[1]).reward
