"""Marks each test by its folder: tests/unit, tests/local, tests/slurm, tests/sge."""

from __future__ import annotations

from pathlib import Path

import pytest

_FOLDER_MARKS = {"unit": pytest.mark.unit, "local": pytest.mark.local, "slurm": pytest.mark.slurm,
                "sge": pytest.mark.sge}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[folder])
