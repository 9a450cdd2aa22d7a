"""The suite's xdist scheduler (tests/xdist_units.py) finishes a run whose worker crashed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]

CONFTEST = '''
import pytest
from xdist_units import recovering_scheduler

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return recovering_scheduler(lambda nodeid: nodeid.split("::", 1)[0])(config, log)
'''

FILES = {
    "test_a.py": "def test_1(): pass\ndef test_2(): pass\ndef test_3(): pass\n",
    "test_b.py": "import os\ndef test_crash(): os._exit(1)\ndef test_after(): pass\n",
    "test_c.py": "def test_one(): pass\n",
    "test_d.py": "def test_one(): pass\ndef test_two(): pass\n",
}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_crashed_worker_costs_its_one_test_and_the_run_ends(tmp_path: Path, workers: int) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(workers), "-q"],
                         cwd=tmp_path, env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    tail = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 7 passed" in tail, run.stdout
    assert "test_b.py::test_crash" in run.stdout
