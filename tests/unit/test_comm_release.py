"""A rank blocked in a collective on a peer that is gone but closed nothing (cut off the
network, or frozen) is freed at once by `elastrain.workers.comm_release`, and its process can form
the next group: blocked on the default group, or on a group formed after it (a mesh
dimension's, peer memory's), in a collective or a point-to-point receive (a pipeline stage
waiting for its neighbour). Real gloo groups in real processes; the peer is frozen with
SIGSTOP."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest

from elastrain.workers.comm_release import (
    GroupSockets,
    attempt_groups,
    group_forming,
    new_connections,
    open_sockets,
)
from elastrain.workers.rendezvous import host_store


def test_only_the_new_connected_sockets_outside_the_store_are_the_groups() -> None:
    store = socket.create_server(("127.0.0.1", 0))
    store_port = store.getsockname()[1]
    before = open_sockets()
    listener = socket.create_server(("127.0.0.1", 0))
    pair = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    to_store = socket.create_connection(("127.0.0.1", store_port))
    try:
        chosen = new_connections(before, open_sockets(), store_port=store_port)
        assert set(chosen) == {pair.fileno(), accepted.fileno()}
        assert new_connections(open_sockets(), open_sockets(), store_port=None) == {}
    finally:
        for s in (store, listener, pair, accepted, to_store):
            s.close()


def _rank(rank: int, port: int, out: Any, blocked_in: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    timeout = datetime.timedelta(seconds=60)  # what a blocked rank would otherwise wait
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    with GroupSockets.opened(store_port=port) as sockets:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    with attempt_groups(sockets), group_forming():  # as the loop forms its later groups
        later = dist.new_group(backend="gloo", timeout=timeout)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t, group=later)
    t.fill_(1.0)
    if rank == 1:
        out.put(("frozen", os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    out.put(("connections", len(sockets.connections)))
    time.sleep(0.5)  # rank 1 is frozen by now: this collective can never complete
    released_at: list[float] = []

    def control_plane_decides() -> None:
        time.sleep(0.5)
        released_at.append(time.monotonic())
        sockets.release()

    threading.Thread(target=control_plane_decides, daemon=True).start()
    try:
        if blocked_in == "default group":
            dist.all_reduce(t)
        elif blocked_in == "later group":
            dist.all_reduce(t, group=later)
        else:  # a pipeline stage waiting for its neighbour's activations
            dist.recv(t, src=1, group=later)
        out.put(("completed", None))
    except RuntimeError as exc:
        out.put(("freed_after_s", time.monotonic() - released_at[0]))
        out.put(("error", str(exc)[:200]))
    dist.destroy_process_group()
    # The process is fine: it forms the next group (here alone).
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    alone = torch.full((4,), 3.0)
    dist.all_reduce(alone)
    out.put(("next_group", float(alone[0])))
    dist.destroy_process_group()


@pytest.mark.parametrize("blocked_in", ["default group", "later group", "later group, recv"])
def test_a_rank_blocked_on_a_frozen_peer_is_freed_within_two_seconds(blocked_in: str) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = host_store("127.0.0.1", 2, datetime.timedelta(seconds=60))
    ranks = [ctx.Process(target=_rank, args=(r, store.port, out, blocked_in)) for r in range(2)]
    for p in ranks:
        p.start()
    got: dict[str, Any] = {}
    try:
        while "next_group" not in got and "completed" not in got:
            key, value = out.get(timeout=120)
            got[key] = value
        ranks[0].join(timeout=60)
        assert ranks[0].exitcode == 0
    finally:
        if "frozen" in got:
            os.kill(got["frozen"], signal.SIGKILL)
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    assert "completed" not in got
    assert got["connections"] >= 2  # the default group's and the later group's
    assert got["freed_after_s"] < 2.0, got
    assert "closed" in got["error"].lower() or "connection" in got["error"].lower(), got
    assert got["next_group"] == pytest.approx(3.0)  # all-reduced alone
