"""The boundaries of keras_distrib and cluster_parsers, read from the code with ``ast``:

* the launcher never imports TensorFlow or the script side; the script side never imports
  the launcher;
* no import circle between modules, counting lazy (in-function) and TYPE_CHECKING imports,
  and counting a package's ``__init__`` (importing ``a.b.c`` from outside ``a.b`` runs ``a.b``);
* no import that runs back up: the top-level parts (a module, or a subpackage taken whole)
  import each other in one direction only, a private module or name (``_x``) is used only
  inside its own package, and no module imports a name from its own ancestor's ``__init__``;
* every private TensorFlow/Keras/JAX API (``keras.src``, ``tensorflow.python``, ``jax._src``,
  ``_x`` attributes of their objects) is used only in a fenced module, a file named
  ``_private_apis.py`` (at most one per package), inside a function whose docstring gives the
  upstream reason; each fenced module lists the releases it was checked against in
  ``TESTED_VERSIONS``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "keras_distrib"
LAUNCHER = PACKAGE / "launcher"
PACKAGES = ("keras_distrib", "cluster_parsers")
# Modules that run inside SCRIPT or its servers (started by the agent, never part of it).
SCRIPT_SIDE = ("strategies", "servers", "check", "data", "trainers", "checkpoints")
FORBIDDEN_IN_LAUNCHER = {"tensorflow", "keras", "tf_keras", "jax"} | {f"keras_distrib.{m}" for m in SCRIPT_SIDE}

FENCE_NAME = "_private_apis.py"
FOREIGN = ("tensorflow", "keras", "tf_keras", "jax", "jaxlib", "keras_tuner")
# Implementation trees of the foreign packages (their public API is re-exported elsewhere).
PRIVATE_TREES = ("tensorflow.python", "tensorflow.core", "tensorflow.tsl", "tensorflow.compiler",
                 "keras.src", "tf_keras.src", "jaxlib", "keras_tuner.src")
# Underscore names that are public by convention (namedtuple's API).
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}

# ------------------------------------------------------------------------------- reading


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    #: (absolute module, name imported from it or None, line) for every import statement.
    imports: list[tuple[str, str | None, int]] = field(default_factory=list)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def read_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for top in packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    for module in modules.values():
        module.imports = list(_imports(module))
    return modules


def _imports(module: Module) -> Iterable[tuple[str, str | None, int]]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = module.package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module or "") if part)
            for alias in node.names:
                yield source, alias.name, node.lineno


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module imported anywhere in ``path`` (relative ones resolved)."""
    module = next(m for m in MODULES.values() if m.path == path)
    return {source for source, _, _ in module.imports} | {
        f"{source}.{what}" for source, what, _ in module.imports if what is not None}


def hits(names: set[str], forbidden: set[str]) -> set[str]:
    return {n for n in names for f in forbidden if n == f or n.startswith(f + ".")}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(source: str, what: str | None, modules: dict[str, Module]) -> list[str]:
    """Our modules an import statement runs: the module, or ``source.what`` if that is one."""
    if what is not None and f"{source}.{what}" in modules:
        return [f"{source}.{what}"]
    while source and source not in modules:
        source = source.rpartition(".")[0]
    return [source] if source else []


def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the modules importing it runs (with the ``__init__`` of each package entered)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module in modules.values():
        mine = set(_ancestors(module.name)) | {module.name}
        for source, what, _ in module.imports:
            for target in _targets(source, what, modules):
                for entered in [*_ancestors(target), target]:
                    if entered in modules and entered not in mine:
                        graph[module.name].add(entered)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def part_of(name: str) -> str:
    """The top-level part a module belongs to: ``keras_distrib.trainers`` for every trainer module."""
    return ".".join(name.split(".")[:2])


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = part_of(module)
        parts.setdefault(mine, set())
        for target in targets:
            # A package's own __init__ is the entrance of its parts, not a part itself.
            if part_of(target) != mine and "." in target:
                parts[mine].add(part_of(target))
    return parts


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _may_use(importer: Module, private: str, modules: dict[str, Module]) -> bool:
    """Whether ``importer`` may use the private module or name ``private`` (its last part).

    A private module, or a private name of a package's ``__init__``: anywhere inside that
    package. A private name of a module: in that module's package, not in a subpackage
    (reaching a parent's private helper runs back up).
    """
    owner = private.rpartition(".")[0]
    if owner in modules and modules[owner].is_package:
        return _inside(importer.name, owner)
    return importer.package == owner.rpartition(".")[0]


