"""Multi-LoRA prompts (``[trainer.lora.adapters.NAME]``): each adapter draws from its own source, and one stream
interleaves them so that every step of ``rollout.prompts_per_step`` prompts holds each adapter's share.

The mix is a pure function of the position, like :class:`~milehpc.data.source.PromptSource`: position ``p`` is slot
``p % T`` of cycle ``p // T`` (``T`` = the prompts of one step), each slot belongs to one adapter, and that adapter's
own stream gives its ``cycle * share + k``-th prompt (``k``: the slot's rank among the adapter's slots). So the
loop's one prompt cursor (checkpointed as it is) resumes every adapter's stream exactly. Every prompt carries its
adapter's name (``metadata["adapter"]``) and its mix position as its index, unique across adapters (the group id).

With several engines (engine ``e`` of ``E`` takes positions ``e, e + E, ...``) every step still holds each adapter's
share exactly when ``T`` is a multiple of ``E`` (the job rules ask for it); over-sampling and the dynamic filter
draw more prompts than a step's, so their steps hold the shares only on average.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from milehpc.data.source import Prompt, PromptSource
from milehpc.samples import ADAPTER_KEY

if TYPE_CHECKING:
    from milehpc.config.job import JobSpec


class AdapterMix:
    """The adapters' prompt streams interleaved per step (see the module docstring)."""

    def __init__(self, sources: dict[str, PromptSource], shares: dict[str, int]) -> None:
        self.sources, self.shares = sources, shares
        self.slots = [(name, k) for name, share in shares.items() for k in range(share)]  # one step's slots
        self.cursor = 0  # SFT warm-up: take() advances it
        self.summary = "\n".join(s.summary for s in sources.values() if s.summary)
        self.data_sources = {d for s in sources.values() for d in s.data_sources}

    def locate(self, position: int) -> tuple[str, int]:
        """Mix position -> (adapter, position in that adapter's own stream)."""
        cycle, slot = divmod(position, len(self.slots))
        name, k = self.slots[slot]
        return name, cycle * self.shares[name] + k

    def peek(self, position: int) -> Prompt:
        name, inner = self.locate(position)
        prompt = self.sources[name].peek(inner)
        prompt.index = position
        prompt.metadata[ADAPTER_KEY] = name
        return prompt

    def take(self, k: int) -> list[Prompt]:
        out = [self.peek(self.cursor + i) for i in range(k)]
        self.cursor += k
        return out


def adapter_mix(job: JobSpec, tokenizer: Any, *, seed_offset: int = 0, file: str | None = None) -> AdapterMix:
    """The job's adapters' sources (each as ``[data]`` with the adapter's ``source`` and ``params``; the i-th in name
    order seeded ``data.seed + i``), mixed by their shares of ``rollout.prompts_per_step``."""
    from milehpc.config.job import adapter_prompts
    from milehpc.data.source import build_source

    spec = job.trainer.lora
    assert spec is not None and spec.adapters
    sources = {name: build_source(replace(job.data, source=a.source, params=dict(a.params)), tokenizer,
                                  seed_offset=seed_offset + i, file=file)
               for i, (name, a) in enumerate(spec.adapters.items())}
    return AdapterMix(sources, adapter_prompts(spec, job.rollout.prompts_per_step))


class AdapterValidation:
    """Multi-LoRA's held-out prompts: each adapter's ``val_source`` (at most ``max_prompts`` of it; 0 = all), one after
    the other in name order, every prompt carrying its adapter's name and its position here as its index. The
    :class:`~milehpc.rollout.evaluate.Evaluator` reads it like a validation source."""

    def __init__(self, sources: dict[str, PromptSource], max_prompts: int = 0) -> None:
        self.sources = sources
        counts = {n: min(len(src.examples), max_prompts) if max_prompts else len(src.examples)
                  for n, src in sources.items()}
        self.examples = [(name, i) for name, n in counts.items() for i in range(n)]
        ends = list(accumulate(counts.values()))
        self.spans = [range(end - n, end) for n, end in zip(counts.values(), ends, strict=True)]  # each adapter's
        self.name = ", ".join(f"{n}: {s.name}" for n, s in sources.items())
        self.data_sources = {d for s in sources.values() for d in s.data_sources}

    def peek(self, position: int) -> Prompt:
        name, inner = self.examples[position]
        prompt = self.sources[name].peek(inner)
        prompt.index = position
        prompt.metadata[ADAPTER_KEY] = name
        return prompt


def adapter_validation(job: JobSpec, tokenizer: Any, *, max_prompts: int = 0, seed_offset: int = 0,
                       file: str | None = None) -> AdapterValidation:
    """The validation prompts of the adapters that name a ``val_source`` (each read as ``data.val_source`` with the
    adapter's ``params``; the i-th in name order seeded ``data.seed + i``, as its training stream)."""
    from milehpc.data.source import build_source

    spec = job.trainer.lora
    assert spec is not None and spec.adapters
    sources = {name: build_source(replace(job.data, val_source=a.val_source, params=dict(a.params)), tokenizer,
                                  seed_offset=seed_offset + i, file=file, split="validation")
               for i, (name, a) in enumerate(spec.adapters.items()) if a.val_source}
    return AdapterValidation(sources, max_prompts)
