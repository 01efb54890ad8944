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
  the sockets that appeared then and have a peer, less the rendezvous store's. Every
  gloo group has connections of its own, so the groups an attempt forms later (a device
  mesh's dimensions, peer memory's, the checkpointer's) are recorded into the same record
  as they form (`group_forming`): a pipeline stage blocked in a send to a lost stage, or
  a rank blocked in a peer-memory exchange, is freed like one blocked on the default group.

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
    """The TCP connections of an attempt's process groups (gloo) in this process: the
    default group's, and those of the groups formed after it (`group_forming`)."""

    store_port: int | None = None
    connections: dict[int, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _released: bool = False

    @classmethod
    @contextlib.contextmanager
    def opened(cls, *, store_port: int | None) -> Iterator[GroupSockets]:
        """Around the default group's creation (gloo connects every pair as the group
        forms): yields the record, filled when the block ends, and the one that later
        groups of this attempt join while it is `current` (see `attempt_groups`)."""
        group = cls(store_port=store_port)
        with group.recording():
            yield group

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The connections opened during the block are this record's."""
        before = open_sockets()
        try:
            yield
        finally:
            self.add(new_connections(before, open_sockets(), store_port=self.store_port))

    def add(self, connections: dict[int, str]) -> None:
        """Record more connections; shut at once if the record was already released
        (a group formed after the release would otherwise block its rank anew)."""
        with self._lock:
            self.connections.update(connections)
            released = self._released
        if released:
            self._shut(connections)

    def release(self) -> int:
        """Shut the recorded connections down (once); how many were. Any thread."""
        with self._lock:
            if self._released:
                return 0
            self._released = True
            return self._shut(self.connections)

    @staticmethod
    def _shut(connections: dict[int, str]) -> int:
        done = 0
        current = open_sockets()
        for fd, inode in connections.items():
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


# The record of the attempt running in this process (a pooled process runs one at a time),
# for the groups its loop forms after the default one.
_current: GroupSockets | None = None
_current_lock = threading.Lock()


@contextlib.contextmanager
def attempt_groups(sockets: GroupSockets) -> Iterator[None]:
    """While the attempt runs: the groups it forms join `sockets` (`group_forming`)."""
    global _current
    with _current_lock:
        _current = sockets
    try:
        yield
    finally:
        with _current_lock:
            if _current is sockets:
                _current = None


@contextlib.contextmanager
def group_forming() -> Iterator[None]:
    """Around the creation of a group after the default one (every rank of the attempt
    calls it at the same point, as group creation requires): its connections join the
    running attempt's record, so a release frees a collective blocked on it too. Outside
    an attempt run by the launcher glue (a test calling the loop directly) it records
    nothing."""
    with _current_lock:
        current = _current
    if current is None:
        yield
        return
    with current.recording():
        yield


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
