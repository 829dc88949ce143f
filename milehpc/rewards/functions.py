"""Built-in reward functions. A sample reward is ``fn(sample, **params) -> float | dict`` and reads
``sample.response_text`` (the loop decodes it from the response ids) and ``sample.label``; a group reward
``fn(samples, **params) -> list`` sees every sample of one prompt.

A label may be a list of accepted answers: the best-scoring one counts.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from milehpc.rewards.extract import (
    cut_at,
    extract_answer,
    math_equal,
    normalize_math,
    normalize_text,
    parse_number,
)
from milehpc.samples import Sample


def _labels(label: Any) -> list[str]:
    if label is None:
        raise ValueError("this reward needs a label (the task's reference answer)")
    if isinstance(label, list | tuple):
        return [str(x) for x in label]
    return [str(label)]


def exact_match(sample: Sample, *, strip: bool = True, case_sensitive: bool = True,
                collapse_whitespace: bool = False, stop: str = "", extract: str = "none") -> float:
    """1.0 if the response (cut at ``stop``, the answer taken out by ``extract``: none | boxed | last_number |
    answer_tag | gsm8k | auto) equals the label after normalisation, else 0.0."""
    answer = extract_answer(cut_at(sample.response_text, stop), extract)
    if answer is None:
        return 0.0
    norm = dict(strip=strip, case_sensitive=case_sensitive, collapse_whitespace=collapse_whitespace)
    got = normalize_text(answer, **norm)
    return float(any(got == normalize_text(ref, **norm) for ref in _labels(sample.label)))


def position_match(sample: Sample, *, strip: bool = True, stop: str = "") -> float:
    """Partial credit: the fraction of positions where response and label agree character by character,
    over the longer of the two (so extra or missing characters cost); 1.0 only for an exact match."""
    got = cut_at(sample.response_text, stop)
    got = got.strip() if strip else got
    best = 0.0
    for ref in _labels(sample.label):
        ref = ref.strip() if strip else ref
        width = max(len(got), len(ref))
        if width == 0:
            return 1.0
        best = max(best, sum(a == b for a, b in zip(got, ref, strict=False)) / width)
    return best


def math_answer(sample: Sample, *, extract: str = "auto", tolerance: float = 1e-6, correct: float = 1.0,
                incorrect: float = 0.0, no_answer: float = 0.0) -> dict[str, float]:
    """Math answers: the response's answer (``extract``: auto = last \\boxed{}, else after ``####``, else the
    last number) against the label (its own \\boxed{} or ``####`` answer if it has one), equal as numbers
    within ``tolerance`` (fractions, decimals, thousands commas, LaTeX) or as normalised strings."""
    answer = extract_answer(sample.response_text, extract)
    if answer is None:
        return {"score": no_answer, "correct": 0.0, "has_answer": 0.0}
    refs = [extract_answer(ref, "auto") if ("\\boxed" in ref or "####" in ref) else ref
            for ref in _labels(sample.label)]
    ok = any(ref is not None and math_equal(answer, ref, tolerance) for ref in refs)
    return {"score": correct if ok else incorrect, "correct": float(ok), "has_answer": 1.0}


def format_reward(sample: Sample, *, pattern: str = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*",
                  mode: str = "fullmatch", score: float = 1.0, miss: float = 0.0) -> float:
    """``score`` if the response matches the regular expression ``pattern`` (``mode``: fullmatch | search;
    ``.`` matches newlines), else ``miss``. The default pattern asks for ``<think>..</think><answer>..</answer>``."""
    if mode not in ("fullmatch", "search"):
        raise ValueError(f"mode must be fullmatch or search, got {mode!r}")
    matcher = re.fullmatch if mode == "fullmatch" else re.search
    return score if matcher(pattern, sample.response_text, flags=re.S) else miss


def majority_vote(samples: Sequence[Sample], *, extract: str = "auto", math: bool = True) -> list[dict[str, float]]:
    """A group reward without labels (test-time RL): 1.0 for the samples whose answer agrees with the group's
    most common answer (ties: the one seen first), 0.0 otherwise and for samples without an answer. The
    majority's share of the group is reported as ``agreement``."""
    keys = [_vote_key(extract_answer(s.response_text, extract), math) for s in samples]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return [{"score": 0.0, "agreement": 0.0} for _ in samples]
    top = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == top)
    return [{"score": float(k == winner), "agreement": top / len(samples)} for k in keys]


def _vote_key(answer: str | None, math: bool) -> tuple[str, Any] | None:
    """Answers that are the same number (``2``, ``2.0``, ``\\frac{4}{2}``) vote together."""
    if answer is None:
        return None
    if not math:
        return ("text", answer.strip())
    number = parse_number(answer)
    return ("number", float(number)) if number is not None else ("text", normalize_math(answer))
