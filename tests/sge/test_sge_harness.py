"""The SGE harness's command line, as docs/development.md shows it (up, run, down)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sge_cluster import SgeTestCluster

HARNESS = Path(__file__).resolve().parents[2] / "scripts" / "testcluster" / "sge_cluster.py"


def test_cli_up_run_down(tmp_path: Path) -> None:
    ok, reason = SgeTestCluster.available()
    if not ok:
        pytest.skip(f"no SGE test cluster: {reason}")
    # Another prefix (and one host) so the session's cluster (kds-*) is left alone.
    cli = [sys.executable, str(HARNESS)]
    work = tmp_path / "cli"
    up = subprocess.run([*cli, "up", str(work), "--nodes", "1", "--prefix", "kdscli"],
                        capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.startswith("cluster up in ") and f"SGE_ROOT={work / 'sge'}" in up.stdout
        run = subprocess.run([*cli, "run", str(work), "--", "qhost", "-h", "n1"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        row = run.stdout.splitlines()[-1].split()  # HOSTNAME ARCH NCPU ... LOAD ...
        assert row[0] == "n1" and row[2].isdigit() and row[6] != "-", run.stdout
        on_node = subprocess.run([*cli, "run", str(work), "--node", "n1", "--", "hostname"],
                                 capture_output=True, text=True, timeout=120)
        assert on_node.stdout.strip() == "n1", on_node.stderr
    finally:
        down = subprocess.run([*cli, "down", str(work)], capture_output=True, text=True, timeout=300)
    assert down.returncode == 0 and down.stdout.startswith("cluster down in "), down.stderr
    assert not [n for n in Path("/run/netns").iterdir() if n.name.startswith("kdscli-")]
