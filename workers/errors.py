"""What kind of failure a rank's exception is, decided where it was caught.

The driver and the scheduler decide on `elastrain.contracts.messages.ErrorKind` alone; this module is
the one place that looks at an exception to name its kind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastrain.contracts.messages import ErrorKind
from elastrain.workers.compiling import is_compile_error
from elastrain.workers.workloads import WorkloadError

#: Words gloo's transport puts in the error a rank gets when a peer of its collective went
#: away (closed its end, reset the connection, stopped answering).
_GLOO_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
)


def error_kind(exc: BaseException) -> ErrorKind:
    """The kind of `exc`, caught from a rank's training: a workload that cannot be built is
    a configuration error; a collective broken by a peer that went away is an echo of that
    peer's failure (PEER_LOST), and so is an error raised from one (`raise ... from`): a
    background checkpoint save whose collectives lost that peer fails the next update
    with a CheckpointSaveError; anything else the workload or the loop raised (RAISED)."""
    if isinstance(exc, WorkloadError):
        return ErrorKind.CONFIGURATION
    if any(_is_peer_gone(cause) for cause in _causes(exc)):
        return ErrorKind.PEER_LOST
    return ErrorKind.RAISED


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, what it was raised from, and so on; for DCP's CheckpointException, the
    failure it gathered from each rank."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if current.__cause__ is not None:
            pending.append(current.__cause__)
        if isinstance(current, CheckpointException):
            pending.extend(failure for failure, _ in current.failures.values())


def _is_peer_gone(exc: BaseException) -> bool:
    if isinstance(exc, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    return _is_gloo_peer_gone(exc)


def _is_gloo_peer_gone(exc: BaseException) -> bool:
    """Whether `exc` is gloo's report of a peer gone from a collective.

    Gloo raises a plain RuntimeError for it (not torch's DistNetworkError: its transport
    errors reach Python untranslated, in torch 2.13 for all-reduce and for DDP's backward
    alike), and nothing but its text tells it from any other RuntimeError. So the text is
    read here, once, at the source; everything downstream reads the kind.
    """
    if type(exc) is not RuntimeError:
        return False
    text = str(exc).lower()
    return "gloo" in text and any(marker in text for marker in _GLOO_PEER_GONE)


#: Failures on a first use that may not come again on a retry: out of memory (another world
#: size shards the state thinner), and the device's own faults (a GPU that fell off the bus,
#: an ECC error: the retry runs on another device).
_NOT_THE_WORKLOADS = (torch.OutOfMemoryError, MemoryError, torch.AcceleratorError)
_DEVICE_FAULT_WORDS = ("cuda error", "cudnn_status", "cublas_status", "nccl")


@contextlib.contextmanager
def configuration_errors(what: str) -> Iterator[None]:
    """What the workload's own code raises in here is a configuration error (`what` raised
    it): code that fails on its first use fails the same way on every retry, so the job
    fails at once with its message instead of burning its restarts.

    Used around building the workload and its first use: the dataset's length and first
    sample, and the job's first training step (the first forward, loss and backward on
    real samples). Left as they are: a peer gone from a collective (PEER_LOST: an echo of
    another failure), running out of memory and the device's faults (a retry may not meet
    them)."""
    try:
        yield
    except WorkloadError:
        raise
    except Exception as exc:
        if error_kind(exc) != ErrorKind.RAISED or _may_pass(exc):
            raise
        if is_compile_error(exc):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise WorkloadError(
                f"training.compile: {what} did not compile ({type(exc).__name__}: {first}); "
                "set training.compile: false"
            ) from exc
        raise WorkloadError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _may_pass(exc: BaseException) -> bool:
    if isinstance(exc, _NOT_THE_WORKLOADS):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _DEVICE_FAULT_WORDS)


#: Exception names whose line ends a script's traceback when a peer of its collective
#: went away.
_PEER_GONE_TYPES = ("DistNetworkError", "DistBackendError", "DistStoreError")


def script_error_kind(stderr_tail: str) -> ErrorKind:
    """The kind of a command job's script that exited non-zero, from the last line of its
    stderr (its traceback's): a collective broken by a peer that went away (PEER_LOST, an
    echo of that peer's failure), else an error of the script's own (RAISED)."""
    lines = [ln.strip() for ln in stderr_tail.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if last.split(":")[0].rsplit(".", 1)[-1] in _PEER_GONE_TYPES:
        return ErrorKind.PEER_LOST
    lowered = last.lower()
    if "gloo" in lowered and any(marker in lowered for marker in _GLOO_PEER_GONE):
        return ErrorKind.PEER_LOST
    return ErrorKind.RAISED
