"""The plugin manager: milehpc's own built-ins and third-party plugins, all from the entry-point group
``milehpc`` (built-ins are registered exactly like external ones), plus a registry per kind."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import pluggy

from milehpc import hookspecs
from milehpc.errors import PluginError, did_you_mean, missing_dependency
from milehpc.plugin_types import KINDS, Registered

ENTRY_POINT_GROUP = "milehpc"


@dataclass(frozen=True)
class Entry:
    """One registered thing and where it came from."""

    spec: Registered
    plugin: str  # the plugin's registered name (entry-point name or module name)

    @property
    def distribution(self) -> str:
        """"name version" of the installing distribution, or "-" if registered in code."""
        return distributions().get(self.plugin, "-")


@lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager with every installed ``milehpc`` entry point loaded."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if not os.environ.get("MILEHPC_NO_ENTRY_POINTS"):
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm


def reset_plugin_manager() -> None:
    """Forget the cached manager and registries (tests that register plugins in code use this)."""
    get_plugin_manager.cache_clear()
    _registry.cache_clear()
    distributions.cache_clear()


def register(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object (a module or class with ``@hookimpl`` functions) in this process."""
    get_plugin_manager().register(plugin, name=name)
    _registry.cache_clear()
    distributions.cache_clear()


@lru_cache(maxsize=1)
def distributions() -> dict[str, str]:
    """Plugin name -> "distribution version" for plugins loaded from entry points (parsed only when asked:
    reading every distribution's metadata costs more than the rest of a dry run)."""
    pm = get_plugin_manager()
    out = {}
    for plugin, dist in pm.list_plugin_distinfo():
        out[pm.get_name(plugin)] = f"{dist.metadata['name']} {dist.version}"
    return out


@cache
def _registry(kind: str) -> dict[str, Entry]:
    hook_name, spec_type = KINDS[kind]
    pm = get_plugin_manager()
    entries: dict[str, Entry] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        plugin_name = impl.plugin_name
        for spec in impl.function() or ():
            if not isinstance(spec, spec_type):
                raise PluginError(
                    f"plugin '{plugin_name}' yielded {type(spec).__name__} from {hook_name}, expected {spec_type.__name__}"
                )
            if spec.name in entries:
                other = entries[spec.name].plugin
                raise PluginError(
                    f"{kind} '{spec.name}' is registered by two plugins: '{other}' and '{plugin_name}'"
                )
            entries[spec.name] = Entry(spec, plugin_name)
    return entries


def registry(kind: str) -> dict[str, Entry]:
    """Everything registered of one kind (``site``, ``reward``, ``advantage``, ...), by name."""
    if kind not in KINDS:
        raise KeyError(kind)
    return dict(_registry(kind))


def lookup(kind: str, name: str, *, file: str | None = None, field: str | None = None) -> Registered:
    """The registered ``name`` of ``kind``; a one-line error listing what exists when it is unknown."""
    entries = _registry(kind)
    if name not in entries:
        known = ", ".join(sorted(entries)) or "none installed"
        raise PluginError(f"unknown {kind} '{name}' (expected one of: {known}){did_you_mean(name, entries)}",
                          file=file, field=field)
    return entries[name].spec


def find_named(query: str) -> list[tuple[str, Entry]]:
    """Every registered ``(kind, entry)`` called ``query`` (``NAME`` of any kind, or ``KIND:NAME``); a one-line
    error when there is none."""
    kind, sep, name = query.rpartition(":")
    if sep and kind not in KINDS:
        raise PluginError(f"unknown plugin kind '{kind}' (expected one of: {', '.join(KINDS)})", field="NAME")
    kinds = [kind] if sep else list(KINDS)
    found = [(k, _registry(k)[name]) for k in kinds if name in _registry(k)]
    if not found:
        raise PluginError(f"no plugin named '{name}'{f' of kind {kind}' if sep else ''} (see `milehpc plugins`)",
                          field="NAME")
    return found


def check_requires(spec: Registered, what: str) -> None:
    """Fail with one clear line if an optional package the plugin needs is missing."""
    for module in spec.requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise missing_dependency(what, module.split(".")[0].replace("_", "-"))


def load(kind: str, name: str, *, file: str | None = None, field: str | None = None) -> Any:
    """Look up, check optional dependencies, and import the implementation."""
    spec = lookup(kind, name, file=file, field=field)
    check_requires(spec, f"{kind} '{name}'")
    return spec.load()


def detect_site(hostname: str, environ: dict[str, str]) -> str | None:
    """Ask the plugins which site this machine belongs to."""
    return get_plugin_manager().hook.milehpc_detect_site(hostname=hostname, environ=environ)
