"""Free a rank blocked in a collective on a peer that is gone.

A peer whose process dies closes its sockets, and every collective waiting on it fails at
once. A peer cut off the network, or frozen, closes nothing: its partners wait in the
collective until its timeout (a minute), and the next attempt cannot use them meanwhile.
When the control plane has decided the peer is gone (it released the attempt), the rank's
process frees itself here:

- NCCL: abort the communicators (`ncclCommAbort`), the supported way.
- gloo: `ProcessGroupGloo.abort()` does not wake a thread blocked in a collective
  (torch 2.13), so the group's own TCP connections to its peers are shut down instead. The
  blocked read then fails as if the peer had closed them ("Connection closed by peer"), the
  collective raises, and the loop stops as on any peer loss, keeping its state. Which
  connections are the group's is recorded when the group forms (`GroupSockets.opened`):
  the sockets that appeared then and have a peer, less the rendezvous store's.

Shutting a connection down (not closing it) leaves the file descriptor to its owner, so
gloo later closes its own descriptors as usual and none can be reused under it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger("elastrain.workers.comm_release")


def open_sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> 'socket:[inode]' (Linux)."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    found[int(name)] = link
    return found


def new_connections(
    before: dict[int, str], after: dict[int, str], *, store_port: int | None
) -> dict[int, str]:
    """The descriptors in `after` that are not in `before` (same fd, same inode), are
    connected to a peer, and are not a connection of the rendezvous store (its port at
    either end)."""
    chosen: dict[int, str] = {}
    for fd, inode in after.items():
        if before.get(fd) == inode:
            continue
        ends = _ends(fd)
        if ends is None:
            continue  # listening, not TCP, or already gone
        local_port, peer_port = ends
        if store_port is not None and store_port in (local_port, peer_port):
            continue
        chosen[fd] = inode
    return chosen


def _ends(fd: int) -> tuple[int, int] | None:
    """(local port, peer port) of a connected TCP socket, else None. Never closes `fd`."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return int(sock.getsockname()[1]), int(sock.getpeername()[1])
    except OSError:
        return None  # not connected: a listening socket
    finally:
        sock.detach()


@dataclass
class GroupSockets:
    """The TCP connections of one process group (gloo) in this process."""

    connections: dict[int, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _released: bool = False

    @classmethod
    @contextlib.contextmanager
    def opened(cls, *, store_port: int | None) -> Iterator[GroupSockets]:
        """Around the group's creation (gloo connects every pair as the group forms):
        yields the record, filled when the block ends."""
        group = cls()
        before = open_sockets()
        yield group
        group.connections = new_connections(before, open_sockets(), store_port=store_port)

    def release(self) -> int:
        """Shut the group's connections down (once); how many were. Any thread."""
        with self._lock:
            if self._released:
                return 0
            self._released = True
            done = 0
            current = open_sockets()
            for fd, inode in self.connections.items():
                if current.get(fd) != inode:
                    continue  # closed meanwhile (and maybe reused): not ours any more
                with contextlib.suppress(OSError):
                    sock = socket.socket(fileno=fd)
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                        done += 1
                    finally:
                        sock.detach()
            return done


def release_group(sockets: GroupSockets | None) -> str:
    """Free whatever collective this process is blocked in on the default group; says how."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return "no group"
    if dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()  # ncclCommAbort on every communicator of the group
        return "aborted the NCCL communicators"
    count = sockets.release() if sockets is not None else 0
    return f"shut down {count} gloo connection(s)"
