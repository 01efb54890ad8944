"""tests/chaos/collective_cut.py's pure parts: reading /proc/net/tcp, pairing a rank's
connections with its peers', the tc filters that cut them; and the chaos bench's check for
two runners of one job (bench/chaos_bench.overlapping_attempts)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.chaos_bench import overlapping_attempts
from tests.chaos.collective_cut import Row, address, drop_filters, pairs_between, parse_table

# 127.0.0.1:47988 <-> 127.0.0.1:37427, both ends (inodes 11 and 22), a listener (state 0A)
# and a connection of the rank's to something else (inode 13, to port 6379).
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9233 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 10
   1: 0100007F:BB74 0100007F:9233 01 00000000:00000000 00:00000000 00000000     0        0 11
   2: 0100007F:9233 0100007F:BB74 01 00000000:00000000 00:00000000 00000000     0        0 22
   3: 0100007F:BB75 0100007F:18EB 01 00000000:00000000 00:00000000 00000000     0        0 13
"""


def test_parse_table_keeps_established_sockets() -> None:
    rows = parse_table(TCP, ipv6=False)
    assert [r.inode for r in rows] == [11, 22, 13]
    assert (rows[0].local_port, rows[0].remote_port) == (47988, 37427)


@pytest.mark.parametrize(
    ("mine", "theirs", "cut"),
    [
        ({11, 13}, {22}, [11]),  # the pair with the peer, not the rank's other connection
        ({22}, {11}, [22]),  # seen from the other end
        ({13}, {22}, []),  # no connection between them
        ({11}, set(), []),  # no peer
    ],
)
def test_pairs_between_takes_only_connections_to_a_peer(
    mine: set[int], theirs: set[int], cut: list[int]
) -> None:
    rows = parse_table(TCP, ipv6=False)
    assert [r.inode for r in pairs_between(rows, mine, theirs)] == cut


def test_drop_filters_cut_both_directions_of_exactly_that_connection() -> None:
    row = Row("0100007F:BB74", "0200007F:9233", 11, ipv6=False)
    there, back = drop_filters(row, "sink0")
    assert there == [
        "protocol", "ip", "u32",
        "match", "ip", "src", "127.0.0.1/32", "match", "ip", "dst", "127.0.0.2/32",
        "match", "ip", "sport", "47988", "0xffff", "match", "ip", "dport", "37427", "0xffff",
        "action", "mirred", "egress", "redirect", "dev", "sink0",
    ]  # fmt: skip
    assert back[3:11] == [
        "match",
        "ip",
        "src",
        "127.0.0.2/32",
        "match",
        "ip",
        "dst",
        "127.0.0.1/32",
    ]
    assert back[11:21] == [
        "match",
        "ip",
        "sport",
        "37427",
        "0xffff",
        "match",
        "ip",
        "dport",
        "47988",
        "0xffff",
    ]


def test_drop_filters_ipv6() -> None:
    # ::1 port 80 <-> ::ffff:127.0.0.1 port 443, as /proc/net/tcp6 writes them
    row = Row(
        "00000000000000000000000001000000:0050",
        "0000000000000000FFFF00000100007F:01BB",
        5,
        ipv6=True,
    )
    there, back = drop_filters(row, "sink0")
    assert there[:2] == ["protocol", "ipv6"]
    assert there[3:11] == [
        "match",
        "ip6",
        "src",
        "::1/128",
        "match",
        "ip6",
        "dst",
        "::ffff:7f00:1/128",
    ]
    assert there[11:21] == [
        "match",
        "ip6",
        "sport",
        "80",
        "0xffff",
        "match",
        "ip6",
        "dport",
        "443",
        "0xffff",
    ]
    assert back[5:7] == ["src", "::ffff:7f00:1/128"]


@pytest.mark.parametrize(
    ("hex_end", "text"),
    [
        ("0100007F:0050", "127.0.0.1"),
        ("0A00020F:0050", "15.2.0.10"),
        ("00000000000000000000000001000000:0050", "::1"),
        ("0000000000000000FFFF00000100007F:0050", "::ffff:7f00:1"),
    ],
)
def test_address_reads_proc_net_tcp(hex_end: str, text: str) -> None:
    assert address(hex_end) == text


def _points(*spans: tuple[int, float, float]) -> list[dict[str, Any]]:
    return [
        {"attempt": attempt, "wall_time": t, "step": 0}
        for attempt, start, end in spans
        for t in (start, end)
    ]


@pytest.mark.parametrize(
    ("points", "overlapping"),
    [
        (_points((1, 0.0, 10.0), (2, 12.0, 20.0)), 0),  # one after the other
        (_points((1, 0.0, 10.0), (2, 9.0, 20.0)), 1),  # the second trained before the first ended
        (_points((1, 0.0, 10.0), (2, 12.0, 20.0), (3, 15.0, 30.0)), 1),
        ([], 0),
    ],
)
def test_overlapping_attempts(points: list[dict[str, Any]], overlapping: int) -> None:
    assert overlapping_attempts(points) == overlapping
