"""The launcher never imports TensorFlow or the script side; the script side never imports the launcher."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "keras_distrib"
LAUNCHER = PACKAGE / "launcher"
# Modules that run inside SCRIPT or its servers (started by the agent, never part of it).
SCRIPT_SIDE = ("strategies", "servers", "check", "data", "trainers", "checkpoints")
FORBIDDEN_IN_LAUNCHER = {"tensorflow", "keras", "tf_keras", "jax"} | {f"keras_distrib.{m}" for m in SCRIPT_SIDE}


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module imported anywhere in ``path`` (relative ones resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def hits(names: set[str], forbidden: set[str]) -> set[str]:
    return {n for n in names for f in forbidden if n == f or n.startswith(f + ".")}


@pytest.mark.unit
@pytest.mark.parametrize("path", sorted(LAUNCHER.glob("*.py")), ids=lambda p: p.name)
def test_launcher_imports_no_tensorflow_and_no_script_side(path: Path) -> None:
    assert not hits(imported_modules(path), FORBIDDEN_IN_LAUNCHER)


@pytest.mark.unit
@pytest.mark.parametrize(
    "path",
    sorted(p for m in SCRIPT_SIDE for p in [*PACKAGE.glob(f"{m}.py"), *PACKAGE.glob(f"{m}/*.py")]),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_script_side_never_imports_the_launcher(path: Path) -> None:
    assert not hits(imported_modules(path), {"keras_distrib.launcher"})


@pytest.mark.unit
def test_the_checker_sees_a_relative_import() -> None:
    names = imported_modules(LAUNCHER / "agent.py")
    assert "keras_distrib.plan" in names and "keras_distrib.launcher.control" in names
