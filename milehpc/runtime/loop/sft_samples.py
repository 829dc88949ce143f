"""The supervised warm-up's samples: a prompt and the response its label demonstrates.

A text label is one reply: all of it is trained on, then EOS. A label that is a list of chat messages is a
multi-turn demonstration continuing the prompt's messages (an assistant tool call, the tool's result, the final
answer, ...). Only the assistant turns are trained on (their text up to and including EOS); the other messages
(tool results, user turns) and the template's text between turns are in the sample with loss mask 0, exactly as RL
masks the environment's tokens of an agent episode (:mod:`milehpc.rollout.agent_episode`). Without the mask the
warm-up would teach the policy to write the tool's output itself.

The pieces are tokenised the way an episode's are recorded: the prompt, each assistant turn, and the masked text
between two turns, each encoded on its own.
"""

from __future__ import annotations

from typing import Any

from milehpc.errors import ConfigError
from milehpc.samples import Sample


def _after(head: str, full: str, what: str) -> str:
    if not full.startswith(head):
        raise ValueError(f"the chat template does not render {what} as a continuation of the conversation before it")
    return full[len(head):]


def multi_turn_response(tokenizer: Any, prompt: list[dict[str, Any]], label: list[dict[str, Any]]
                        ) -> tuple[str, list[int], list[int]]:
    """(the prompt as the template renders it, response ids, loss mask) of a multi-turn demonstration ``label``
    continuing the chat ``prompt``: assistant turns through EOS trained on, everything else masked.
    Raises ValueError for a label the template cannot render turn by turn."""
    from milehpc.rollout.agent_episode import ChatRenderer

    if not label or not all(isinstance(m, dict) and m.get("role") for m in label):
        raise ValueError("expected a list of chat messages, each with a 'role'")
    if label[-1]["role"] != "assistant":
        raise ValueError(f"expected the demonstration to end with an assistant turn, got {label[-1]['role']!r}")
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError("expected a tokenizer with a chat template (model.tokenizer) to render it")
    renderer = ChatRenderer(tokenizer)
    conv = list(prompt)
    start = shown = renderer.render(conv)
    pieces: list[tuple[str, int]] = []  # (text, trained); the masked text between two turns is one piece
    masked, done = "", 0  # done: the label messages already in conv
    for i, message in enumerate(label):
        if message["role"] != "assistant":
            continue
        opened = renderer.render(conv + label[done:i])  # the messages since the last turn, the assistant's opened
        masked += _after(shown, opened, f"label message {done + 1}")
        conv += label[done:i + 1]
        done = i + 1
        shown = renderer.render(conv, gen=False)
        turn = _after(opened, shown, f"label message {i + 1}")
        # The engine stops at EOS: the template's text after it (ChatML's newline) belongs to the next turn's glue.
        end = turn.find(renderer.eos_text)
        end = len(turn) if end < 0 else end + len(renderer.eos_text)
        if masked:
            pieces.append((masked, 0))
        pieces.append((turn[:end], 1))
        masked = turn[end:]
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        piece = renderer.encode(text)
        ids += piece
        mask += [trained] * len(piece)
    return start, ids, mask


def sft_sample(tokenizer: Any, prompt: Any, *, file: str | None = None, field: str = "data.label_key") -> Sample:
    """The warm-up sample of one drawn prompt (:class:`milehpc.data.source.Prompt`)."""
    label = prompt.label
    common = {"group": prompt.index, "index": prompt.index, "label": label, "prompt_text": prompt.text,
              "metadata": dict(prompt.metadata)}
    if not isinstance(label, list):
        return Sample(prompt_ids=prompt.ids, response_ids=[*tokenizer.encode(str(label)), tokenizer.eos_id], **common)
    where = f"the multi-turn label of prompt {prompt.index}"
    if not isinstance(prompt.raw, list):
        raise ConfigError(f"{where}: expected the prompt as chat messages (a list of {{role, content}}), got text",
                          file=file, field=field)
    try:
        text, ids, mask = multi_turn_response(tokenizer, prompt.raw, label)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}", file=file, field=field) from None
    if text != prompt.text:  # the prompt went through the tokenizer another way (images, a text prompt)
        raise ConfigError(f"{where}: expected the prompt rendered by the chat template alone", file=file, field=field)
    return Sample(prompt_ids=prompt.ids, response_ids=ids, loss_mask=mask, **common)
