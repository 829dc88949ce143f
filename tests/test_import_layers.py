"""The package's import structure, read from the source with ``ast`` (nothing is imported): no import cycle
between modules, no import from a lower layer to a higher one, no import between peer packages of one layer,
every module placed in a layer, and no oversized file in the packages that were split for size.

Every import counts: top-level, lazy imports inside functions, and ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "milehpc"
REPO = Path(__file__).resolve().parent.parent
# MILEHPC_LAYERS_ROOT points the real-package test at another copy of the package (a scratch copy with a
# deliberate upward import or cycle, to watch the test fail).
ROOT = Path(os.environ.get("MILEHPC_LAYERS_ROOT") or REPO / PACKAGE)

# The layers, lowest first. Each is a tuple of module prefixes relative to the package ("config" covers
# milehpc/config/ and everything under it; "train.megatron" would be more specific than "train" and win).
# A module may import modules of its own top package freely, and modules of LOWER layers; never a higher
# layer, and never another package of its own layer (peers stay independent). The package's own
# ``__init__`` is "__init__". A module no prefix covers is an error: a new module must be placed here.
LAYERS: list[tuple[str, ...]] = [
    ("__init__",),      # __version__ only
    ("errors",),        # user-facing errors
    ("faults",),        # test-only fault injection (MILEHPC_FAULT)
    ("hygiene",),       # secrets, private dirs, storage errors (stdlib only)
    ("resources",),     # shipped data files
    ("plugin_types",),  # the dataclasses plugins yield
    ("hookspecs",),     # every hook
    ("plugins",),       # the plugin manager and registries
    ("samples",),       # Sample / Batch / HDF5 codec / rollout dumps: the records every layer shares
    ("config",),        # JobSpec, Site, loading, validation
    ("sandbox",),       # running untrusted programs under limits (code rewards, tool environments)
    ("builtin",),       # built-in registrations (engines.py reads config.job's loop option defaults)
    ("plan",),          # rank layout (pure)
    ("memory",),        # per-rank memory estimate of a plan (pure)
    ("render",),        # sbatch + Apptainer rendering
    ("checkpoint",),    # login-safe checkpoint library
    ("scheduler",),     # slurm client, submit, sweeps, local launcher
    ("doctor",),        # site checks
    ("models_vl",),     # vision-language model inputs (pixels come from the caller: no data import)
    ("data", "algorithms", "rewards", "models"),  # peers: prompts, RL maths, rewards, the HF model builder
    ("comm",),          # MPI world, torch.distributed groups, devices, watchdog
    ("rollout",),       # engines
    ("train",),         # trainers
    ("export",),        # a run's checkpoint as an HF / peft folder, offline (milehpc export)
    ("weights",),       # weight transport trainer -> rollout
    ("runtime",),       # inside the job: launch, loop
    ("cli",),           # click commands
    ("__main__",),      # python -m milehpc
]

# Files in these folders were split for size; keep them split.
SIZE_LIMITED = ("runtime/loop", "checkpoint")
MAX_LINES = 400


@dataclass
class Module:
    name: str  # dotted, e.g. "milehpc.config.load"; a package is named by its folder
    path: Path
    is_package: bool
    imports: list[tuple[str, str | None, int]] = field(default_factory=list)  # (module, name or None, line)


def discover(root: Path) -> dict[str, Module]:
    """Every module of the package whose folder is ``root`` (its name is root's folder name)."""
    pkg = root.name
    modules = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [pkg, *rel.parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    return modules


def _collect(mod: Module) -> list[str]:
    """Fill ``mod.imports`` with every import statement anywhere in the file (absolute names)."""
    try:
        tree = ast.parse(mod.path.read_text(), filename=str(mod.path))
    except SyntaxError as exc:
        return [f"{mod.path}: cannot parse: {exc}"]
    here = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                mod.imports.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                mod.imports.append((target, alias.name, node.lineno))
    return []


def _reexports(modules: dict[str, Module]) -> dict[tuple[str, str], str]:
    """(package, name) -> the package's own submodule the package's ``__init__`` imports that name from."""
    out = {}
    for mod in modules.values():
        if not mod.is_package:
            continue
        for target, name, _ in mod.imports:
            if name and name != "*" and target.startswith(mod.name + ".") and target in modules:
                out[(mod.name, name)] = target
    return out


def _resolve(target: str, name: str | None, modules: dict[str, Module],
             reexports: dict[tuple[str, str], str]) -> str | None:
    """The module an import statement depends on; None if it does not exist in the package."""
    if name is not None and name != "*":
        if f"{target}.{name}" in modules:  # from pkg import submodule
            return f"{target}.{name}"
        seen = set()
        while (target, name) in reexports and (target, name) not in seen:  # a name re-exported by a package
            seen.add((target, name))
            target = reexports[(target, name)]
    return target if target in modules else None


def layer_of(module: str, layers: list[tuple[str, ...]], pkg: str = PACKAGE) -> tuple[int, str] | None:
    """(layer index, matched prefix) for a module; the longest matching prefix wins; None if unplaced."""
    rel = module[len(pkg) + 1:] if module != pkg else "__init__"
    best = None
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            covers = rel == prefix or rel.startswith(prefix + ".")
            if covers and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    return best


def _top(module: str, pkg: str) -> str:
    return "__init__" if module == pkg else module.split(".")[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def _at(path: Path, lines: list[int]) -> str:
    return f"{path}:{','.join(str(n) for n in sorted(set(lines)))}"


def check_imports(root: Path, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """Every import-structure problem of the package in folder ``root``, one line each (empty: all good)."""
    pkg = root.name
    modules = discover(root)
    problems: list[str] = []
    for mod in modules.values():
        problems += _collect(mod)
    reexports = _reexports(modules)

    graph: dict[str, set[str]] = {name: set() for name in modules}
    where: dict[tuple[str, str], tuple[Path, list[int]]] = {}  # (importer, imported) -> file, lines
    for mod in modules.values():
        for target, name, line in mod.imports:
            if target != pkg and not target.startswith(pkg + "."):
                continue
            dep = _resolve(target, name, modules, reexports)
            rel_path = mod.path.relative_to(root.parent)
            if dep is None:
                what = f"{target}.{name}" if name and target == pkg else target
                problems.append(f"missing module: {rel_path}:{line} imports {what}, which does not exist")
                continue
            if dep == mod.name:
                continue
            graph[mod.name].add(dep)
            where.setdefault((mod.name, dep), (rel_path, []))[1].append(line)

    for component in _cycles(graph):
        members = set(component)
        edges = ", ".join(f"{a} -> {b} ({_at(*where[a, b])})" for a in component for b in sorted(graph[a] & members))
        problems.append(f"import cycle between {', '.join(component)}: {edges}")

    for name in sorted(modules):
        if layer_of(name, layers, pkg) is None:
            problems.append(f"unplaced module: {name} ({modules[name].path.relative_to(root.parent)}) is in no "
                            f"layer; add it to LAYERS in tests/test_import_layers.py")
    for (src, dep), (path, lines) in sorted(where.items()):
        src_layer, dep_layer = layer_of(src, layers, pkg), layer_of(dep, layers, pkg)
        if src_layer is None or dep_layer is None or _top(src, pkg) == _top(dep, pkg):
            continue
        if dep_layer[0] > src_layer[0]:
            problems.append(f"upward import: {_at(path, lines)} {src} (layer {src_layer[0]} {src_layer[1]!r}) imports "
                            f"{dep} (higher layer {dep_layer[0]} {dep_layer[1]!r})")
        elif dep_layer[0] == src_layer[0]:
            problems.append(f"peer import: {_at(path, lines)} {src} imports {dep}; {src_layer[1]!r} and "
                            f"{dep_layer[1]!r} are peers in layer {src_layer[0]} and stay independent")
    return problems


def oversized_files(root: Path, folders: tuple[str, ...] = SIZE_LIMITED, max_lines: int = MAX_LINES) -> list[str]:
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > max_lines:
                out.append(f"{path.relative_to(root.parent)}: {lines} lines (> {max_lines})")
    return out


# ---- the real package ---------------------------------------------------------------------------------

def test_the_package_has_no_cycle_no_upward_import_and_every_module_placed() -> None:
    assert (ROOT / "__init__.py").is_file(), ROOT
    problems = check_imports(ROOT)
    assert not problems, "import-structure problems (layers are in tests/test_import_layers.py):\n  " + \
        "\n  ".join(problems)


def test_every_layer_prefix_names_an_existing_module_or_package() -> None:
    """A prefix left behind by a rename would silently cover nothing."""
    modules = discover(ROOT)
    rel = {name[len(PACKAGE) + 1:] if name != PACKAGE else "__init__" for name in modules}
    stale = [p for layer in LAYERS for p in layer if not any(r == p or r.startswith(p + ".") for r in rel)]
    assert not stale, f"layer prefixes that match no module: {stale}"


def test_split_packages_keep_their_files_small() -> None:
    assert not oversized_files(ROOT), oversized_files(ROOT)


# ---- the checks are not vacuous -----------------------------------------------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


FAKE_LAYERS = [("__init__",), ("low",), ("mid_a", "mid_b"), ("high",)]


def test_check_imports_reports_cycles_upward_peer_and_unplaced_imports(tmp_path: Path) -> None:
    root = tmp_path / "fakepkg"
    _write(root, {
        "__init__.py": "",
        "low.py": "def f():\n    from fakepkg.high import g\n",              # upward, lazy
        "mid_a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fakepkg import mid_b\n",  # peer
        "mid_b.py": "from fakepkg.low import f\n",
        "high.py": "import os\nimport fakepkg.ghost\n",                       # missing module
        "stray.py": "",                                                        # unplaced
        "pack/__init__.py": "from fakepkg.pack.one import ONE\n",
        "pack/one.py": "from fakepkg.pack.two import TWO\nONE = 1\n",
        "pack/two.py": "def g():\n    from .one import ONE\n    return ONE\nTWO = 2\n",  # cycle one <-> two
        "pack/three.py": "from fakepkg.pack import ONE\n",  # re-export: resolved to pack.one, no cycle via __init__
    })
    problems = check_imports(root, FAKE_LAYERS + [("pack",)])
    text = "\n".join(problems)
    assert "upward import: fakepkg/low.py:2 fakepkg.low" in text and "imports fakepkg.high" in text, text
    assert "peer import: fakepkg/mid_a.py:3 fakepkg.mid_a imports fakepkg.mid_b" in text, text
    assert "missing module: fakepkg/high.py:2 imports fakepkg.ghost" in text, text
    assert "unplaced module: fakepkg.stray" in text, text
    cycles = [p for p in problems if p.startswith("import cycle")]
    assert cycles == [cycles[0]] and "fakepkg.pack.one, fakepkg.pack.two:" in cycles[0], problems
    assert "fakepkg.pack.three" not in text and "fakepkg.pack," not in text, text
    assert len(problems) == 5, text


def test_check_imports_reports_a_cycle_across_layers_and_nothing_for_a_clean_package(tmp_path: Path) -> None:
    root = tmp_path / "fakepkg"
    _write(root, {"__init__.py": "", "low.py": "", "mid_a.py": "import fakepkg.low\n",
                  "mid_b.py": "from fakepkg import low\n", "high.py": "from fakepkg import mid_a, mid_b\n"})
    assert check_imports(root, FAKE_LAYERS) == []
    (root / "low.py").write_text("def late():\n    import fakepkg.high\n")
    problems = check_imports(root, FAKE_LAYERS)
    assert any(p.startswith("import cycle between fakepkg.high, fakepkg.low, fakepkg.mid_a, fakepkg.mid_b")
               for p in problems), problems
    assert any(p.startswith("upward import: fakepkg/low.py:2") for p in problems), problems


def test_oversized_files_are_reported(tmp_path: Path) -> None:
    root = tmp_path / "fakepkg"
    _write(root, {"runtime/loop/big.py": "x = 1\n" * (MAX_LINES + 1), "checkpoint/ok.py": "x = 1\n" * MAX_LINES})
    assert oversized_files(root) == [f"fakepkg/runtime/loop/big.py: {MAX_LINES + 1} lines (> {MAX_LINES})"]
