"""Marks each test by its folder (tests/unit, tests/local, tests/slurm, tests/sge), and how
pytest-xdist shares the tests out (``-n 2 --dist loadfile`` in pyproject.toml):

- every test of one file on one worker: a module's shared cluster (a module-scoped fixture)
  starts once;
- every test in tests/slurm and tests/sge on one worker: the real clusters are session
  fixtures that hold their harness's lock until the worker ends, so a second worker would
  wait for them (CI: 600 s, then an error);
- the longest units first (``UNIT_SECONDS``).

pytest 9.2 names items by a structured id, and xdist 3.8's ``loadgroup`` (which rewrites
``item._nodeid``) no longer groups anything, so the grouping is a scheduler of our own.
"""

from __future__ import annotations

import os
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


# Seconds of test time per work unit in CI (from a whole run's test times on 2 cores, the
# rotating grids at their share); a unit not listed counts by its folder. The longest units
# start first, so neither xdist worker is left with a long one at the end.
UNIT_SECONDS = {
    "real-clusters": 2450,
    "tests/local/test_jax_ps_local.py": 1100,
    "tests/local/test_ps_trainer.py": 720,
    "tests/local/test_bench_smoke.py": 650,
    "tests/local/test_metric_contract.py": 520,
    "tests/local/test_resilience_local.py": 430,
    "tests/local/test_exact_epochs.py": 380,
    "tests/local/test_hangs_local.py": 320,
    "tests/local/test_allreduce_trainer.py": 290,
    "tests/local/test_examples_local.py": 270,
    "tests/local/test_custom_steps.py": 230,
    "tests/local/test_tuner_local.py": 180,
    "tests/local/test_jax_layout.py": 170,
    "tests/local/test_lookup_layers.py": 140,
    "tests/local/test_elastic_local.py": 60,
    "tests/local/test_once.py": 60,
}
FOLDER_SECONDS = {"local": 30, "unit": 2}


def unit_seconds(unit: str) -> float:
    """The expected test time of a work unit (see UNIT_SECONDS)."""
    return UNIT_SECONDS.get(unit, FOLDER_SECONDS.get(Path(unit).parent.name, 10))


FAST_IMPORTS = Path(__file__).parent / "fast_imports"


def pytest_configure(config: pytest.Config) -> None:
    """Every process the suite starts (xdist's workers, launchers, jobs) inherits
    ``fast_imports/sitecustomize.py``: ``import tensorflow, keras`` at half its CPU cost."""
    # One seed per run, drawn here so xdist's workers inherit it and the header names it: the
    # rotating grids' cases and tests/slurm/test_chaos_slurm.py's schedules.
    os.environ.setdefault("KERAS_DISTRIB_TEST_SEED", str(int.from_bytes(os.urandom(3), "big")))
    os.environ.setdefault("KERAS_DISTRIB_CHAOS_SEED", os.environ["KERAS_DISTRIB_TEST_SEED"])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(FAST_IMPORTS) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAST_IMPORTS), *paths]))


def pytest_report_header(config: pytest.Config) -> list[str]:
    seed, chaos = os.environ["KERAS_DISTRIB_TEST_SEED"], os.environ["KERAS_DISTRIB_CHAOS_SEED"]
    return [f"test seed: {seed} (KERAS_DISTRIB_TEST_SEED={seed} runs the same cases of the rotating grids; "
            f"{FULL_GRID}=1 runs every case)",
            f"chaos seed: {chaos} (KERAS_DISTRIB_CHAOS_SEED={chaos} replays tests/slurm/test_chaos_slurm.py's schedules)"]


#: ``@pytest.mark.rotating(n)`` on a parametrized test: each run runs one case in n, in turn by
#: the run's seed, so n runs cover the grid (a grid too long to run whole in every CI run).
FULL_GRID = "KERAS_DISTRIB_FULL_GRID"


def rotate_out(items: list[pytest.Item], args: list[str]) -> None:
    """Skips the cases of rotating grids that are not this run's, with a reason naming the
    run's; a case named on the command line runs."""
    if os.environ.get(FULL_GRID) == "1":
        return
    seed = int(os.environ["KERAS_DISTRIB_TEST_SEED"])
    grids: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("rotating") is not None:
            grids.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    for cases in grids.values():
        every = cases[0].get_closest_marker("rotating").args[0]
        # The case's place in its (one) parametrize list, not among the collected: -k keeps the choice.
        place = {item: max(item.callspec.indices.values()) for item in cases}
        ours = [item for item in cases if (place[item] + seed) % every == 0]
        names = ", ".join(item.nodeid.split("[", 1)[1].rstrip("]") for item in ours)
        for item in cases:
            if item not in ours and not any(arg.endswith(item.nodeid) for arg in args):
                item.add_marker(pytest.mark.skip(reason=f"rotating grid: one case in {every} per run; this run "
                                                        f"(test seed {seed}) runs [{names}]; {FULL_GRID}=1 runs every case"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[folder])
    rotate_out(items, config.args)
    # xdist's workers report this order; the scheduler below keeps it (--no-loadscope-reorder).
    position = {}
    for item in items:
        position.setdefault(work_unit(item.nodeid), len(position))
    items.sort(key=lambda item: (-unit_seconds(work_unit(item.nodeid)), position[work_unit(item.nodeid)]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist_units import recovering_scheduler

    return recovering_scheduler(work_unit)(config, log)
