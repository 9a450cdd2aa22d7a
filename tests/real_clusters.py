"""The session fixtures' shared body for the real-scheduler tests (tests/slurm, tests/sge)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

# The harnesses live outside any package so they can also be run as scripts by humans/CI.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "testcluster"))


def real_cluster(cls: Any, scheduler: str, tmp_path_factory: pytest.TempPathFactory, **options: Any) -> Iterator[Any]:
    """A started ``cls`` (a test-cluster harness) for the session, stopped at its end; the
    tests are skipped with the reason when no cluster can run on this machine."""
    ok, reason = cls.available()
    if not ok:
        pytest.skip(f"no {scheduler} test cluster: {reason}")
    with cls(tmp_path_factory.mktemp(f"{scheduler.lower()}-cluster"), **options) as cluster:
        install = cluster.timings.get("install")
        print(f"\n{scheduler} cluster up in {cluster.timings['start']:.2f} s"
              + (f" (package check/install {install:.2f} s)" if install is not None else ""))
        yield cluster
