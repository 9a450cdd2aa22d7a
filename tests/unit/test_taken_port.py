"""A taken port of the plan is named, with the --port-base fix, before anything starts."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _unit_helpers import clean_env
from keras_distrib.launcher.prestart import taken_port

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("slot, role", [(0, "chief:0"), (1, "ps:0"), (2, "worker:0")])
def test_taken_port_is_named_with_a_hint(tmp_path: Path, slot: int, role: str) -> None:
    while True:  # a port whose neighbours (the plan's other ports) are free
        squatter = socket.create_server(("", 0))
        port = squatter.getsockname()[1]
        base = port - slot
        if not any(taken_port(base + i) for i in range(3) if i != slot):
            break
        squatter.close()
    with squatter:
        (tmp_path / "train.py").write_text("print('never runs')\n")
        out = subprocess.run(
            [sys.executable, "-m", "keras_distrib.local", "--nodes", "1", "--no-isolation", "--port-base", str(base), "train.py"],
            cwd=tmp_path, env=clean_env({}), capture_output=True, text=True, timeout=60,
        )
    assert out.returncode == 2, out.stderr
    error = [line for line in out.stderr.splitlines() if "error:" in line]
    assert error == [f"keras_distrib: error: port(s) {port} ({role}) already in use on local0. HINT: pass another "
                     f"--port-base (e.g. --port-base {base + 1000}) or end what listens there (ss -ltnp)."], out.stderr
    assert "Traceback" not in out.stderr and "never runs" not in out.stdout



def test_protocol_probe_gives_tensorflows_reason_and_nothing_for_grpc() -> None:
    """The probe behind ``--protocol`` (run on every task before anything starts, with a
    server's imports only) gives TensorFlow's reason for a protocol the build lacks, and
    nothing for grpc."""
    from keras_distrib.launcher.prestart import protocol_error

    reason = protocol_error("grpc+verbs")
    assert reason is not None and "GRPC_SERVER" in reason, reason
    assert protocol_error("grpc") is None
