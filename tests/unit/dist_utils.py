"""Run a function in N torch.distributed (gloo, CPU) processes, for tests and benches.

    def body(rank: int, world_size: int, root: str) -> float:
        ...  # torch.distributed is initialised here (gloo, 127.0.0.1)
        return 1.0

    results = run_distributed(body, 2, str(tmp_path))  # [rank 0's return, rank 1's return]

`fn` must be importable by name from a fresh interpreter (a module-level function), because
the ranks are not forked from the caller (forking a process that holds torch threads or Ray
state is unsafe) but from a forkserver: a clean process that has only imported what every
rank imports (PRELOAD), so a group starts in ~0.1 s instead of the 2-4 s each spawned rank
spent importing torch on 2 cores (most of the unit suite's distributed tests' time). Each
rank gets the caller's environment as it is at the call, as a spawned one would. Arguments
and return values must be picklable.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastrain.workers.rendezvous import host_store

#: Imported once by the forkserver; every rank starts with them loaded. Only imports: the
#: server runs no torch op, so it holds no thread pool a fork could break.
PRELOAD = ["torch", "torch.distributed", "elastrain.workers.loop", "tests.unit.dist_utils"]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    result_dir: str,
    backend: str,
    num_threads: int,
    pg_timeout_s: float,
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    # The caller's environment now, not the forkserver's from when it started.
    os.environ.clear()
    os.environ.update(environ)
    # Loopback only: tests must not depend on the machine's network setup.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(num_threads)
    timeout = timedelta(seconds=pg_timeout_s)
    # The parent hosts the store (see run_distributed); every rank is its client.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        with open(Path(result_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        # Without a barrier a fast rank may tear down its gloo pairs while a slow one still
        # talks to it. Only on success: after a failure the peers may never get here, and
        # the parent terminates them once it sees this rank's error.
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    num_threads: int = 1,
    pg_timeout_s: float = 120.0,
    may_exit: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes with an
    initialised process group; return each rank's return value, by rank.

    A failure in any rank is raised here (torch's ProcessRaisedException carries the
    child's traceback); the other ranks are terminated. Exceeding `timeout_s` terminates
    every rank and raises TimeoutError (a hung collective must fail the test, not hang it).
    `may_exit`: a rank may end its process itself (`os._exit(0)`, as a lost node's ranks
    do in tests of node loss); its result is None.
    """
    # The rendezvous store listens from before the ranks start until after they end, on a
    # port the OS picked for it: a port picked free and bound only later by rank 0 could be
    # taken meanwhile (gloo's own connections use ports of the same ephemeral range).
    store = host_store("127.0.0.1", world_size, timedelta(seconds=pg_timeout_s))
    port = store.port
    # Takes effect when the server starts (the first call); later calls reuse it.
    multiprocessing.set_forkserver_preload(PRELOAD)
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="dist_utils-") as result_dir:
        ctx = mp.start_processes(
            _entry,
            args=(
                fn,
                world_size,
                port,
                result_dir,
                backend,
                num_threads,
                pg_timeout_s,
                args,
                environ,
            ),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join(5)
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout_s} s")
        results: list[Any] = []
        for rank in range(world_size):
            path = Path(result_dir) / f"{rank}.pkl"
            if may_exit and not path.exists():
                results.append(None)
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results
