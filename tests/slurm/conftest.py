"""Fixtures for tests that need a real Slurm cluster (see scripts/testcluster/slurm_cluster.py).

Run them as root on Debian: ``python -m pytest tests/slurm -m slurm``. Without root (or
without the Debian packages and no way to install them) the tests are skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

# The harness lives outside any package so it can also be run as a script by humans/CI.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "testcluster"))

from slurm_cluster import SlurmTestCluster  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: needs a real Slurm cluster (root + Debian packages)")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmTestCluster]:
    """A running 3-node Slurm cluster (n1..n3, 2 CPUs each), shared by the whole session."""
    ok, reason = SlurmTestCluster.available()
    if not ok:
        pytest.skip(f"no Slurm test cluster: {reason}")
    with SlurmTestCluster(tmp_path_factory.mktemp("slurm-cluster"), nodes=3, cpus_per_node=2) as cluster:
        yield cluster
