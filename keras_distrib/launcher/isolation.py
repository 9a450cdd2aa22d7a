"""Local mode's private network: the job's ports reachable from this machine's job only.

TensorFlow's servers listen on every interface and have no option to bind to one, and
they run whatever graph a peer sends. In local mode every process is on this machine,
so the agent moves itself (before starting anything) into a new network namespace,
owned by a new user namespace so no privilege is needed: its children inherit a
network with only a loopback interface. No other address, on this machine or another,
can reach their ports; they can reach nothing outside either (no Internet downloads).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class IsolationUnavailable(OSError):
    """This machine does not let an unprivileged process create a network namespace."""


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _loopback_up() -> None:
    """`ip link set lo up`, with an ioctl (a new namespace's lo starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def isolate_network() -> None:
    """Move this (single-threaded) process into a private network namespace with loopback up.

    The user id stays the same inside (files keep their owner). Raises
    IsolationUnavailable with the reason when the kernel or its settings refuse.
    """
    uid, gid = os.geteuid(), os.getegid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise IsolationUnavailable(errno, f"unshare: {os.strerror(errno)}")
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _loopback_up()
    except OSError as exc:
        raise IsolationUnavailable(exc.errno or 0, f"setting up the namespace: {exc.strerror or exc}") from None
