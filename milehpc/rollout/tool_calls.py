"""Tool calls in a model's text → OpenAI ``tool_calls`` objects, one parser per model family's format.

- ``qwen25`` (Qwen2.5 / Qwen3, sglang's ``Qwen25Detector``, vLLM's ``hermes``): each call is
  ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``.
- ``llama3`` (Llama 3.x, sglang's ``llama3``, vLLM's ``llama3_json``): a JSON object ``{"name": NAME,
  "parameters": {...}}`` (``arguments`` also read) that is the whole reply, or follows ``<|python_tag|>``; several
  calls are separated by ``;``.
- ``mistral`` (Mistral / Mixtral): ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` objects,
  or the newer tokenizers' ``[TOOL_CALLS]NAME[ARGS]{...}`` per call.
- ``glm45`` (GLM-4 family, sglang's and vLLM's ``glm45``): ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n
  <arg_value>V</arg_value>...</tool_call>``, each value JSON when it parses as JSON, else the raw string.

The text before the first call is the message's content. A call that does not parse, names no string ``name``, or
names a tool the request did not offer stays out of ``tool_calls`` and is counted in ``malformed`` (the agent sees
no call, the way the OpenAI API shows an unparsable one); so is a call cut off before its end (max_tokens).
``parser_name`` picks the parser of a model family (config.json's ``model_type``); ``tool_parser`` overrides it.
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
    # a call cut off before its end (max_tokens): nothing to run
    malformed += text.count("<tool_call>", start) - text.count("</tool_call>", start)
    content = text[:start].strip() or None
    return ParsedTurn(content=content, tool_calls=calls, malformed=malformed)


class _Calls:
    """The calls of one reply as they are found, with the malformed ones counted."""

    def __init__(self, tools: Iterable[str] | None, id_prefix: str) -> None:
        self.allowed = None if tools is None else set(tools)
        self.prefix = id_prefix
        self.calls: list[dict[str, Any]] = []
        self.malformed = 0

    def add(self, name: Any, arguments: Any) -> None:
        if not isinstance(name, str) or (self.allowed is not None and name not in self.allowed):
            self.malformed += 1
            return
        self.calls.append(_call(name, {} if arguments is None else arguments, f"{self.prefix}_{len(self.calls)}"))

    def add_object(self, obj: Any, *arg_keys: str) -> None:
        """A ``{"name": ..., <arg_key>: {...}}`` object (the first of ``arg_keys`` present holds the arguments)."""
        if not isinstance(obj, dict):
            self.malformed += 1
            return
        self.add(obj.get("name"), next((obj[k] for k in arg_keys if k in obj), None))

    def turn(self, content: str) -> ParsedTurn:
        return ParsedTurn(content=content.strip() or None, tool_calls=self.calls, malformed=self.malformed)


def _json_values(text: str, separator: str = "") -> tuple[list[Any], bool]:
    """The JSON values written one after another in ``text`` (whitespace and ``separator`` between them), and
    whether all of it parsed (a value that does not parse ends the scan)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
        if i == len(text):
            return values, True
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return values, False
        values.append(value)


def parse_llama3(text: str, tools: Iterable[str] | None = None, *, id_prefix: str = "call") -> ParsedTurn:
    """Llama 3.x JSON calls: after ``<|python_tag|>``, or a reply that starts with ``{``."""
    tag = text.find("<|python_tag|>")
    if tag >= 0:
        content, action = text[:tag], text[tag + len("<|python_tag|>"):]
    elif text.lstrip().startswith("{"):
        content, action = "", text
    else:
        return ParsedTurn(content=text)
    found = _Calls(tools, id_prefix)
    values, complete = _json_values(action, ";")
    for value in values:
        found.add_object(value, "parameters", "arguments")
    found.malformed += not complete
    return found.turn(content)


_MISTRAL_COMPACT = re.compile(r"\s*([\w.-]+)\[ARGS\](.*)", re.DOTALL)


def parse_mistral(text: str, tools: Iterable[str] | None = None, *, id_prefix: str = "call") -> ParsedTurn:
    """Mistral calls: ``[TOOL_CALLS]`` then a JSON list, or ``[TOOL_CALLS]NAME[ARGS]{...}`` per call."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedTurn(content=text)
    found = _Calls(tools, id_prefix)
    for part in text[start:].split("[TOOL_CALLS]")[1:]:
        compact = _MISTRAL_COMPACT.match(part)
        if compact:
            values, complete = _json_values(compact.group(2))
            if complete and len(values) == 1:
                found.add(compact.group(1), values[0])
            else:
                found.malformed += 1
            continue
        values, complete = _json_values(part)
        if not complete or len(values) != 1 or not isinstance(values[0], list):
            found.malformed += 1
            continue
        for obj in values[0]:
            found.add_object(obj, "arguments", "parameters")
    return found.turn(text[:start])


_GLM_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # a string argument is written bare


def parse_glm45(text: str, tools: Iterable[str] | None = None, *, id_prefix: str = "call") -> ParsedTurn:
    """GLM-4 calls: ``<tool_call>NAME`` then ``<arg_key>``/``<arg_value>`` pairs, ``</tool_call>``."""
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(content=text)
    found = _Calls(tools, id_prefix)
    for block in _GLM_CALL.findall(text, start):
        head, _, _ = block.partition("<arg_key>")
        name = head.strip()
        args_text = block[len(head):]
        pairs = _GLM_ARG.findall(args_text)
        # every <arg_key> must have its value; a name is one token of text
        if not name or any(c.isspace() for c in name) or len(pairs) != args_text.count("<arg_key>"):
            found.malformed += 1
            continue
        found.add(name, {k.strip(): _glm_value(v) for k, v in pairs})
    found.malformed += text.count("<tool_call>", start) - text.count("</tool_call>", start)
    return found.turn(text[:start])


def no_tool_calls(text: str, tools: Iterable[str] | None = None, *, id_prefix: str = "call") -> ParsedTurn:
    """Families without a tool-call format: the whole text is content."""
    return ParsedTurn(content=text)


PARSERS: dict[str, Callable[..., ParsedTurn]] = {"qwen25": parse_qwen25, "llama3": parse_llama3,
                                                  "mistral": parse_mistral, "glm45": parse_glm45,
                                                  "none": no_tool_calls}

def parser_for(name: str) -> Callable[..., ParsedTurn]:
    """The parser called ``name`` (a key of :data:`PARSERS`)."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"expected a tool-call parser among {sorted(PARSERS)}, got {name!r}") from None
