"""The plugin core: documented hookspecs, built-ins loaded from the entry-point group like any plugin, name
clashes reported with both plugins named, and every shipped site loading and validating."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pluggy
import pytest

from milehpc import hookspecs, plugins
from milehpc.config.load import load_site, site_data
from milehpc.config.schema import build
from milehpc.config.site import Site
from milehpc.errors import ConfigError, PluginError
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import KINDS, SiteConfig

REPO = Path(__file__).resolve().parent.parent
SHIPPED_SITES = sorted(p.stem for p in (REPO / "site-configs").glob("*.toml"))
BUILTIN_MODULES = {
    "builtin-sites": "milehpc.builtin.sites",
    "builtin-containers": "milehpc.builtin.containers",
}


@pytest.fixture(autouse=True)
def fresh_plugin_manager():
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


# ---- hookspecs are documented ------------------------------------------------------------------------

def undocumented_hookspecs(module: types.ModuleType) -> list[str]:
    """Hookspecs of ``module`` without a docstring, or whose docstring has no example."""
    bad = []
    for name, func in vars(module).items():
        if not (name.startswith("milehpc_") and callable(func)):
            continue
        if getattr(func, f"{hookspecs.PROJECT}_spec", None) is None:
            continue
        doc = inspect.getdoc(func) or ""
        if not doc.strip() or "Example" not in doc:
            bad.append(name)
    return bad


def test_every_hookspec_has_a_docstring_with_an_example() -> None:
    names = [n for n in vars(hookspecs) if n.startswith("milehpc_")]
    assert len(names) >= 10
    assert undocumented_hookspecs(hookspecs) == []


def test_the_docstring_check_catches_an_undocumented_hookspec() -> None:
    """The check above is not vacuous: a hookspec module with an undocumented hook fails it."""
    spec = pluggy.HookspecMarker(hookspecs.PROJECT)
    fake = types.ModuleType("fake_hookspecs")

    @spec
    def milehpc_documented():
        """Does something.

        Example::

            yield 1
        """

    @spec
    def milehpc_undocumented():
        pass

    fake.milehpc_documented = milehpc_documented
    fake.milehpc_undocumented = milehpc_undocumented
    assert undocumented_hookspecs(fake) == ["milehpc_undocumented"]


def test_every_register_hook_has_a_kind() -> None:
    """Each register hook maps to a registry kind and back (only detect_site chooses instead of registering)."""
    specs = {n for n, f in vars(hookspecs).items()
             if n.startswith("milehpc_") and getattr(f, f"{hookspecs.PROJECT}_spec", None) is not None}
    assert {hook for hook, _ in KINDS.values()} == specs - {"milehpc_detect_site"}


# ---- built-ins come from the entry-point group -----------------------------------------------------------

def test_builtins_are_entry_points_of_the_milehpc_group() -> None:
    eps = {ep.name: ep for ep in metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)}
    for name, module in BUILTIN_MODULES.items():
        assert name in eps, f"{name} is not an entry point of group {plugins.ENTRY_POINT_GROUP!r}"
        assert eps[name].value == module
        assert eps[name].dist is not None and eps[name].dist.name == "milehpc"


def test_builtin_sites_are_registered_by_the_builtin_entry_point() -> None:
    entries = plugins.registry("site")
    for name in SHIPPED_SITES:
        assert entries[name].plugin == "builtin-sites"
        assert entries[name].distribution.startswith("milehpc ")


def test_without_entry_points_nothing_is_registered(monkeypatch) -> None:
    """No built-in is registered behind the plugin manager's back: without the entry points there are none."""
    monkeypatch.setenv("MILEHPC_NO_ENTRY_POINTS", "1")
    plugins.reset_plugin_manager()
    for kind in KINDS:
        assert plugins.registry(kind) == {}, kind


# ---- name clashes --------------------------------------------------------------------------------------

def _site_plugin(site_name: str):
    class Plugin:
        @hookimpl
        def milehpc_sites(self):
            yield SiteConfig(name=site_name, impl=str(REPO / "site-configs" / "local.toml"))

    return Plugin()


