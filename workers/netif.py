"""Which network interface carries this node's address, for gloo and NCCL.

gloo (and NCCL's bootstrap) pick the interface to listen on from the machine's hostname
unless told otherwise. Where the hostname resolves to another address than the one the
cluster reaches this node by (containers, network namespaces, several NICs), peers on other
nodes then cannot connect, and every collective times out. Ray knows the node's address;
this finds the interface that holds it, so the worker can name it (`GLOO_SOCKET_IFNAME`,
`NCCL_SOCKET_IFNAME`) unless the operator already did.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: get an interface's IPv4 address


def interface_with(address: str) -> str | None:
    """The name of the interface whose IPv4 address is `address` (Linux), else None."""
    try:
        interfaces = socket.if_nameindex()
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in interfaces:
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def pin_collectives_to(address: str) -> str | None:
    """Make gloo and NCCL use the interface holding `address` (this node's address as the
    cluster knows it), unless the operator chose one. Returns the interface set, if any."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    name = interface_with(address)
    if name is None:
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return name