def _aliases(module: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local name -> absolute module, for every ``import x`` / ``from p import m`` in the file."""
    out: dict[str, str] = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = module.package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module or "") if part)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules or source.split(".")[0] in FOREIGN:
                    out[alias.asname or alias.name] = full
    return out


def back_up_imports(modules: dict[str, Module]) -> list[tuple[str, str]]:
    """(module, what) for every private module or name it takes from another package, and
    every name it imports from an ancestor package's ``__init__``."""
    found: set[tuple[str, str]] = set()
    tops = {name.split(".")[0] for name in modules}
    for module in modules.values():
        used: list[str] = []
        for source, what, line in module.imports:
            if source.split(".")[0] not in tops:
                continue
            full = f"{source}.{what}" if what is not None else source
            if what is not None and full not in modules and source in _ancestors(module.name):
                found.add((module.name, f"{full} (a name from an ancestor's __init__)"))
            else:
                used.append(full)
        aliases = _aliases(module, modules)
        used += [f"{aliases[node.value.id]}.{node.attr}" for node in ast.walk(module.tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                 and aliases.get(node.value.id) in modules and _is_private(node.attr)]
        for full in used:
            parts = full.split(".")
            first = next((i for i, part in enumerate(parts) if _is_private(part)), None)
            if first is not None and not _may_use(module, ".".join(parts[: first + 1]), modules):
                found.add((module.name, ".".join(parts[: first + 1])))
    return sorted(found)


# ------------------------------------------------------------------- private foreign APIs


def _defined_names(modules: Iterable[Module]) -> set[str]:
    """Every name our own code defines (functions, classes, variables, attributes it sets)."""
    names: set[str] = set()
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
    return names


def _private_module_path(name: str) -> bool:
    top = name.split(".")[0]
    if top not in FOREIGN:
        return False
    return any(name == t or name.startswith(t + ".") for t in PRIVATE_TREES) or any(
        _is_private(part) for part in name.split(".")[1:])


@dataclass(frozen=True)
class PrivateUse:
    module: str
    line: int
    what: str
    function: str | None  # the top-level function (or method) it is in


def private_uses(module: Module, ours: set[str], modules: dict[str, Module]) -> list[PrivateUse]:
    """Every private TensorFlow/Keras/JAX API ``module`` uses.

    ``ours``: the underscore names our own code defines (``x._name`` with any other
    ``_name`` belongs to a foreign object).
    """
    aliases = _aliases(module, modules)
    uses: list[PrivateUse] = []

    def add(node: ast.AST, what: str, function: str | None) -> None:
        uses.append(PrivateUse(module.name, getattr(node, "lineno", 0), what, function))

    def foreign_attribute(value: ast.expr, attr: str) -> str | None:
        if attr == "__internal__":
            return attr
        if not _is_private(attr) or attr in PUBLIC_UNDERSCORE:
            return None
        if isinstance(value, ast.Name) and value.id in aliases:
            target = aliases[value.id]
            return f"{target}.{attr}" if target.split(".")[0] in FOREIGN else None
        if isinstance(value, ast.Name) and value.id in ("self", "cls") and attr in ours:
            return None
        return None if attr in ours else f"{ast.unparse(value)}.{attr}"

    def walk(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and function is None:
                inner = child.name
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if _private_module_path(alias.name):
                        add(child, alias.name, function)
            elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
                if _private_module_path(child.module):
                    add(child, child.module, function)
                elif child.module.split(".")[0] in FOREIGN:
                    for alias in child.names:
                        if _is_private(alias.name) or _private_module_path(f"{child.module}.{alias.name}"):
                            add(child, f"{child.module}.{alias.name}", function)
            elif isinstance(child, ast.Attribute):
                what = foreign_attribute(child.value, child.attr)
                if what:
                    add(child, what, function)
            elif isinstance(child, ast.Call) and isinstance(child.func, (ast.Name, ast.Attribute)):
                called = child.func.id if isinstance(child.func, ast.Name) else child.func.attr
                strings = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None
                           for a in child.args]
                if called in ("getattr", "setattr", "hasattr", "delattr") and len(strings) > 1 and strings[1]:
                    what = foreign_attribute(child.args[0], strings[1])
                    if what:
                        add(child, what, function)
                elif called in ("import_module", "__import__") and strings and strings[0]:
                    if _private_module_path(strings[0]):
                        add(child, strings[0], function)
            walk(child, inner)

    walk(module.tree, None)
    return uses


def _is_fence(module: Module) -> bool:
    return module.path.name == FENCE_NAME


def _docstring_of(module: Module, function: str) -> str:
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return ast.get_docstring(node) or ""
    return ""


def private_api_report(modules: dict[str, Module]) -> tuple[list[PrivateUse], list[str]]:
    """(private uses outside the fences, problems of the fences themselves)."""
    ours = _defined_names(m for m in modules.values() if not _is_fence(m))
    outside: list[PrivateUse] = []
    problems: list[str] = []
    for module in modules.values():
        uses = private_uses(module, ours, modules)
        if not _is_fence(module):
            outside += uses
            continue
        for use in uses:
            if use.function is None:
                problems.append(f"{module.name}:{use.line} {use.what}: outside a function")
            elif "upstream" not in _docstring_of(module, use.function).lower():
                problems.append(f"{module.name}:{use.line} {use.what}: the docstring of {use.function}() "
                                "gives no upstream reason")
        tested = _tested_versions(module)
        if tested is None:
            problems.append(f"{module.name}: no TESTED_VERSIONS dict")
            continue
        for top in sorted({use.what.split(".")[0] for use in uses if use.what.split(".")[0] in FOREIGN}):
            top = "jax" if top == "jaxlib" else top
            if not re.fullmatch(r"\d+\.\d+\.\d+", tested.get(top, "")):
                problems.append(f"{module.name}: TESTED_VERSIONS gives no full release of {top}")
    fences: dict[str, list[str]] = {}
    for module in modules.values():
        if _is_fence(module):
            fences.setdefault(module.package, []).append(module.name)
    problems += [f"{package}: more than one fenced module {names}" for package, names in fences.items() if len(names) > 1]
    return outside, problems


def _tested_versions(module: Module) -> dict[str, str] | None:
    for node in module.tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "TESTED_VERSIONS" for t in targets) and node.value is not None:
            value = ast.literal_eval(node.value)
            return value if isinstance(value, dict) else None
    return None


MODULES = read_modules(REPO)


# --------------------------------------------------------------------------------- tests


@pytest.mark.unit
@pytest.mark.parametrize("path", sorted(LAUNCHER.glob("*.py")), ids=lambda p: p.name)
def test_launcher_imports_no_tensorflow_and_no_script_side(path: Path) -> None:
    assert not hits(imported_modules(path), FORBIDDEN_IN_LAUNCHER)


@pytest.mark.unit
@pytest.mark.parametrize(
    "path",
    sorted(p for m in SCRIPT_SIDE for p in [*PACKAGE.glob(f"{m}.py"), *PACKAGE.glob(f"{m}/**/*.py")]),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_script_side_never_imports_the_launcher(path: Path) -> None:
    assert not hits(imported_modules(path), {"keras_distrib.launcher"})


@pytest.mark.unit
def test_the_checker_sees_a_relative_import() -> None:
    names = imported_modules(LAUNCHER / "agent.py")
    assert "keras_distrib.plan" in names and "keras_distrib.launcher.control" in names


@pytest.mark.unit
@pytest.mark.parametrize("level", ["modules", "parts"])
def test_no_import_circle(level: str) -> None:
    """Between modules; and between top-level parts, where a circle means an import runs back up."""
    graph = import_graph(MODULES)
    found = circles(graph if level == "modules" else part_graph(graph))
    assert found == [], f"{level} that import each other: {found}. HINT: move what both sides share into a " \
        "module of its own, below both"


@pytest.mark.unit
def test_no_private_module_or_name_of_another_package_and_nothing_from_an_ancestors_init() -> None:
    found = back_up_imports(MODULES)
    assert found == [], f"imports that run back up (module, what): {found}"


@pytest.mark.unit
def test_private_tensorflow_keras_jax_apis_only_in_the_fenced_modules() -> None:
    outside, problems = private_api_report(MODULES)
    found = [f"{u.module}:{u.line} {u.what}" for u in outside]
    assert found == [], (
        f"private TensorFlow/Keras/JAX APIs outside the fenced modules: {found}. HINT: move each use into "
        f"the package's {FENCE_NAME}, in a function whose docstring gives the upstream reason")
    assert problems == []


@pytest.mark.unit
def test_the_fenced_modules_match_the_installed_releases() -> None:
    fences = [m for m in MODULES.values() if _is_fence(m)]
    assert {m.name for m in fences} >= {"keras_distrib.trainers._private_apis", "keras_distrib._private_apis"}
    for module in fences:
        for name, tested in (_tested_versions(module) or {}).items():
            try:
                installed = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            assert installed.split(".")[:2] == tested.split(".")[:2], (
                f"{module.name} was checked against {name} {tested}, {installed} is installed: re-check "
                "its private uses, then update TESTED_VERSIONS")


# The checkers themselves, on small trees that break each rule.

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_modules(tmp_path, ["pkg"])


@pytest.mark.unit
def test_the_checkers_find_circles_back_up_imports_and_private_apis(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .b import x\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
        "pkg/c.py": "def f():\n    from .d import g\n",
        "pkg/d.py": "from .c import f\n",
        "pkg/sub/__init__.py": "from .low import thing\n",
        "pkg/sub/low.py": "from ..top import helper\n",
        "pkg/sub/_hidden.py": "",
        "pkg/sub/up.py": "from .. import helper_name\nfrom .. import a as mod_a\nmod_a._private_helper\n",
        "pkg/sub/fine.py": "from . import _hidden\nfrom ._hidden import _x\n",
        "pkg/top.py": "from .sub._hidden import z\n",
        "pkg/user.py": ("import os\nimport tensorflow as tf\nfrom keras.src.ops import core\nfrom jax._src import api\n"
                        "def f(model, ds):\n    getattr(model, '_compile_loss')\n    ds._as_serialized_graph()\n"
                        "    tf.__internal__.x\n    tf._api\n    model._mine\n    os._exit(0)\n\n_mine = 1\n"),
        "pkg/_private_apis.py": ("TESTED_VERSIONS = {'keras': '3.15'}\n"
                                 "def g():\n    'No reason given.'\n    from keras.src import backend\n"),
    })
    graph = import_graph(modules)
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.sub", "pkg.sub.low", "pkg.top"]]
    assert circles(part_graph(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.sub", "pkg.top"]]
    assert back_up_imports(modules) == [
        ("pkg.sub.up", "pkg.a._private_helper"), ("pkg.sub.up", "pkg.helper_name (a name from an ancestor's __init__)"),
        ("pkg.top", "pkg.sub._hidden")]
    outside, problems = private_api_report(modules)
    assert sorted(u.what for u in outside) == sorted([
        "keras.src.ops", "jax._src", "model._compile_loss", "ds._as_serialized_graph", "__internal__", "tensorflow._api"])
    assert problems == ["pkg._private_apis:4 keras.src: the docstring of g() gives no upstream reason",
                        "pkg._private_apis: TESTED_VERSIONS gives no full release of keras"]


def test_a_server_imports_the_whole_tensorflow_where_its_init_would_load_more(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    """server_runtime's bare import is taken only when tensorflow/__init__.py would load
    nothing a server could need (plugins, a modular filesystem) on the release checked."""
    import importlib.metadata
    import importlib.util

    from keras_distrib import _private_apis

    spec = importlib.util.find_spec("tensorflow")
    for name in ("TF_USE_MODULAR_FILESYSTEM", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert _private_apis._bare_import_is_enough(spec)  # this venv: no plugins, TF 2.21
    monkeypatch.setenv("TF_USE_MODULAR_FILESYSTEM", "1")
    assert not _private_apis._bare_import_is_enough(spec)
    monkeypatch.delenv("TF_USE_MODULAR_FILESYSTEM")
    monkeypatch.setenv("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "/opt/plugin.so")
    assert not _private_apis._bare_import_is_enough(spec)
    monkeypatch.delenv("TF_PLUGGABLE_DEVICE_LIBRARY_PATH")
    (tmp_path / "site-packages" / "tensorflow-plugins").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    assert not _private_apis._bare_import_is_enough(spec)
    monkeypatch.undo()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.99.0")
    assert not _private_apis._bare_import_is_enough(spec)
