"""Reachability of TCP addresses, shared by the launcher and the cluster check (stdlib only)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterable


def is_ip_address(host: str) -> bool:
    """True for a literal IPv4/IPv6 address, False for a host name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_listening(address: str, timeout: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def wait_reachable(addresses: Iterable[str], timeout: float, poll: float = 0.2,
                   stop: threading.Event | None = None) -> list[str]:
    """Poll until every address accepts a TCP connection; return those that never did.
    ``stop``: set, the poll ends at its next round (its caller has ended)."""
    stop = stop or threading.Event()
    pending = list(dict.fromkeys(addresses))
    deadline = time.monotonic() + timeout
    while pending and not stop.is_set():
        pending = [a for a in pending if not is_listening(a, timeout=min(1.0, timeout))]
        if not pending or time.monotonic() >= deadline:
            break
        stop.wait(poll)
    return pending
