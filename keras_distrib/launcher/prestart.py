"""Checks of this machine made before anything starts (no TensorFlow imported here)."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys

from cluster_parsers import ClusterConfigError

from ..contract import LOG_LEVEL_VAR


def protocol_error(protocol: str) -> str | None:
    """None when this TensorFlow build can serve ``protocol``, else TensorFlow's reason.

    Probed in a child process so TensorFlow's start-up logging stays out of our output,
    with a server's imports only (`server_runtime`: about 1 CPU s instead of 6 for the
    whole ``import tensorflow``, on every task before anything starts).
    """
    probe = (
        "import sys\n"
        "from keras_distrib.servers import skip_optional_imports\n"
        "from keras_distrib._private_apis import server_runtime\n"
        "skip_optional_imports()\n"
        "server, cluster_spec, _ = server_runtime()\n"
        "try:\n"
        "    server(cluster_spec({'probe': ['localhost:0']}), job_name='probe', task_index=0, protocol=sys.argv[1],\n"
        "           start=False)\n"
        "except Exception as exc:\n"
        "    print(exc)\n"
        "    sys.exit(1)\n"
    )
    env = {**os.environ, LOG_LEVEL_VAR: "3"}
    result = subprocess.run([sys.executable, "-c", probe, protocol], env=env, capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stdout or result.stderr).strip()


def require_protocol(protocol: str) -> None:
    """Fail before anything starts when the TensorFlow build lacks ``protocol``."""
    if protocol == "grpc":
        return
    reason = protocol_error(protocol)
    if reason is None:
        return
    factories = re.search(r"available server factories are: \[([^\]]*)\]", reason)
    available = factories.group(1).strip() if factories else reason.splitlines()[-1]
    raise ClusterConfigError(
        f"--protocol {protocol!r} is not supported by this TensorFlow build (available server factories: {available}).",
        "stock TensorFlow only has grpc; for RDMA use --layout allreduce, whose NCCL collectives use "
        "InfiniBand/RoCE when present (tune with NCCL_IB_HCA, NCCL_SOCKET_IFNAME).",
    )


def taken_port(port: int) -> bool:
    """True when another socket already listens on ``port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def require_free_ports(ports: dict[int, str], node: str, also: str = "") -> None:
    """Fail before anything starts when a port of the plan is taken on this node (``also``:
    what else the message says, e.g. that no fallback block is free either).

    TensorFlow would otherwise end in "UnknownError: Could not start gRPC server" with
    the reason in a separate log line.
    """
    taken = {port: who for port, who in ports.items() if taken_port(port)}
    if taken:
        listing = ", ".join(f"{port} ({who})" for port, who in sorted(taken.items()))
        raise ClusterConfigError(
            f"port(s) {listing} already in use on {node}." + (f" {also}" if also else ""),
            f"pass another --port-base (e.g. --port-base {min(ports) + 1000}) or end what listens there (ss -ltnp).",
        )
