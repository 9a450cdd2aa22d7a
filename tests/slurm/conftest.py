"""Fixtures for tests that need a real Slurm cluster (see scripts/testcluster/slurm_cluster.py).

Run them as root on Debian: ``python -m pytest tests/slurm -m slurm``. Without root (or
without the Debian packages and no way to install them) the tests are skipped.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from real_clusters import real_cluster
from slurm_cluster import SlurmTestCluster


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: needs a real Slurm cluster (root + Debian packages)")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmTestCluster]:
    """A running 3-node Slurm cluster (n1..n3, 2 CPUs each), shared by the whole session."""
    yield from real_cluster(SlurmTestCluster, "Slurm", tmp_path_factory, nodes=3, cpus_per_node=2)
