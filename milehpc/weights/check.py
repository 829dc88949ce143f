"""Checking that the engines hold the trainer's weights: compare named tensors (bit-exact or within a tolerance),
or run the comparison as a collective over a weight-sync group (the source sends, every rollout rank compares)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from milehpc.weights.broadcast import DEFAULT_BUCKET_BYTES, recv_weights_stream, send_weights
from milehpc.weights.converters import Converter, NamedTensors

if TYPE_CHECKING:
    import torch

    from milehpc.comm.world import WeightSyncGroup


@dataclass(frozen=True)
class Mismatch:
    name: str
    rank: int
    reason: str
    max_abs_diff: float = float("inf")


@dataclass
class WeightCheck:
    checked: int = 0
    skipped: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def worst(self) -> Mismatch | None:
        return max(self.mismatches, key=lambda m: m.max_abs_diff, default=None)

    def merge(self, other: WeightCheck) -> WeightCheck:
        return WeightCheck(self.checked + other.checked, self.skipped + other.skipped,
                           self.mismatches + other.mismatches)

    def summary(self) -> str:
        if self.ok:
            return f"weights equal: {self.checked} (tensor, rank) check(s), {self.skipped} skipped"
        w = self.worst
        assert w is not None
        unreadable = sum(m.reason == UNREADABLE for m in self.mismatches)
        return (f"weights differ: {len(self.mismatches)} of {self.checked} (tensor, rank) check(s)"
                + (f" ({unreadable} unreadable)" if unreadable else "")
                + f"; worst: {w.name} on rank {w.rank} ({w.reason})")


# The engine holds the name but could not read it back (e.g. SGLang's get_weights_by_name answered None).
UNREADABLE = ("unreadable on the rollout side: the engine could not read it back, so it is not shown to hold the "
              "trainer's value")


def compare_named_tensors(expected: NamedTensors,
                          actual: Mapping[str, torch.Tensor | None] | Iterable[tuple[str, torch.Tensor | None]], *,
                          rank: int = 0, atol: float = 0.0, rtol: float = 0.0,
                          skip: Sequence[str] = ()) -> WeightCheck:
    """Compare tensors by name: exact when ``atol == rtol == 0`` (bit-exact), else |a - b| <= atol + rtol * |b|.
    ``skip`` holds fnmatch patterns of names to leave out. Names missing on the actual side are mismatches, and so
    are names it gives as None (unreadable): a weight the check cannot see is not a weight it has checked."""
    import torch

    have = actual if isinstance(actual, Mapping) else dict(actual)
    result = WeightCheck()
    for name, want in expected:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in skip):
            result.skipped += 1
            continue
        result.checked += 1
        got = have.get(name)
        if got is None:
            result.mismatches.append(Mismatch(name, rank, UNREADABLE if name in have else "missing on the rollout side"))
            continue
        if tuple(got.shape) != tuple(want.shape):
            result.mismatches.append(Mismatch(name, rank, f"shape {tuple(got.shape)} != {tuple(want.shape)}"))
            continue
        want_c, got_c = want.detach().to(got.device), got.detach()
        if atol == 0 and rtol == 0:
            if got_c.dtype == want_c.dtype and torch.equal(got_c, want_c):
                continue
            if got_c.dtype != want_c.dtype:
                result.mismatches.append(Mismatch(name, rank, f"dtype {got_c.dtype} != {want_c.dtype}"))
                continue
        a, b = got_c.double(), want_c.double()
        diff = (a - b).abs()
        nan_mismatch = bool((a.isnan() != b.isnan()).any())
        bound = atol + rtol * b.abs()
        if nan_mismatch or bool((diff > bound).any()):
            worst = float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0
            result.mismatches.append(Mismatch(name, rank, f"max |diff| {worst:.3g} > atol {atol:g} + rtol {rtol:g}",
                                              worst))
    return result


def check_weight_update_equal(group: WeightSyncGroup, *, named_tensors: NamedTensors | None = None,
                              local: Mapping[str, torch.Tensor | None] | NamedTensors | None = None,
                              atol: float = 0.0, rtol: float = 0.0, skip: Sequence[str] = (),
                              converter: Converter | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                              timeout: float | None = None) -> WeightCheck:
    """Collective over ``group``: the source sends its tensors (``named_tensors``), every rollout rank compares them
    with its engine's (``local``, e.g. ``dict(engine.named_parameters())``). Every member gets the merged result
    (the worst mismatch over all ranks). Does not change the weight versions."""
    comms = group.comms
    if group.is_source:
        if named_tensors is None:
            raise ValueError("the source of check_weight_update_equal needs named_tensors")
        send_weights(group, named_tensors, group.version, bucket_bytes, converter=converter, kind="check",
                     timeout=timeout)
        mine = WeightCheck()
    else:
        if local is None:
            raise ValueError("a rollout rank of check_weight_update_equal needs local (its engine's tensors)")
        stream = recv_weights_stream(group, timeout)
        mine = compare_named_tensors(stream, local, rank=comms.rank, atol=atol, rtol=rtol, skip=skip)
        stream.drain()
    results = comms.gather(mine, group.source, group.ranks, what=f"weight check (stage {group.stage})",
                           timeout=timeout)
    merged = None
    if results is not None:
        merged = WeightCheck()
        for r in results[1:]:
            merged = merged.merge(r)
    return comms.bcast(merged, group.source, group.ranks, what=f"weight check (stage {group.stage})",
                       timeout=timeout)
