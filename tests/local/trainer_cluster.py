"""Test helper: a small TensorFlow cluster on localhost.

`PsCluster` starts ps/worker `tf.distribute.Server`s as subprocesses (each with its own
TF_CONFIG) and gives the calling process the chief-side ParameterServerStrategy.
`run_workers` runs one script per worker with TF_CONFIG (the allreduce layout, where every
worker runs the user's script) and collects their outputs.

Only one ParameterServerStrategy can connect a process's eager context to a cluster, so a
test module shares one `PsCluster` (module-scoped fixture).
"""

from __future__ import annotations

import json
import os
import socket
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# The servers are the launcher's own (`python -m keras_distrib.servers` reads TF_CONFIG).
SERVER_ARGV = [sys.executable, "-m", "keras_distrib.servers"]


def free_ports(n: int) -> list[int]:
    """Ports the OS reports free now (held open together so they are distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def make_cluster_spec(num_workers: int, num_ps: int = 0, chief: bool = False) -> dict[str, list[str]]:
    ports = iter(free_ports(num_workers + num_ps + int(chief)))
    spec: dict[str, list[str]] = {}
    if chief:
        spec["chief"] = [f"localhost:{next(ports)}"]
    if num_ps:
        spec["ps"] = [f"localhost:{next(ports)}" for _ in range(num_ps)]
    spec["worker"] = [f"localhost:{next(ports)}" for _ in range(num_workers)]
    return spec


def task_env(spec: dict[str, list[str]], task_type: str, index: int, layout: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}}),
        KERAS_DISTRIB_LAYOUT=layout,
        CUDA_VISIBLE_DEVICES="",
        TF_CPP_MIN_LOG_LEVEL="2",
        # tests/local too: the scripts import its shared test modules (id_metrics).
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(HERE), env.get("PYTHONPATH", "")])),
    )
    return env


@dataclass
class PsCluster:
    """ps + worker servers as subprocesses; the calling process is the chief."""

    num_workers: int = 2
    num_ps: int = 2
    spec: dict[str, list[str]] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    _strategy: Any = None

    def start(self) -> "PsCluster":
        self.spec = make_cluster_spec(self.num_workers, self.num_ps, chief=True)
        for job in ("ps", "worker"):
            for i in range(len(self.spec[job])):
                self.procs.append(
                    subprocess.Popen(
                        SERVER_ARGV,
                        env=task_env(self.spec, job, i, "ps-per-node"),
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        return self

    def strategy(self) -> Any:
        """The chief's ParameterServerStrategy (created once; connects this process)."""
        if self._strategy is None:
            import tensorflow as tf

            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec(self.spec), task_type="chief", task_id=0, rpc_layer="grpc"
            )
            self._strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        return self._strategy

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        self.procs.clear()

    def __enter__(self) -> "PsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_script_cluster(
    script: str | Path,
    args: list[str],
    *,
    num_workers: int,
    num_ps: int = 0,
    layout: str = "allreduce",
    timeout: float = 240.0,
) -> list[subprocess.CompletedProcess]:
    """Run SCRIPT like the launcher would and return the finished user processes.

    allreduce: every worker runs SCRIPT. ps layouts: the chief runs SCRIPT, ps/worker
    processes run servers and are killed once the chief ends.
    """
    ps_layout = layout != "allreduce"
    spec = make_cluster_spec(num_workers, num_ps, chief=ps_layout)
    servers: list[subprocess.Popen] = []
    users: list[subprocess.Popen] = []
    try:
        if ps_layout:
            for job in ("ps", "worker"):
                for i in range(len(spec[job])):
                    servers.append(
                        subprocess.Popen(
                            SERVER_ARGV,
                            env=task_env(spec, job, i, layout),
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    )
            roles = [("chief", 0)]
        else:
            roles = [("worker", i) for i in range(num_workers)]
        for role, i in roles:
            users.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env={**task_env(spec, role, i, layout), "PYTHONFAULTHANDLER": "1"},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=str(REPO),
                )
            )
        deadline = time.monotonic() + timeout
        results = []
        for p in users:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # PYTHONFAULTHANDLER: SIGABRT writes every thread's Python stack to stderr.
                for q in users:
                    q.send_signal(signal.SIGABRT)
                _, err = p.communicate(timeout=60)
                raise AssertionError(f"{script} did not finish within {timeout:.0f} s; its stderr's end (the "
                                     f"stacks of its threads):\n{err[-12000:]}") from None
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        for p in servers + users:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def last_json_line(text: str) -> Any:
    """The last stdout line that parses as JSON (scripts report results that way)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON result line in output:\n{text[-3000:]}")
