"""The runtime: one long-lived, detached Ray actor that runs every attempt of every job.

It holds the warm worker pool (`service.launcher.pool`) and one `AttemptDriver` per
running attempt. The control plane's `RayLauncher` talks to it with a few calls per
scheduler pass (one `drain` for all attempts at once); rank 0 of each worker group pushes
its messages to it. A start, recovery or resize therefore creates no driver process, no
controller and, while warm processes last, no worker process: it reserves resources,
hands ranks to processes that are already up, and forms a new process group.

If the runtime itself dies, Ray restarts it: the new one adopts the worker processes
(they keep what they hold), and the scheduler sees every attempt as lost and relaunches
them, from the survivors' memory where they hold the state.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from contracts.group import WorkerInfo
from contracts.messages import Control, DriverReport, WorkerMessage
from service.launcher.base import LaunchRequest
from service.launcher.driver import AttemptDriver
from service.launcher.pool import WorkerPool

log = logging.getLogger("elastrain.runtime")

RUNTIME_NAME = "elastrain-runtime"
#: Idle processes are pinged every this many upkeep passes (a dead one is replaced).
_PING_EVERY = 4

Key = tuple[int, int]


class Runtime:
    """Wrapped with `ray.remote` (threaded: drivers and calls run concurrently)."""

    def __init__(
        self,
        *,
        namespace: str,
        warm_per_node: int,
        collective_timeout_s: float,
        upkeep_interval_s: float = 0.5,
    ) -> None:
        self.namespace = namespace
        self.collective_timeout_s = collective_timeout_s
        self.upkeep_interval_s = upkeep_interval_s
        self.pool = WorkerPool(namespace=namespace, warm_per_node=warm_per_node)
        self.drivers: dict[Key, AttemptDriver] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._upkeep, name="pool-upkeep", daemon=True).start()

    def ping(self) -> bool:
        return True

    # -- the scheduler's calls -----------------------------------------------------------------
    def launch(self, request: LaunchRequest) -> None:
        key = (request.job_id, request.attempt)
        with self._lock:
            if key in self.drivers:
                return  # launched already (a retried call)
            self.drivers[key] = AttemptDriver(
                request,
                pool=self.pool,
                runtime_name=RUNTIME_NAME,
                namespace=self.namespace,
                collective_timeout_s=self.collective_timeout_s,
            )

    def drain(self, acks: dict[Key, int]) -> dict[Key, DriverReport | None]:
        """Every asked-for attempt's report (None: this runtime does not know it)."""
        with self._lock:
            drivers = {key: self.drivers.get(_key(key)) for key in acks}
        return {key: (d.drain(acks[key]) if d else None) for key, d in drivers.items()}

    def request(self, key: Key, control: Control) -> None:
        driver = self._driver(key)
        if driver is not None:
            driver.request_control(control)

    def release(self, key: Key, final: bool = False) -> None:
        with self._lock:
            driver = self.drivers.pop(_key(key), None)
        if driver is not None:
            driver.release()
        if final:
            self.pool.forget_job(key[0])

    def workers(self) -> list[WorkerInfo]:
        """The pool's processes that answered (for tests, benches and debugging)."""
        with self.pool.lock:
            return [w.info for w in self.pool.workers.values() if w.info is not None]

    # -- rank 0's calls ----------------------------------------------------------------------
    def push(self, key: Key, message: WorkerMessage) -> None:
        driver = self._driver(key)
        if driver is not None:  # else a released attempt: fenced off
            driver.push(message)

    def push_many(self, key: Key, messages: list[WorkerMessage]) -> None:
        """Several messages of rank 0, in order (what `RuntimeHooks` batches)."""
        driver = self._driver(key)
        if driver is not None:
            for message in messages:
                driver.push(message)

    def _driver(self, key: Key) -> AttemptDriver | None:
        with self._lock:
            return self.drivers.get(_key(key))

    # -- upkeep --------------------------------------------------------------------------------
    def _upkeep(self) -> None:
        passes = 0
        while True:
            try:
                self.pool.top_up(ray.nodes())
                passes += 1
                if passes % _PING_EVERY == 0:
                    self.pool.check_idle()
            except Exception:
                log.exception("pool upkeep")
            time.sleep(self.upkeep_interval_s)


def _key(key: Key) -> Key:
    """Keys arrive as tuples, lists or AttemptKeys, depending on how Ray pickled them."""
    job_id, attempt = key
    return (int(job_id), int(attempt))
