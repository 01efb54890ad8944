"""A hang inside a collective, made from outside: every TCP packet between one rank's
process and its peers' processes dropped on the loopback device, while all of them stay
alive, answer Ray and answer the runtime's polls. Their gloo pairs (and the store's
connections, when one end hosts it) stop delivering: a rank blocked in an allreduce waits
for bytes that never come, as on an NCCL collective that never returns.

    with cut_between(rank_pid, peer_pids) as cut:   # a `tc` filter per direction
        ...                                         # removed on exit, whatever happened

The connections are found from /proc (each process's socket inodes, the namespace's
/proc/<pid>/net/tcp{,6} table): exactly the connections with one end in the rank's
process and the other in a peer's, nothing else on `lo`. Every cluster node of
`ray.cluster_utils.Cluster` is on this machine, so all that traffic crosses `lo`.

How the packets go nowhere: a `u32` filter on `lo`'s egress (a `clsact` qdisc, which
queues nothing: the rest of `lo`'s traffic is untouched) per direction of each connection,
whose action redirects the packet into one end of a veth pair whose other end is down,
where it is dropped. (This kernel has no `gact`, the usual `action drop`, nor nftables or
iptables tools; `mirred` and veth are built in.) Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEVICE = "lo"
#: /proc/net/tcp's state column for an established connection.
ESTABLISHED = "01"
_SOCKET = re.compile(r"socket:\[(\d+)\]")


@dataclass(frozen=True, slots=True)
class Row:
    """One socket of /proc/net/tcp{,6}: its ends as the table writes them (hex ip:port)."""

    local: str
    remote: str
    inode: int
    ipv6: bool

    @property
    def local_port(self) -> int:
        return int(self.local.rsplit(":", 1)[1], 16)

    @property
    def remote_port(self) -> int:
        return int(self.remote.rsplit(":", 1)[1], 16)


def parse_table(text: str, *, ipv6: bool) -> list[Row]:
    """The established sockets of a /proc/net/tcp{,6} table."""
    rows = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == ESTABLISHED:
            rows.append(Row(fields[1], fields[2], int(fields[9]), ipv6))
    return rows


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            found = _SOCKET.fullmatch(os.readlink(fd))
        except OSError:  # closed since the listing
            continue
        if found:
            inodes.add(int(found[1]))
    return inodes


def tcp_rows(pid: int) -> list[Row]:
    """The established TCP sockets of the network namespace `pid` lives in."""
    rows = []
    for name, ipv6 in (("tcp", False), ("tcp6", True)):
        path = Path(f"/proc/{pid}/net/{name}")
        if path.exists():
            rows += parse_table(path.read_text(), ipv6=ipv6)
    return rows


def pairs_between(rows: list[Row], mine: set[int], theirs: set[int]) -> list[Row]:
    """The connections with one end among the inodes `mine` and the other among `theirs`:
    each as the `mine` end's row (its local end, its remote end)."""
    their_ends = {(r.local, r.remote) for r in rows if r.inode in theirs}
    return [r for r in rows if r.inode in mine and (r.remote, r.local) in their_ends]


def connections_between(pid: int, peers: list[int]) -> list[Row]:
    theirs: set[int] = set()
    for peer in peers:
        theirs |= socket_inodes(peer)
    return pairs_between(tcp_rows(pid), socket_inodes(pid), theirs)


def address(hex_end: str) -> str:
    """/proc/net/tcp{,6}'s hex address (32-bit words in host order: little-endian) as
    text."""
    words = hex_end.split(":")[0]
    raw = b"".join(bytes.fromhex(words[i : i + 8])[::-1] for i in range(0, len(words), 8))
    return str(ipaddress.ip_address(raw))


def drop_filters(row: Row, sink: str) -> list[list[str]]:
    """`tc filter` arguments (after `add dev lo egress pref N`) sending both directions of
    the connection `row` into the device `sink`."""
    filters = []
    for src, dst in ((row.local, row.remote), (row.remote, row.local)):
        sport, dport = str(int(src.rsplit(":", 1)[1], 16)), str(int(dst.rsplit(":", 1)[1], 16))
        family, bits = ("ip6", 128) if row.ipv6 else ("ip", 32)
        match = [
            "match", family, "src", f"{address(src)}/{bits}",
            "match", family, "dst", f"{address(dst)}/{bits}",
            "match", family, "sport", sport, "0xffff", "match", family, "dport", dport, "0xffff",
        ]  # fmt: skip
        protocol = "ipv6" if row.ipv6 else "ip"
        redirect = ["action", "mirred", "egress", "redirect", "dev", sink]
        filters.append(["protocol", protocol, "u32", *match, *redirect])
    return filters


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def _tc(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run("tc", *argv, check=check)


@contextmanager
def black_hole() -> Iterator[str]:
    """A device that drops what is sent into it: a veth end whose peer is down (its name;
    the pair deleted on exit)."""
    tag = secrets.token_hex(3)
    sink, peer = f"ecut{tag}a", f"ecut{tag}b"
    _run("ip", "link", "add", sink, "type", "veth", "peer", "name", peer)
    try:
        _run("ip", "link", "set", sink, "up")
        yield sink
    finally:
        _run("ip", "link", "del", sink, check=False)


@contextmanager
def cut_between(pid: int, peers: list[int]) -> Iterator[list[str]]:
    """Drop every packet between `pid`'s process and the `peers`' on `lo` until exit;
    yields the connections cut ("local port<->remote port"), empty when there are none.
    Adds `lo`'s clsact qdisc when it has none (removed again on exit) and its own filters
    under a preference of its own (removed on exit whatever happened)."""
    rows = connections_between(pid, peers)
    if not rows:
        yield []
        return
    with black_hole() as sink:
        # (Fails where lo already has one: then its filters are shared, ours kept apart.)
        added_qdisc = _tc("qdisc", "add", "dev", DEVICE, "clsact", check=False).returncode == 0
        # One preference per protocol (tc keeps one protocol to a preference), apart from
        # another user's of lo.
        first = random.randrange(40_000, 49_000, 2)
        prefs = {False: str(first), True: str(first + 1)}
        try:
            for row in rows:
                for spec in drop_filters(row, sink):
                    _tc("filter", "add", "dev", DEVICE, "egress", "pref", prefs[row.ipv6], *spec)
            yield [f"{r.local_port}<->{r.remote_port}" for r in rows]
        finally:
            for pref in prefs.values():
                _tc("filter", "del", "dev", DEVICE, "egress", "pref", pref, check=False)
            if added_qdisc and not _tc("filter", "show", "dev", DEVICE, "egress").stdout.strip():
                _tc("qdisc", "del", "dev", DEVICE, "clsact", check=False)
