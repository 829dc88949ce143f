"""The example rewards: a plain function and an ``async`` one (milehpc awaits those concurrently)."""

from __future__ import annotations

import asyncio

from milehpc.samples import Sample


def length_target(sample: Sample, *, target: int = 8, width: int = 8) -> float:
    """1.0 when the response has exactly ``target`` tokens, falling linearly to 0 at ``width`` tokens away."""
    if width <= 0:
        raise ValueError("width must be > 0")
    return max(0.0, 1.0 - abs(len(sample.response_ids) - target) / width)


async def keyword_async(sample: Sample, *, keyword: str = "", bonus: float = 1.0) -> dict[str, float]:
    """``bonus`` if the response text contains ``keyword`` (an async reward, e.g. a call to a judge service)."""
    await asyncio.sleep(0)  # stands in for network I/O
    hit = bool(keyword) and keyword in sample.response_text
    return {"score": bonus if hit else 0.0, "keyword_hit": float(hit)}
