"""Error kinds: named where a failure is caught, stored with it, read back from old rows."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from contracts.messages import ErrorKind, WorkerError
from workers.errors import error_kind
from workers.workloads import WorkloadError

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
