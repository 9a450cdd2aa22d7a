"""Marks each test by its folder (tests/unit, tests/local, tests/slurm, tests/sge) and groups
tests for pytest-xdist (``--dist loadgroup``):

- the real Slurm and SGE clusters share one test network and are started once per pytest
  process, so every test in tests/slurm and tests/sge runs in one group;
- a module whose tests share a cluster (a module- or session-scoped fixture of ours) runs in
  one group, so the cluster is started once, not once per xdist worker;
- any other test is spread on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
_FOLDER_MARKS = {"unit": pytest.mark.unit, "local": pytest.mark.local, "slurm": pytest.mark.slurm,
                "sge": pytest.mark.sge}
_SHARED_SCOPES = {"module", "package", "session"}


def _shares_a_fixture(item: pytest.Item) -> bool:
    """True when the test uses a module/package/session fixture defined under tests/."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for definitions in info.name2fixturedefs.values():
        for definition in definitions:
            source = getattr(definition.func, "__code__", None)
            if (definition.scope in _SHARED_SCOPES and source is not None
                    and Path(source.co_filename).resolve().is_relative_to(TESTS)):
                return True
    return False


def xdist_group(item: pytest.Item) -> str | None:
    """The group a test must run in with others, or None when it can run anywhere."""
    path = Path(str(item.fspath)).resolve()
    if path.parent.name in ("slurm", "sge"):
        return "real-clusters"
    if _shares_a_fixture(item):
        return str(path.relative_to(TESTS))
    return None


# tryfirst: xdist reads the xdist_group marks in its own pytest_collection_modifyitems.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[folder])
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
