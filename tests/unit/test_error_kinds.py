"""Error kinds: named where a failure is caught, stored with it, read back from old rows."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastrain.checkpoints.dcp import CheckpointSaveError, ShardedCheckpointer
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


def raised_from(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


def implicitly_after(earlier: BaseException, exc: BaseException) -> BaseException:
    exc.__context__ = earlier
    return exc


def save_failed(cause: BaseException) -> BaseException:
    return raised_from(CheckpointSaveError(10, 1, Path("/ckpt/step_10"), cause), cause)


def dcp_failed(cause: BaseException) -> BaseException:
    return CheckpointException("planning failed", {1: (cause, traceback.StackSummary())})


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
        # A background save's collective lost the peer: the update that waited for it
        # raises CheckpointSaveError from gloo's error, or from DCP's gathered failures.
        (save_failed(RuntimeError(GLOO_CLOSED)), ErrorKind.PEER_LOST),
        (save_failed(dcp_failed(RuntimeError(GLOO_RESET))), ErrorKind.PEER_LOST),
        (save_failed(OSError(28, "No space left on device")), ErrorKind.RAISED),
        (save_failed(dcp_failed(OSError(28, "No space left on device"))), ErrorKind.RAISED),
        (raised_from(ValueError("bad batch"), ValueError("worse")), ErrorKind.RAISED),
        # Only an explicit cause: an error raised while handling a peer loss is its own.
        (implicitly_after(RuntimeError(GLOO_CLOSED), ValueError("bad")), ErrorKind.RAISED),
    ],
)
def test_error_kind(exc: BaseException, kind: ErrorKind) -> None:
    assert error_kind(exc) == kind


def _join_group(rank: int, port: int) -> None:
    """In a spawned rank: join the two-rank gloo group whose store listens at `port`."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)


def _report(kinds: Any, what: str) -> None:
    """In a spawned rank: send `what`, delivered before the hard exit (no gloo teardown
    to hang in)."""
    kinds.put(what)
    kinds.close()
    kinds.join_thread()
    os._exit(0)


def _reported_by_two_ranks(target: Any, *args: Any) -> str:
    """Run `target(rank, store_port, *args, queue)` in two spawned processes; the first
    thing either reports."""
    spawn = mp.get_context("spawn")
    kinds = spawn.Queue()
    store = host_store("127.0.0.1", 2, timedelta(seconds=60))  # listening before the ranks
    ranks = [spawn.Process(target=target, args=(r, store.port, *args, kinds)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        return str(kinds.get(timeout=120))
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()


def _rank(rank: int, port: int, ddp: bool, kinds: Any) -> None:
    """Rank 1 exits after two steps; rank 0 reports the kind of what its next step raised."""
    _join_group(rank, port)
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
            _report(kinds, error_kind(exc).value)
    _report(kinds, "no error")


@pytest.mark.parametrize("ddp", [False, True], ids=["all_reduce", "ddp_backward"])
def test_a_real_gloo_peer_loss_is_peer_lost(ddp: bool) -> None:
    # What gloo raises here is what `_GLOO_PEER_GONE` must recognise, in this torch.
    assert _reported_by_two_ranks(_rank, ddp) == ErrorKind.PEER_LOST.value


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


@pytest.mark.parametrize(
    ("exc", "configuration"),
    [
        # The workload's own errors on first use: the same on every retry.
        (ValueError("bad sample"), True),
        (KeyError("label"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x4 and 8x1)"), True),
        (IndexError("index 70 is out of bounds"), True),
        # Not the workload's doing, or maybe not the same on a retry: left as they are.
        (RuntimeError(GLOO_RESET), False),
        (dist.DistNetworkError("recv failed"), False),
        (torch.OutOfMemoryError("CUDA out of memory"), False),
        (MemoryError(), False),
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), False),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"), False),
    ],
)
def test_what_the_workload_raises_on_first_use_is_a_configuration_error(
    exc: Exception, configuration: bool
) -> None:
    from elastrain.workers.errors import configuration_errors

    first_step = configuration_errors("workload: the job's first training step")
    with pytest.raises(Exception) as raised, first_step:
        raise exc
    if configuration:
        assert isinstance(raised.value, WorkloadError) and raised.value.__cause__ is exc
        assert error_kind(raised.value) == ErrorKind.CONFIGURATION
        assert str(raised.value).startswith(
            f"workload: the job's first training step raised {type(exc).__name__}: "
        )
    else:
        assert raised.value is exc


def test_a_workload_error_passes_through_unchanged() -> None:
    from elastrain.workers.errors import configuration_errors

    original = WorkloadError("workload.params.x: unknown")
    with pytest.raises(WorkloadError) as raised, configuration_errors("anything"):
        raise original
    assert raised.value is original


def _saving_rank(rank: int, port: int, root: str, kinds: Any) -> None:
    """Both ranks make a checkpointer; rank 1 exits; rank 0's async save then plans
    without it, and the loop's next look at it (the update's wait for the staging copy,
    then the poll for commits) reports the kind of what it got."""
    _join_group(rank, port)
    checkpointer = ShardedCheckpointer(Path(root), rank=rank, world_size=2, async_save=True)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    state = {"w": torch.ones(1000)}
    checkpointer.save(step=1, attempt=0, state=state, manifest_fields={})
    try:
        checkpointer.wait_staged()
        checkpointer.finalize()
    except Exception as exc:
        _report(kinds, f"{error_kind(exc).value} {type(exc).__name__}")
    _report(kinds, "no error")


def test_a_save_that_lost_its_peer_fails_the_update_as_peer_lost(tmp_path: Path) -> None:
    """The survivor's async save's planning collective lost the peer: the error it raises is the peer's loss (not the job's fault, no restart
    counted, its state handed on), not a failure of its own."""
    reported = _reported_by_two_ranks(_saving_rank, str(tmp_path))
    assert reported == f"{ErrorKind.PEER_LOST.value} CheckpointSaveError"
