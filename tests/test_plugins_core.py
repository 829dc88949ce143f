"""The plugin core: documented hookspecs, built-ins loaded from the entry-point group like any plugin, name
clashes reported with both plugins named, and every shipped site loading and validating."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy
import pytest

from milehpc import hookspecs, plugins
from milehpc.config.load import load_site, read_toml, site_data
from milehpc.config.schema import build
from milehpc.config.site import Site, expand_partitions
from milehpc.errors import ConfigError, PluginError
from milehpc.hookspecs import hookimpl
from milehpc.plugin_types import KINDS, SiteConfig, load_ref

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


# ---- hookspec examples resolve -------------------------------------------------------------------------

HOOK_KINDS = {hook: kind for kind, (hook, _) in KINDS.items()}
# Kinds whose impl is a factory called with the rank's context: ``impl(ctx)``.
FACTORY_KINDS = ("engine", "trainer")


def hookspec_examples(module: types.ModuleType) -> dict[str, str]:
    """Hookspec name -> the code of its ``Example::`` block (dedented; "" if it has none)."""
    out = {}
    for name, func in vars(module).items():
        if not name.startswith("milehpc_") or getattr(func, f"{hookspecs.PROJECT}_spec", None) is None:
            continue
        lines = (inspect.getdoc(func) or "").splitlines()
        # The block after the "Example ...::" paragraph (which may run over several lines).
        first = next((i for i, line in enumerate(lines) if line.startswith("Example")), len(lines))
        start = next((i + 1 for i in range(first, len(lines)) if lines[i].rstrip().endswith("::")), len(lines))
        block = []
        for line in lines[start:]:
            if line.strip() and not line[:1].isspace():
                break  # back at the docstring's own indentation: the example ended
            block.append(line)
        out[name] = textwrap.dedent("\n".join(block)).strip("\n")
    return out


def _check_registration(hook: str, spec: Any) -> list[str]:
    """Problems of one registration an example yields: its impl must resolve to the right kind of thing, and a
    name that is already registered must be registered the same way (impl, known params, converter formats)."""
    kind = HOOK_KINDS[hook]
    where = f"{hook} example {type(spec).__name__}(name={spec.name!r})"
    if not isinstance(spec, KINDS[kind][1]):
        return [f"{where}: yields a {type(spec).__name__}, expected a {KINDS[kind][1].__name__}"]
    problems = []
    if kind == "site" and isinstance(spec.impl, str | Path):
        path = Path(spec.impl)
        if not path.is_file():
            return [f"{where}: impl {str(path)!r} is not a file"]
        try:
            build(Site, expand_partitions(read_toml(path), file=str(path)), file=str(path))
        except ConfigError as err:
            problems.append(f"{where}: site TOML does not validate: {err}")
    else:
        if not isinstance(spec.impl, str) or ":" not in spec.impl:
            return [f"{where}: impl {spec.impl!r} is not a 'module:attr' reference"]
        try:
            obj = spec.load()
        except (ImportError, AttributeError) as err:
            return [f"{where}: impl {spec.impl!r} does not resolve: {err.__class__.__name__}: {err}"]
        if not callable(obj):
            problems.append(f"{where}: impl {spec.impl!r} is not callable")
        elif kind in FACTORY_KINDS:
            try:
                inspect.signature(obj).bind(object())
            except TypeError:
                problems.append(f"{where}: impl {spec.impl!r} is not a factory impl(ctx): {inspect.signature(obj)}")
    if kind == "trainer" and isinstance(spec.can_reshard, str):
        try:
            if not callable(load_ref(spec.can_reshard)):
                problems.append(f"{where}: can_reshard {spec.can_reshard!r} is not callable")
        except (ImportError, AttributeError) as err:
            problems.append(f"{where}: can_reshard {spec.can_reshard!r} does not resolve: {err}")
    known = plugins.registry(kind).get(spec.name)
    if known is not None:
        reg = known.spec
        if str(reg.impl) != str(spec.impl):
            problems.append(f"{where}: impl {spec.impl!r}, but {spec.name!r} is registered with {reg.impl!r}")
        if not set(spec.defaults) <= set(reg.defaults):
            problems.append(f"{where}: params {sorted(set(spec.defaults) - set(reg.defaults))} are not params of "
                            f"the registered {spec.name!r} ({sorted(reg.defaults)})")
        if kind == "trainer" and str(spec.can_reshard) != str(reg.can_reshard):
            problems.append(f"{where}: can_reshard {spec.can_reshard!r}, the registered {spec.name!r} has "
                            f"{reg.can_reshard!r}")
        if kind == "converter" and (spec.source, spec.target) != (reg.source, reg.target):
            problems.append(f"{where}: converts {spec.source}->{spec.target}, the registered {spec.name!r} "
                            f"converts {reg.source}->{reg.target}")
    if kind == "task" and spec.reward not in plugins.registry("reward"):
        problems.append(f"{where}: reward {spec.reward!r} is not a registered reward")
    return problems


def broken_hookspec_examples(module: types.ModuleType) -> list[str]:
    """Run every hookspec's example (a hookimpl) and check what it registers or answers resolves; one line per
    problem."""
    problems = []
    for hook, code in hookspec_examples(module).items():
        namespace: dict[str, Any] = {"hookimpl": hookimpl, "Path": Path,
                                     **{cls.__name__: cls for _, cls in KINDS.values()}}
        try:
            exec(compile(code, f"<{hook} example>", "exec"), namespace)
        except Exception as err:  # any failure of the example is the finding
            problems.append(f"{hook} example does not run: {err.__class__.__name__}: {err}")
            continue
        impl = namespace.get(hook)
        if not callable(impl):
            problems.append(f"{hook} example defines no function {hook}")
            continue
        if hook in HOOK_KINDS:
            try:
                specs = list(impl())
            except Exception as err:
                problems.append(f"{hook} example fails when called: {err.__class__.__name__}: {err}")
                continue
            if not specs:
                problems.append(f"{hook} example registers nothing")
            for spec in specs:
                problems += _check_registration(hook, spec)
        elif hook == "milehpc_detect_site":
            # Every site name it can answer is a registered site.
            sites = plugins.registry("site")
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) \
                        and node.value.value is not None and node.value.value not in sites:
                    problems.append(f"{hook} example answers {node.value.value!r}, which is not a registered site")
            if impl("no-such-host", {}) is not None:
                problems.append(f"{hook} example answers for any machine")
    return problems


def test_every_hookspec_example_registers_real_targets(monkeypatch) -> None:
    """Each example is a hookimpl that runs; what it registers resolves (module imports, attribute exists, of the
    right kind; a site's TOML exists and validates) and matches the registration of the same name, if any.
    Third-party examples are the example plugins in plugins/ (importable from their source if not installed)."""
    for src in sorted(REPO.glob("plugins/*/src")):
        monkeypatch.syspath_prepend(str(src))
    assert set(hookspec_examples(hookspecs)) == set(HOOK_KINDS) | {"milehpc_detect_site"}
    assert broken_hookspec_examples(hookspecs) == []


def test_the_example_check_catches_examples_that_do_not_resolve() -> None:
    spec = pluggy.HookspecMarker(hookspecs.PROJECT)
    fake = types.ModuleType("fake_hookspecs")

    def with_example(name: str, body: str):
        def hook():
            pass

        hook.__name__ = name
        hook.__doc__ = "Registers something.\n\nExample::\n\n" + textwrap.indent(textwrap.dedent(body), "    ")
        setattr(fake, name, spec(hook))

    with_example("milehpc_policy_losses", """
        @hookimpl
        def milehpc_policy_losses():
            yield PolicyLoss(name="mine", impl="milehpc.algorithms.losses:no_such_loss")
            yield PolicyLoss(name="ppo_clip", impl="milehpc.algorithms.losses:gspo", defaults={"nope": 1})
        """)
    with_example("milehpc_rollout_engines", """
        @hookimpl
        def milehpc_rollout_engines():
            yield RolloutEngine(name="sglang", impl="milehpc.rollout.sglang_engine:SGLangEngine")
            yield RolloutEngine(name="x", impl="no_such_module.engines:make")
        """)
    with_example("milehpc_sites", """
        @hookimpl
        def milehpc_sites():
            yield SiteConfig(name="mine", impl="/nonexistent/mine.toml")
        """)
    with_example("milehpc_weight_converters", """
        @hookimpl
        def milehpc_weight_converters():
            yield WeightConverter(name="megatron-to-hf", source="torch", target="hf",
                                  impl="milehpc.train.megatron.convert:megatron_to_hf")
        """)
    with_example("milehpc_tasks", """
        @hookimpl
        def milehpc_tasks():
            yield Trainer(name="sort", impl="milehpc.data.tasks:sort_task")
            yield Task(name="mine", impl="milehpc.data.tasks:sort_task", reward="sort_exact")
        """)
    with_example("milehpc_generators", "yield 1\n")
    with_example("milehpc_detect_site", """
        @hookimpl
        def milehpc_detect_site(hostname, environ):
            return "no-such-site"
        """)
    problems = broken_hookspec_examples(fake)
    text = "\n".join(problems)
    expected = [
        "PolicyLoss(name='mine'): impl 'milehpc.algorithms.losses:no_such_loss' does not resolve: AttributeError",
        "PolicyLoss(name='ppo_clip'): impl 'milehpc.algorithms.losses:gspo', but 'ppo_clip' is registered with",
        "params ['nope'] are not params of the registered 'ppo_clip'",
        "RolloutEngine(name='sglang'): impl 'milehpc.rollout.sglang_engine:SGLangEngine' is not a factory impl(ctx)",
        "RolloutEngine(name='sglang'): impl 'milehpc.rollout.sglang_engine:SGLangEngine', but 'sglang' is registered",
        "RolloutEngine(name='x'): impl 'no_such_module.engines:make' does not resolve: ModuleNotFoundError",
        "SiteConfig(name='mine'): impl '/nonexistent/mine.toml' is not a file",
        "converts torch->hf, the registered 'megatron-to-hf' converts megatron->hf",
        "milehpc_tasks example Trainer(name='sort'): yields a Trainer, expected a Task",
        "Task(name='mine'): reward 'sort_exact' is not a registered reward",
        "milehpc_generators example does not run: SyntaxError",
        "milehpc_detect_site example answers 'no-such-site', which is not a registered site",
        "milehpc_detect_site example answers for any machine",
    ]
    missing = [e for e in expected if e not in text]
    assert not missing, f"not reported: {missing}\nreported:\n{text}"
    assert len(problems) == len(expected), text


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
