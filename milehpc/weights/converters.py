"""Weight converters: a trainer's parameter names/layout to an engine's, looked up by (source, target) format
among the registered ``converter`` plugins (identity when the two formats agree)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from milehpc.errors import PluginError

if TYPE_CHECKING:
    import torch

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]
Converter = Callable[[NamedTensors], NamedTensors]


def identity(named_tensors: NamedTensors, **_: Any) -> NamedTensors:
    """The converter for a trainer and an engine that share names and layouts."""
    return named_tensors


def find_converter(source: str, target: str, params: Mapping[str, Any] | None = None) -> Converter:
    """The registered converter from ``source`` (trainer format) to ``target`` (engine format); identity if they agree."""
    from functools import partial

    from milehpc import plugins

    if source == target:
        return identity
    for name, entry in plugins.registry("converter").items():
        spec = entry.spec
        if getattr(spec, "source", "") == source and getattr(spec, "target", "") == target:
            plugins.check_requires(spec, f"converter '{name}'")
            return partial(spec.load(), **dict(params or {}))
    raise PluginError(f"no weight converter from '{source}' to '{target}' is registered "
                      f"(plugin kind 'converter', with source='{source}' and target='{target}')")
