"""A TensorFlow server under SIGTERM (preemption, scancel) keeps serving for its grace period,
so the chief can write its checkpoint, then exits with 128 + SIGTERM; it has not loaded the
optional packages (scikit-learn, matplotlib, jax) that ``import tensorflow`` pulls in, nor
TensorFlow's public API and Keras (`keras_distrib._private_apis.server_runtime`)."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher_utils import wait_for
from trainer_cluster import REPO, make_cluster_spec, task_env

pytestmark = pytest.mark.local

GRACE = 3.0


def test_sigterm_keeps_serving_for_the_grace_then_exits() -> None:
    installed_optional = [name for name in ("sklearn", "matplotlib", "jaxlib") if importlib.util.find_spec(name)]
    spec = make_cluster_spec(num_workers=1, num_ps=1)
    code = f"import keras_distrib.servers as s; s.TERM_GRACE = {GRACE}; s.main()"
    env = task_env(spec, "ps", 0, "ps-per-node")
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c", code], env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    try:
        # Lines until the server says it serves (EOF, if it dies, ends the loop).
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving ps:0" in line:
                break
        assert "serving ps:0" in lines[-1], "the server did not say it serves:\n" + "".join(lines[-30:])
        imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
        assert "tensorflow.python.training.server_lib" in imported
        assert not {"keras", "tensorflow._api.v2.compat", "tensorflow.lite"} & imported
        host, port = spec["ps"][0].split(":")
        # The optional packages Keras and TF Lite import when installed were not loaded.
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert [name for name in installed_optional if f"/{name}/" in maps] == []
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(GRACE / 3)
        with socket.create_connection((host, int(port)), timeout=5):
            pass  # still serving inside the grace period
        assert proc.poll() is None
        assert wait_for(lambda: proc.poll() is not None, 60), "the server outlived its grace period"
        assert proc.returncode == 128 + signal.SIGTERM
        assert time.monotonic() - sent >= GRACE - 0.5
    finally:
        proc.kill()
        proc.wait()
