"""Toy tasks generated in code (no downloads) and their rewards.

Each task is an indexable, deterministic sequence of examples ``{"prompt", "label", "metadata"}``: example ``i``
depends only on ``(seed, i)``, so every rank that builds the same task sees the same prompts without talking.
Prompts end in ``=``; the answer is the label followed by EOS.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

Example = dict[str, Any]


class GeneratedTask(Sequence[Example]):
    """``size`` examples made on demand by ``make(rng) -> (prompt, label)``."""

    def __init__(self, name: str, make: Callable[[random.Random], tuple[str, str]], seed: int, size: int) -> None:
        self.name, self.make, self.seed, self.size = name, make, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Example:  # type: ignore[override]
        if not -self.size <= i < self.size:
            raise IndexError(i)
        i %= self.size
        # A per-example RNG keyed by (task, seed, index): stable across processes and Python versions.
        rng = random.Random(f"{self.name}:{self.seed}:{i}")
        prompt, label = self.make(rng)
        return {"prompt": prompt, "label": label, "metadata": {"task": self.name, "index": i}}


def _digits(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))


def sort_task(seed: int = 0, min_len: int = 4, max_len: int = 5, size: int = 1_000_000) -> GeneratedTask:
    """``sort:31452=`` → ``12345``."""
    def make(rng: random.Random) -> tuple[str, str]:
        s = _digits(rng, min_len, max_len)
        return f"sort:{s}=", "".join(sorted(s))

    return GeneratedTask("sort", make, seed, size)


def reverse_task(seed: int = 0, min_len: int = 4, max_len: int = 5, size: int = 1_000_000) -> GeneratedTask:
    """``rev:31452=`` → ``25413``."""
    def make(rng: random.Random) -> tuple[str, str]:
        s = _digits(rng, min_len, max_len)
        return f"rev:{s}=", s[::-1]

    return GeneratedTask("reverse", make, seed, size)


def addition_task(seed: int = 0, digits: int = 2, size: int = 1_000_000) -> GeneratedTask:
    """``add:12+34=`` → ``46``."""
    def make(rng: random.Random) -> tuple[str, str]:
        a, b = (rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits) for _ in range(2))
        return f"add:{a}+{b}=", str(a + b)

    return GeneratedTask("addition", make, seed, size)


def match_score(response: str, label: str, partial: float = 0.0) -> float:
    """1.0 for an exact answer; otherwise ``partial`` × the fraction of positions that are right (the length of
    the longer string is the denominator, so padding or truncating an answer is not rewarded)."""
    response, label = response.strip(), str(label).strip()
    if response == label:
        return 1.0
    if partial <= 0.0 or not label:
        return 0.0
    right = sum(a == b for a, b in zip(response, label, strict=False))
    return partial * right / max(len(response), len(label))


def toy_match(sample: Any, partial: float = 0.0) -> float:
    """The toy tasks' reward (a ``sample`` reward plugin): exact match, with optional partial credit."""
    return match_score(sample.response_text, sample.label, partial)


def toy_permutation(sample: Any) -> float:
    """1.0 when the response uses exactly the label's characters, in any order (a ``sample`` reward plugin): the
    cheap verifiable half of sort/reverse, e.g. the gate of a reward model that then only judges the order."""
    return float(sorted(sample.response_text.strip()) == sorted(str(sample.label).strip()))
