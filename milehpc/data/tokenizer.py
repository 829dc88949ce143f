"""Tokenizers: a character vocabulary built in code for the toy tasks, or a real tokenizer from a local folder.

Both expose the small surface the loop needs (``encode``, ``decode``, ``pad_id``, ``eos_id``, ``vocab_size``,
``render_prompt`` / ``encode_prompt`` for a prompt that is text or chat messages ``[{"role", "content"}]``: messages
always go through the tokenizer's chat template, text only when asked and one is available). Token ids never
round-trip through text between engine and trainer; decoding is only for rewards and display.
"""

from __future__ import annotations

import string
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from milehpc.errors import ConfigError

SPECIALS = ("<pad>", "<bos>", "<eos>")
# Everything the shipped toy tasks and the multi-turn toy environment print, plus room for user JSONL prompts.
CHARS = string.digits + string.ascii_lowercase + " +-*=:,.?!<>()[]"
PromptInput = str | list[dict[str, Any]]  # text, or chat messages


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_prompt(self, prompt: PromptInput, *, chat_template: bool = False) -> str: ...

    def encode_prompt(self, prompt: PromptInput, *, chat_template: bool = False) -> list[int]: ...


def _no_template(prompt: PromptInput) -> ConfigError:
    return ConfigError(f"a chat-message prompt needs a tokenizer with a chat template, got {str(prompt)[:60]!r}",
                       field="model.tokenizer")


class CharTokenizer:
    """One token per character of a fixed alphabet; unknown characters are an error (toy prompts are ours)."""

    has_chat_template = False

    def __init__(self, chars: str = CHARS) -> None:
        self.itos = [*SPECIALS, *dict.fromkeys(chars)]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.vocab_size = len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the toy vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        # Specials are not text: drop them.
        return "".join(self.itos[i] for i in ids if i >= len(SPECIALS) and i < self.vocab_size)

    def render_prompt(self, prompt: PromptInput, *, chat_template: bool = False) -> str:
        if not isinstance(prompt, str):
            raise _no_template(prompt)
        return prompt

    def encode_prompt(self, prompt: PromptInput, *, chat_template: bool = False) -> list[int]:
        return [self.bos_id, *self.encode(self.render_prompt(prompt))]


class HFTokenizer:
    """A ``transformers`` tokenizer loaded from a local folder (no downloads)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ConfigError(f"expected a local tokenizer folder, got {path!r}", field="model.tokenizer")
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_id = int(self.tok.eos_token_id)
        self.pad_id = int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id
        self.vocab_size = len(self.tok)
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _templated(self, prompt: PromptInput, chat_template: bool) -> bool:
        return not isinstance(prompt, str) or (chat_template and self.has_chat_template)

    def render_prompt(self, prompt: PromptInput, *, chat_template: bool = False) -> str:
        """The prompt as the model sees it: chat messages (or text, with ``chat_template``) through the template,
        with the assistant turn opened."""
        if not self._templated(prompt, chat_template):
            return str(prompt)
        if not self.has_chat_template:
            raise _no_template(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return str(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def encode_prompt(self, prompt: PromptInput, *, chat_template: bool = False) -> list[int]:
        # A rendered template carries its own special tokens (BOS included): add none on top.
        text = self.render_prompt(prompt, chat_template=chat_template)
        return list(self.tok.encode(text, add_special_tokens=not self._templated(prompt, chat_template)))


@lru_cache(maxsize=8)
def build_tokenizer(name: str) -> CharTokenizer | HFTokenizer:
    """``"toy"`` → the character tokenizer; otherwise a local tokenizer folder. One per name and process (they hold
    no state): the engine, the rollout side and the trainer side of a rank share it instead of loading it thrice."""
    if name == "toy":
        return CharTokenizer()
    return HFTokenizer(name)
