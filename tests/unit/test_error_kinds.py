"""Error kinds: named where a failure is caught, stored with it, read back from old rows."""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastrain.contracts.messages import ErrorKind, WorkerError
from elastrain.workers.errors import error_kind
from elastrain.workers.rendezvous import host_store
from elastrain.workers.workloads import WorkloadError

# What gloo raised in torch 2.13 on CPU to the surviving rank when its peer's process
# exited mid all-reduce, and mid DDP backward (the same text; a plain RuntimeError).
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:7568: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application. Check the logs of the remote worker before "
    "reporting an error. GLHF!"
)
GLOO_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:1234"
)
GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
    "1800000ms for recv operation to complete"
)


class PeerResetError(RuntimeError):
    """A workload's own RuntimeError subclass: not gloo's, whatever it says."""


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (WorkloadError("workload.params.x: unknown"), ErrorKind.CONFIGURATION),
        (RuntimeError(GLOO_RESET), ErrorKind.PEER_LOST),
        (RuntimeError(GLOO_CLOSED), ErrorKind.PEER_LOST),
        (RuntimeError(GLOO_TIMEOUT), ErrorKind.PEER_LOST),
        (dist.DistNetworkError("recv failed"), ErrorKind.PEER_LOST),
        (dist.DistBackendError("NCCL communicator was aborted"), ErrorKind.PEER_LOST),
        (ValueError("bad batch"), ErrorKind.RAISED),
        (RuntimeError("CUDA out of memory"), ErrorKind.RAISED),
        # The workload's own text about a peer is not gloo's: still its error.
        (RuntimeError("connection reset by peer while reading s3://bucket"), ErrorKind.RAISED),
        (PeerResetError(GLOO_RESET), ErrorKind.RAISED),
        (ConnectionResetError("Connection reset by peer"), ErrorKind.RAISED),
    ],
)
def test_error_kind(exc: BaseException, kind: ErrorKind) -> None:
    assert error_kind(exc) == kind


def _rank(rank: int, port: int, ddp: bool, kinds: Any) -> None:
    """Rank 1 exits after two steps; rank 0 reports the kind of what its next step raised."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4)) if ddp else None
    for step in range(50):
        if rank == 1 and step == 2:
            os._exit(0)  # the peer's process is gone: no goodbye
        try:
            if model is not None:
                model(torch.randn(2, 4)).sum().backward()
            else:
                dist.all_reduce(torch.ones(1000))
        except Exception as exc:
            kinds.put(error_kind(exc).value)
            kinds.close()
            kinds.join_thread()  # delivered before the hard exit (no gloo teardown to hang in)
            os._exit(0)
    kinds.put("no error")


@pytest.mark.parametrize("ddp", [False, True], ids=["all_reduce", "ddp_backward"])
def test_a_real_gloo_peer_loss_is_peer_lost(ddp: bool) -> None:
    # What gloo raises here is what `_GLOO_PEER_GONE` must recognise, in this torch.
    spawn = mp.get_context("spawn")
    kinds = spawn.Queue()
    store = host_store("127.0.0.1", 2, timedelta(seconds=60))  # listening before the ranks
    ranks = [spawn.Process(target=_rank, args=(r, store.port, ddp, kinds)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        assert kinds.get(timeout=120) == ErrorKind.PEER_LOST.value
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_the_kind_survives_the_database() -> None:
    error = WorkerError.from_exception(
        WorkloadError("boom"), kind=ErrorKind.CONFIGURATION, rank=1, step=4
    )
    assert error.type == "WorkloadError"  # the class name stays, for people
    assert WorkerError.from_dict(error.to_dict()) == error


@pytest.mark.parametrize(
    ("row", "kind"),
    [
        # Rows stored before errors had a kind: the type name they used stands for it.
        ({"type": "WorkloadError", "message": "m"}, ErrorKind.CONFIGURATION),
        ({"type": "WorkerDied", "message": "m"}, ErrorKind.PROCESS_DIED),
        ({"type": "DriverLost", "message": "m"}, ErrorKind.DRIVER_LOST),
        ({"type": "ValueError", "message": "m"}, ErrorKind.RAISED),
        ({}, ErrorKind.RAISED),
        ({"type": "ValueError", "kind": "from-a-newer-version"}, ErrorKind.RAISED),
        ({"type": "WorkloadError", "kind": "raised"}, ErrorKind.RAISED),  # stored kind wins
    ],
)
def test_old_rows_load_with_a_kind(row: dict, kind: ErrorKind) -> None:
    assert WorkerError.from_dict(row).kind == kind