def test_two_plugins_registering_the_same_name_is_an_error_naming_both() -> None:
    plugins.register(_site_plugin("twin"), name="first-plugin")
    plugins.register(_site_plugin("twin"), name="second-plugin")
    with pytest.raises(PluginError) as err:
        plugins.registry("site")
    message = str(err.value)
    assert "twin" in message and "first-plugin" in message and "second-plugin" in message
    assert "\n" not in message


def test_a_plugin_cannot_shadow_a_builtin_site() -> None:
    plugins.register(_site_plugin("frontier-like"), name="impostor")
    with pytest.raises(PluginError, match="builtin-sites.*impostor|impostor.*builtin-sites"):
        plugins.lookup("site", "frontier-like")


def test_a_clash_is_a_one_line_cli_error() -> None:
    code = ("from milehpc import plugins\n"
            "from milehpc.hookspecs import hookimpl\n"
            "from milehpc.plugin_types import SiteConfig\n"
            "class P:\n"
            "    @hookimpl\n"
            "    def milehpc_sites(self):\n"
            "        yield SiteConfig(name='local', impl='x.toml')\n"
            "plugins.register(P(), name='clashing-plugin')\n"
            "from milehpc.cli import main\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code, "sites", "list"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "builtin-sites" in lines[0] and "clashing-plugin" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_plugin_yielding_the_wrong_type_is_named() -> None:
    class Wrong:
        @hookimpl
        def milehpc_sites(self):
            yield {"name": "dict-site"}

    plugins.register(Wrong(), name="wrong-type-plugin")
    with pytest.raises(PluginError, match="wrong-type-plugin"):
        plugins.registry("site")


def test_unknown_site_lists_the_known_ones() -> None:
    with pytest.raises(PluginError) as err:
        plugins.lookup("site", "nosuch", field="--site")
    assert all(name in str(err.value) for name in SHIPPED_SITES)


# ---- every shipped site loads and validates --------------------------------------------------------------

def test_the_five_sites_are_shipped() -> None:
    assert {"local", "local-slurm", "frontier-like", "perlmutter-like", "dgx-h100-like"} <= set(SHIPPED_SITES)


@pytest.mark.parametrize("name", SHIPPED_SITES)
def test_shipped_site_loads_and_validates(name: str) -> None:
    raw, origin = site_data(name)
    site = build(Site, raw, file=origin)
    assert site.name == name, "the site's name matches its file"
    assert site.docs and all(doc.startswith("https://") for doc in site.docs), "cites its public user guide"
    text = Path(origin).read_text(encoding="utf-8")
    assert text.count("https://") >= len(site.docs) + 1, "the guide is cited next to the values too"
    for part_name in site.partitions:
        _, part = load_site(name, _job_on(part_name))
        assert part.slots_per_node >= 1
        # Only the local site oversubscribes its cores on purpose.
        assert part.cpus_per_task * part.slots_per_node <= part.cpus_per_node or part.scheduler == "local", (
            f"{name}/{part_name}: ranks x cpus_per_task exceed the node's CPUs")


@pytest.mark.parametrize("name", SHIPPED_SITES)
def test_shipped_site_survives_its_json_round_trip(name: str) -> None:
    from milehpc.config.schema import to_dict

    site, _ = load_site(name)
    assert build(Site, to_dict(site), file="<round trip>") == site


def test_extends_inherits_and_overrides() -> None:
    site, part = load_site("frontier-like", _job_on("extended"))
    batch = site.partitions["batch"]
    assert part.access.partition == "extended" and part.max_nodes == 64 and part.time_limit == "24:00:00"
    assert part.env == batch.env and part.launcher == batch.launcher and part.containers == batch.containers
    assert part.access.core_spec == batch.access.core_spec == 8


def test_extends_errors_are_one_line() -> None:
    from milehpc.config.site import expand_partitions

    with pytest.raises(ConfigError, match=r"partitions.a.extends: expected one of the partitions"):
        expand_partitions({"partitions": {"a": {"extends": "zzz"}}}, file="f.toml")
    with pytest.raises(ConfigError, match=r"cycle of extends, got a -> b -> a"):
        expand_partitions({"partitions": {"a": {"extends": "b"}, "b": {"extends": "a"}}}, file="f.toml")


def _job_on(partition: str):
    from milehpc.config.load import job_from_dict

    return job_from_dict({"name": "t", "resources": {"partition": partition}})
