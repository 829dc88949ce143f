"""Token-in/token-out recording of one agent episode served through the OpenAI endpoint.

The first request's messages are rendered with the tokenizer's chat template and tokenised once; after that the
episode's tokens are only ever appended to: the engine's own response ids (loss mask 1, its logprobs) and, for
the messages the agent adds after a reply (tool results, user turns), the template's rendering of just those
messages (loss mask 0, logprob 0). The history is never re-tokenised, so the trainer sees exactly the tokens the
policy produced.

A request whose messages do not start with the recorded conversation (the agent dropped, edited or summarised a
turn, or changed its tools) *diverges*: the recorded tokens no longer spell what the agent sent. It is counted and,
per ``on_divergence``, the episode is dropped (its samples are not trained on) or split (the recorded part becomes
its own sample and a new one starts from the request's messages).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from milehpc.samples import Sample, Status

_MARK = "\u2063milehpc-probe\u2063"  # text no real message contains: where the template puts a message's content


class Divergence(Exception):
    """The request's messages do not extend the episode's recorded conversation."""


def _text(content: Any) -> str:
    """Message content as text: None -> "", OpenAI content parts -> their texts joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def normalize(message: Any) -> dict[str, Any]:
    """The parts of a chat message that the template renders, in a form that compares equal when the agent sends
    back what the endpoint returned (pydantic objects, None vs "" content, arguments as string or object)."""
    m = message.model_dump() if hasattr(message, "model_dump") else dict(message)
    out: dict[str, Any] = {"role": m.get("role"), "content": _text(m.get("content"))}
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [(c["function"]["name"], _args(c["function"].get("arguments"))) for c in calls]
    for key in ("tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts for ``apply_chat_template`` (tool-call arguments as objects, as HF templates
    expect)."""
    out = []
    for message in messages:
        m = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        m["content"] = _text(m.get("content"))
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                "function": {"name": c["function"]["name"],
                                             "arguments": _args(c["function"].get("arguments"))}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


class ChatRenderer:
    """Token ids of a conversation's start, and of messages appended after an assistant reply, by the chat
    template of ``tokenizer`` (milehpc's :class:`~milehpc.data.tokenizer.HFTokenizer`)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "has_chat_template", False):
            raise ValueError("the chat endpoint needs a tokenizer with a chat template (model.tokenizer)")
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.tok.decode([tokenizer.eos_id])
        # What the template writes after an assistant message's content (ChatML: "<|im_end|>\n"): the engine
        # stops at the EOS token, the rest of it belongs to the next turn's environment tokens.
        probe = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}], gen=False)
        self.close = probe[probe.rindex(_MARK) + len(_MARK):]

    def render(self, messages: list[Any], tools: list[Any] | None = None, *, gen: bool = True) -> str:
        kwargs = {"tools": tools} if tools else {}
        return str(self.tokenizer.tok.apply_chat_template(template_messages(messages), add_generation_prompt=gen,
                                                          tokenize=False, **kwargs))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))  # the template carries its own specials: add none

    def start(self, messages: list[Any], tools: list[Any] | None = None) -> list[int]:
        """The first request: the whole conversation, with the assistant turn opened."""
        return self.encode(self.render(messages, tools))

    def extension(self, added: list[Any], tools: list[Any] | None, *, ended_with_eos: bool) -> list[int]:
        """The tokens that follow the engine's last reply when the agent appends ``added``: the rest of the
        reply's closing text, ``added`` as the template renders it after an assistant turn, the next turn opened."""
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        head, full = self.render(base, tools, gen=False), self.render(base + list(added), tools)
        if not full.startswith(head):
            raise Divergence("the chat template does not render the added messages as a continuation")
        close = self.close
        if ended_with_eos and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]
        return self.encode(close + full[len(head):])


@dataclass
class Episode:
    """The recorded calls of one episode (see the module docstring)."""

    id: str
    on_divergence: str = "drop"  # "drop" | "split"
    sample: Sample | None = None  # the segment being recorded
    segments: list[Sample] = field(default_factory=list)  # closed by a split
    messages: list[dict[str, Any]] = field(default_factory=list)  # normalised, incl. the last reply
    tools: list[Any] | None = None
    ended_with_eos: bool = False
    divergences: int = 0
    dropped: bool = False
    calls: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    busy: bool = False

    def context(self, messages: list[Any], tools: list[Any] | None, renderer: ChatRenderer) -> list[int]:
        """Token ids the next call continues. Appends the environment tokens of the messages added since the
        last reply; raises :class:`Divergence` (after counting it) when the episode is dropped."""
        if self.dropped:
            raise Divergence(f"episode {self.id} was dropped after its history diverged")
        norm = [normalize(m) for m in messages]
        if self.sample is not None:
            k = len(self.messages)
            # Nothing added (len(norm) == k) is an extension too: the agent asks for another reply after the last
            # one (e.g. after a reply without the tool call it wanted): the next assistant turn is opened.
            if norm[:k] == self.messages and tools == self.tools:
                try:
                    added = renderer.extension(messages[k:], tools, ended_with_eos=self.ended_with_eos)
                except Divergence:
                    added = None
                if added is not None:
                    s = self.sample
                    s.response_ids += added
                    s.loss_mask += [0] * len(added)
                    s.rollout_logprobs += [0.0] * len(added)
                    self.messages = norm
                    return s.prompt_ids + s.response_ids
            self.divergences += 1
            if self.on_divergence != "split":
                self.dropped = True
                raise Divergence(f"episode {self.id}: the request's messages do not extend its recorded history "
                                 f"(dropped: rollout.generator_params.on_divergence = 'drop')")
            self.segments.append(self.sample)
        self.sample = Sample(prompt_ids=renderer.start(messages, tools))
        self.messages, self.tools = norm, tools
        return list(self.sample.prompt_ids)

    def record(self, reply: Sample, version: int, message: dict[str, Any], *, eos_id: int) -> None:
        """Append the engine's reply (its ids, logprobs, stop status) and the assistant message returned."""
        s = self.sample
        assert s is not None
        if not s.response_ids:
            s.weight_version = version
        s.response_ids += reply.response_ids
        s.rollout_logprobs += reply.rollout_logprobs
        s.loss_mask += [1] * len(reply.response_ids)
        s.status = reply.status
        s.metadata.setdefault("versions", []).append(version)
        self.ended_with_eos = bool(reply.response_ids) and reply.response_ids[-1] == eos_id
        self.messages.append(normalize(message))
        self.calls += 1

    def samples(self) -> list[Sample]:
        """The recorded segments; a dropped episode's are FAILED (kept for the counts, never trained on)."""
        out = [*self.segments, *([self.sample] if self.sample is not None else [])]
        for s in out:
            s.metadata.update({"agent_calls": self.calls, "agent_divergences": self.divergences,
                               "tool_calls": self.tool_calls, "malformed_tool_calls": self.malformed_tool_calls})
            if self.dropped:
                s.status = Status.FAILED
                s.metadata["agent_dropped"] = "diverged"
        return out
