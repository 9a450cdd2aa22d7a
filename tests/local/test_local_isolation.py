"""Local mode: the job's TF servers are reachable from the job only, not from this machine's other addresses."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher_utils import launcher_env, listening_ports, start_local, wait_for

pytestmark = pytest.mark.local

WAITER = textwrap.dedent(
    """
    import sys, time
    open(sys.argv[1], "w").close()
    time.sleep(120)
    """
)


def this_machines_addresses() -> set[str]:
    """Every IPv4 address of this machine's interfaces (as seen outside the job)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return {"127.0.0.1", *(a for a in out if ":" not in a)}


def connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def test_local_job_ports_are_unreachable_from_outside_the_job(tmp_path: Path) -> None:
    (tmp_path / "wait.py").write_text(WAITER)
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "keras_distrib.local", "--nodes", "2", "--port-base", "24700", "--plan", "--format", "json"],
        cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, check=True).stdout)
    ports = {int(p["address"].rsplit(":", 1)[1]) for p in plan["processes"] if p["job"] != "chief"}
    ready = tmp_path / "ready"
    proc = start_local(["--nodes", "2", "--port-base", "24700", "wait.py", str(ready)], tmp_path)
    try:
        assert wait_for(ready.exists, 90), "the script never started"
        # Inside the job's network the servers listen ...
        assert wait_for(lambda: ports <= listening_ports(proc.pid), 90), "the TF servers never listened"
        # ... and from this machine's own network, at every address it has, nothing answers.
        reachable = [(a, p) for a in sorted(this_machines_addresses()) for p in sorted(ports) if connects(a, p)]
        assert not reachable
        assert not ports & listening_ports()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert "warning" not in out, out


def test_no_isolation_warns_once(tmp_path: Path) -> None:
    (tmp_path / "quick.py").write_text("print('done')\n")
    out = subprocess.run([sys.executable, "-m", "keras_distrib.local", "--nodes", "1", "--port-base", "24800",
                          "--no-isolation", "quick.py"], cwd=tmp_path, env=launcher_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("warning: --no-isolation") == 1
