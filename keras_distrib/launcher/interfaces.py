"""This node's network interfaces: the IPv4 address behind --interface (stdlib only)."""

from __future__ import annotations

import fcntl
import socket
import struct

from cluster_parsers import ClusterConfigError

_SIOCGIFADDR = 0x8915


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def interface_ipv4(name: str, node: str = "this node") -> str:
    """The IPv4 address of interface ``name``; the error lists the interfaces there are."""
    if name not in interface_names():
        raise ClusterConfigError(
            f"--interface {name!r} does not exist on {node}.",
            f"choose one of this node's interfaces: {', '.join(interface_names())}.",
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            raise ClusterConfigError(
                f"--interface {name!r} on {node} has no IPv4 address.",
                f"choose an interface with an IPv4 address among: {', '.join(interface_names())}.",
            ) from None
    return socket.inet_ntoa(packed[20:24])
