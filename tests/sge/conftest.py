"""Fixtures for tests that need a real SGE cluster (see scripts/testcluster/sge_cluster.py).

Run them as root on Debian: ``python -m pytest tests/sge -m sge``. Without root (or without
the Debian packages and no way to install them) the tests are skipped with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

# The harness lives outside any package so it can also be run as a script by humans/CI.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "testcluster"))

from sge_cluster import SgeTestCluster  # noqa: E402


@pytest.fixture(scope="session")
def sge_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SgeTestCluster]:
    """A running SGE cluster: qmaster on head, exec hosts n1..n3 with 2 slots each, PE ``mpi``."""
    ok, reason = SgeTestCluster.available()
    if not ok:
        pytest.skip(f"no SGE test cluster: {reason}")
    with SgeTestCluster(tmp_path_factory.mktemp("sge-cluster"), nodes=3, slots=2) as cluster:
        print(f"\nSGE cluster up in {cluster.timings['start']:.2f} s "
              f"(package check/install {cluster.timings['install']:.2f} s)")
        yield cluster
