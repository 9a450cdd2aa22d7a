"""Local mode: the job's TF servers are reachable from the job only, not from this machine's other addresses."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


PROBE = textwrap.dedent(
    """
    import json, socket, sys
    reachable = []
    for address, port in json.loads(sys.argv[1]):
        try:
            socket.create_connection((address, port), timeout=2).close()
            reachable.append([address, port])
        except OSError:
            pass
    print(json.dumps(reachable))
    """
)


@contextmanager
def another_network_namespace() -> Iterator[tuple[str, str] | None]:
    """A second network namespace joined to this one by a veth pair: (its name, this side's address).

    None where it cannot be made (not root, no iproute2): the caller says so.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    tag = os.getpid() % 10000
    name, outer, inner, net = f"kdiso{tag}", f"kdiso{tag}a", f"kdiso{tag}b", f"10.203.{tag % 250}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", name)
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", name)
        ip("addr", "add", f"{net}.1/30", "dev", outer)
        ip("link", "set", outer, "up")
        ip("-n", name, "addr", "add", f"{net}.2/30", "dev", inner)
        ip("-n", name, "link", "set", inner, "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "route", "add", "default", "via", f"{net}.1")
        yield name, f"{net}.1"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", outer], capture_output=True)


def reachable_from(namespace: str, targets: list[tuple[str, int]]) -> list[list[Any]]:
    out = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", PROBE, json.dumps(targets)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_local_job_ports_are_unreachable_from_outside_the_job(tmp_path: Path) -> None:
    (tmp_path / "wait.py").write_text(WAITER)
    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "keras_distrib.local", "--nodes", "2", "--port-base", "24700", "--plan", "--format", "json"],
        cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, check=True).stdout)
    ports = {int(p["address"].rsplit(":", 1)[1]) for p in plan["processes"] if p["job"] != "chief"}
    control_port = max(int(p["address"].rsplit(":", 1)[1]) for p in plan["processes"]) + 1  # Plan.control_port
    ready = tmp_path / "ready"
    proc = start_local(["--nodes", "2", "--port-base", "24700", "wait.py", str(ready)], tmp_path)
    try:
        assert wait_for(ready.exists, 90), "the script never started"
        # Inside the job's network the servers listen ...
        assert wait_for(lambda: ports <= listening_ports(proc.pid), 90), "the TF servers never listened"
        # ... and from this machine's own network, at every address it has, nothing answers.
        every_port = sorted(ports | {control_port})
        reachable = [(a, p) for a in sorted(this_machines_addresses()) for p in every_port if connects(a, p)]
        assert not reachable
        assert not ports & listening_ports()
        # ... nor from another network namespace of this machine (another "host" on a link
        # to this one), at any of this machine's addresses.
        with another_network_namespace() as other, socket.create_server(("", 0)) as control:
            if other is None:
                pytest.skip("cannot make a second network namespace (needs root and iproute2); checked from this one only")
            namespace, near = other
            targets = [(a, p) for a in sorted(this_machines_addresses() | {near}) for p in every_port]
            # The probe itself works: a server on every interface of this machine answers it.
            assert reachable_from(namespace, [(near, control.getsockname()[1])]) == [[near, control.getsockname()[1]]]
            assert reachable_from(namespace, targets) == []
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
