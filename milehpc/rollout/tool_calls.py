"""Tool calls in a model's text → OpenAI ``tool_calls`` objects, one parser per model family's format.

``qwen25`` (Qwen2.5 / Qwen3, also what sglang's ``Qwen25Detector`` reads): each call is
``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``; the text before the first call is the
message's content. A block that is not a JSON object with a string ``name`` stays out of ``tool_calls`` and is
counted in ``malformed`` (the agent sees no call, the way the OpenAI API shows an unparsable one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedTurn:
    """One assistant turn: ``content`` (None when the turn was only tool calls) and OpenAI-format ``tool_calls``."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0


_QWEN25 = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call(name: str, arguments: Any, call_id: str) -> dict[str, Any]:
    # OpenAI sends arguments as a JSON *string*; a model that wrote a string already is passed through.
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def parse_qwen25(text: str, tools: Iterable[str] | None = None, *, id_prefix: str = "call") -> ParsedTurn:
    """Split ``text`` into content and the tool calls of the Qwen2.5 format. ``tools``: the names the request
    offered (a call to another name is malformed); None accepts any name."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(content=text)
    allowed = None if tools is None else set(tools)
    calls: list[dict[str, Any]] = []
    malformed = 0
    for block in _QWEN25.findall(text, start):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            malformed += 1
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or (allowed is not None and name not in allowed):
            malformed += 1
            continue
        calls.append(_call(name, obj.get("arguments", {}), f"{id_prefix}_{len(calls)}"))
    if "</tool_call>" not in text[start:]:  # cut off inside the call (max_tokens): nothing to run
        malformed += 1
    content = text[:start].strip() or None
    return ParsedTurn(content=content, tool_calls=calls, malformed=malformed)


def no_tool_calls(text: str, tools: Iterable[str] | None = None, *, id_prefix: str = "call") -> ParsedTurn:
    """Families without a tool-call format: the whole text is content."""
    return ParsedTurn(content=text)


PARSERS: dict[str, Callable[..., ParsedTurn]] = {"qwen25": parse_qwen25, "none": no_tool_calls}


def parser_for(name: str) -> Callable[..., ParsedTurn]:
    """The parser called ``name`` (``qwen25``, ``none``)."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"expected a tool-call parser among {sorted(PARSERS)}, got {name!r}") from None
