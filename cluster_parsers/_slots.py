"""Turning one-line-per-slot host files into nodes, slot counts and a task's place."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from .base import ClusterConfigError


def read_host_file(var: str, path: str, hint: str) -> list[str]:
    """Lines of the host file named by ``var``, with a clear error when unreadable."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ClusterConfigError(f"{var}={path!r} cannot be read ({exc.strerror}).", hint) from None
    except (UnicodeDecodeError, ValueError) as exc:  # binary junk, or a NUL byte in the path
        raise ClusterConfigError(f"{var}={path!r} is not a text file ({exc}).", hint) from None
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise ClusterConfigError(f"{var}={path!r} is empty.", hint)
    return lines


def group_slots(slot_hosts: Sequence[str]) -> tuple[list[str], list[int]]:
    """Unique hosts in first-seen order and how many slots each has (never sorted)."""
    counts: dict[str, int] = {}
    for host in slot_hosts:
        counts[host] = counts.get(host, 0) + 1
    return list(counts), list(counts.values())


def local_host_index(nodes: Sequence[str], env: Mapping[str, str]) -> int | None:
    """Index of this machine in ``nodes``, matching short or full host names."""
    # No getfqdn(): it asks DNS, which can take seconds on nodes with broken resolvers.
    names = {env.get("HOSTNAME", ""), socket.gethostname()}
    names |= {n.split(".")[0] for n in names}
    names.discard("")
    for index, node in enumerate(nodes):
        if node in names or node.split(".")[0] in names:
            return index
    return None

