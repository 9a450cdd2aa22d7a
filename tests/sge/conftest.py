"""Fixtures for tests that need a real SGE cluster (see scripts/testcluster/sge_cluster.py).

Run them as root on Debian: ``python -m pytest tests/sge -m sge``. Without root (or without
the Debian packages and no way to install them) the tests are skipped with the reason.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from real_clusters import real_cluster
from sge_cluster import SgeTestCluster


@pytest.fixture(scope="session")
def sge_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SgeTestCluster]:
    """A running SGE cluster: qmaster on head, exec hosts n1..n3 with 2 slots each, PE ``mpi``."""
    yield from real_cluster(SgeTestCluster, "SGE", tmp_path_factory, nodes=3, slots=2)
