"""The runtime: one long-lived, detached Ray actor that runs every attempt of every job.

It holds the warm worker pool (`elastrain.workers.runtime.pool`) and one `AttemptDriver` per live
attempt, which one loop (`elastrain.workers.runtime.attempts`) moves through its phases. The
control plane (`elastrain.service.runtime_client`) launches an attempt once and, every
scheduler pass, hands the runtime the attempts its database says are live (`reconcile`):
the runtime answers with their reports and lets go of everything else it holds (drivers,
the state processes keep of jobs that are over, placement groups nobody owns). Rank 0 of
each worker group pushes its messages here. A start, recovery or resize therefore creates
no driver process and, while warm processes last, no worker process: it reserves
resources, hands ranks to processes that are already up, and forms a new process group.

If the runtime itself dies, Ray restarts it: the new one adopts the worker processes
(they keep what they hold), and the control plane sees every attempt as lost and
relaunches them, from the survivors' memory where they hold the state.

It answers only its own (`elastrain.contracts.capability`): the control plane's calls carry
its control token, rank 0's reports its attempt's capability; anything else is refused and
logged (`elastrain.workers.runtime.guard`). Ray restarts it with the control key it was
created with.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import ray
from ray import PlacementGroupID
from ray.util.placement_group import PlacementGroup, remove_placement_group

from elastrain.contracts.capability import Keyring
from elastrain.contracts.group import WorkerInfo
from elastrain.contracts.messages import Control, WorkerMessage
from elastrain.contracts.runtime import (
    RUNTIME_NAME,
    AttemptKey,
    LaunchRequest,
    Reconcile,
    Reconciled,
)
from elastrain.workers.runtime.attempts import AttemptLoop
from elastrain.workers.runtime.driver import AttemptDriver
from elastrain.workers.runtime.guard import RefusalLog
from elastrain.workers.runtime.notice import NoticeWatchers
from elastrain.workers.runtime.placement import group_prefix
from elastrain.workers.runtime.pool import WorkerPool
from elastrain.workers.runtime.reconcile import (
    HeldAttempt,
    attempts_to_release,
    jobs_to_forget,
    orphan_groups,
)

log = logging.getLogger("elastrain.runtime")

#: Idle processes are pinged every this many upkeep passes (a dead one is replaced).
_PING_EVERY = 4
#: Placement groups are listed (a call to Ray's GCS) at most this often to find orphans,
#: and at once after a reconcile released something or on the runtime's first one.
_ORPHAN_SCAN_INTERVAL_S = 10.0


class Runtime:
    """Wrapped with `ray.remote` (threaded: the control plane's and rank 0's calls run
    concurrently with the attempt loop and the pool's upkeep)."""

    def __init__(
        self,
        *,
        control_key: bytes,
        namespace: str,
        warm_per_node: int,
        collective_timeout_s: float,
        upkeep_interval_s: float = 0.5,
        preemption_notice: str | None = None,
    ) -> None:
        self.keys = Keyring(control_key)
        self.refusals = RefusalLog("runtime")
        self.namespace = namespace
        self.collective_timeout_s = collective_timeout_s
        self.upkeep_interval_s = upkeep_interval_s
        self.pool = WorkerPool(
            namespace=namespace, warm_per_node=warm_per_node, token=self.keys.pool
        )
        self.notices = NoticeWatchers(preemption_notice, namespace)
        self.drivers: dict[AttemptKey, AttemptDriver] = {}
        self.attempts = AttemptLoop()  # also moves released drivers until their ranks are back
        self._lock = threading.Lock()
        self._scanned_at = float("-inf")
        self.attempts.start()
        threading.Thread(target=self._upkeep, name="pool-upkeep", daemon=True).start()

    # -- the control plane's calls ---------------------------------------------------------
    def owned_by(self, token: str) -> bool:
        """Whether `token` is this runtime's control token: a control plane whose key is
        not the one this runtime was created with (another database's) replaces it."""
        return self.keys.is_control(token)

    def _control(self, token: object, method: str, claimed: object = None) -> None:
        if not self.keys.is_control(token):
            raise self.refusals.refuse(method, claimed)

    def launch(self, token: str, request: LaunchRequest) -> None:
        self._control(token, "launch", getattr(request, "key", None))
        with self._lock:
            held = self.drivers.get(request.key)
            if held is not None and held.request.name == request.name:
                return  # launched already (a retried call)
            if held is not None:  # another database's attempt under the same key
                self.drivers.pop(request.key)
            driver = AttemptDriver(
                request,
                pool=self.pool,
                runtime_name=RUNTIME_NAME,
                namespace=self.namespace,
                collective_timeout_s=self.collective_timeout_s,
                capability=self.keys.capability(request.job_id, request.attempt),
                wake=self.attempts.wake,
            )
            self.drivers[request.key] = driver
        if held is not None:
            held.release()
        self.attempts.add(driver)

    def reconcile(self, token: str, want: Reconcile) -> Reconciled:
        """Every live attempt's report; everything the control plane no longer wants is let
        go of (see `elastrain.workers.runtime.reconcile` for the rules)."""
        self._control(token, "reconcile")
        with self._lock:
            held = [
                HeldAttempt(key=k, name=d.request.name, sent_at=d.request.sent_at)
                for k, d in self.drivers.items()
            ]
            doomed = [self.drivers.pop(k) for k in attempts_to_release(held, want)]
            drivers = {key: self.drivers.get(key) for key in want.attempts}
            kept = set(self.drivers)  # including any launched after the database was read
            running = {d.request.job for d in self.drivers.values()}
        for driver in doomed:
            log.info("releasing %s: not live in the database", driver.request.name)
            driver.release()
        self.pool.abort_strays(kept)
        forgotten = sorted(jobs_to_forget(self.pool.held_jobs() - running, want))
        for job in forgotten:
            self.pool.forget_job(job)
        removed = self._remove_orphan_groups(force=bool(doomed))
        reports = {
            key: (d.drain(want.attempts[key].ack) if d is not None else None)
            for key, d in drivers.items()
        }
        return Reconciled(
            reports=reports,
            released=tuple(d.request.name for d in doomed),
            forgotten_jobs=tuple(forgotten),
            removed_groups=tuple(removed),
            ready_nodes=self.pool.ready_nodes(),
            warm_at=self.pool.warm_at(),
        )

    def request(self, token: str, key: AttemptKey, control: Control) -> None:
        self._control(token, "request", key)
        driver = self._driver(key)
        if driver is not None:
            driver.request_control(control)

    def release(self, token: str, key: AttemptKey, final: bool = False) -> None:
        """The fast path: let go of an attempt now (its resources are about to be handed
        to another). The next reconcile does the same if this call never arrives."""
        self._control(token, "release", key)
        with self._lock:
            driver = self.drivers.pop(key, None)
        if driver is not None:
            driver.release()
        if final and driver is not None:
            self.pool.forget_job(driver.request.job)

    def workers(self, token: str) -> list[WorkerInfo]:
        """The pool's processes that answered, busy as the pool lends them (their last
        answer may predate it; for tests, benches and debugging)."""
        self._control(token, "workers")
        with self.pool.lock:
            return [
                replace(w.info, busy=w.busy)
                for w in self.pool.workers.values()
                if w.info is not None
            ]

    # -- rank 0's calls ----------------------------------------------------------------------
    def push_many(
        self, key: AttemptKey, capability: str, number: int, messages: list[WorkerMessage]
    ) -> None:
        """Rank 0's `number`th batch of messages (what `RuntimeHooks` batches, in order),
        with its attempt's capability (an HMAC compare: microseconds, once per batch)."""
        try:
            job_id, attempt = int(key[0]), int(key[1])
        except (TypeError, ValueError, IndexError):
            raise self.refusals.refuse("push_many", key) from None
        if not self.keys.is_attempt(job_id, attempt, capability):
            raise self.refusals.refuse("push_many", key)
        driver = self._driver(AttemptKey(job_id, attempt))
        if driver is not None:  # else a released attempt: fenced off
            driver.push_batch(number, messages)

    def _driver(self, key: AttemptKey) -> AttemptDriver | None:
        with self._lock:
            return self.drivers.get(key)

    # -- clean-up ------------------------------------------------------------------------------
    def _remove_orphan_groups(self, *, force: bool) -> list[str]:
        """Remove this namespace's placement groups that no held attempt owns (left by a
        release that failed half-way, or by a runtime that died)."""
        now = time.monotonic()
        if not force and now - self._scanned_at < _ORPHAN_SCAN_INTERVAL_S:
            return []
        self._scanned_at = now
        with self._lock:
            owned = {d.group_name for d in self.drivers.values()}
        groups = [
            (pg_id, g.get("name", ""), g.get("state", ""))
            for pg_id, g in ray.util.placement_group_table().items()
        ]
        doomed = orphan_groups(groups, owned, prefix=group_prefix(self.namespace))
        for pg_id, name in doomed:
            log.info("removing placement group %s: no live attempt owns it", name)
            try:
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
            except Exception as exc:  # removed meanwhile
                log.info("remove placement group %s: %s", name, exc)
        return [name for _, name in doomed]

    def _upkeep(self) -> None:
        passes = 0
        while True:
            try:
                nodes = ray.nodes()
                self.pool.top_up(nodes)
                self.notices.ensure(nodes)
                passes += 1
                if passes % _PING_EVERY == 0:
                    self.pool.check_idle()
            except Exception:
                log.exception("pool upkeep")
            # The pool may have changed under the attempts waiting on it (a process that
            # answered, let go or died; a node's GPUs): they look again.
            self.attempts.wake()
            time.sleep(self.upkeep_interval_s)
