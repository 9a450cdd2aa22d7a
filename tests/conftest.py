"""Marks each test by its folder (tests/unit, tests/local, tests/slurm, tests/sge), and how
pytest-xdist shares the tests out (``-n 2 --dist loadfile`` in pyproject.toml):

- every test of one file on one worker: a module's shared cluster (a module-scoped fixture)
  starts once;
- every test in tests/slurm and tests/sge on one worker: the real clusters are session
  fixtures that hold their harness's lock until the worker ends, so a second worker would
  wait for them (CI: 600 s, then an error).

pytest 9.2 names items by a structured id, and xdist 3.8's ``loadgroup`` (which rewrites
``item._nodeid``) no longer groups anything, so the grouping is a scheduler of our own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

_FOLDER_MARKS = {"unit": pytest.mark.unit, "local": pytest.mark.local, "slurm": pytest.mark.slurm,
                "sge": pytest.mark.sge}
REAL_CLUSTER_FOLDERS = ("tests/slurm/", "tests/sge/")


def work_unit(nodeid: str) -> str:
    """The tests that must share one xdist worker: the file, or all real-cluster tests."""
    path = nodeid.split("::", 1)[0]
    return "real-clusters" if path.startswith(REAL_CLUSTER_FOLDERS) else path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[folder])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndCluster(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByFileAndCluster(config, log)
