"""The RUN step of an attempt: its ranks' outcomes, taken in as they come back.

Each rank's `run` reply is a future (`AttemptDriver._watch`: its arrival wakes the attempt
loop); `take_in` hands each process that answered back to the pool, holding what it holds.
A process that died leaves its rank waiting for a probe of its node's raylet, run on a
thread of its own (`elastrain.workers.runtime.liveness`: up to half a second when the node
does not answer), which says whether the node died with it. Ranks given up on after the
grace (`elastrain.workers.runtime.phases.OUTCOME_GRACE_S`; they were told to let go when
the first rank ended badly) become stragglers: the pool takes them back whenever they do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray

from elastrain.contracts.group import RunOutcome
from elastrain.contracts.messages import WorkerError
from elastrain.workers.runtime.liveness import nodes_to_probe, raylet_gone
from elastrain.workers.runtime.pool import PooledWorker, WorkerPool
from elastrain.workers.runtime.verdict import Outcome, ended_badly, process_died, stuck

#: Probes of a node's raylet run here, not on the attempt loop that moves every attempt.
_probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="raylet-probe")


class Outcomes:
    def __init__(self, pool: WorkerPool, wake: Callable[[], None]) -> None:
        self.pool = pool
        self._wake = wake
        self.workers: Sequence[PooledWorker] = ()
        self.runs: dict[int, Future[Any]] = {}  # by rank: outcomes still out
        self.known: dict[int, Outcome] = {}
        self.bad = False
        """A rank's part ended badly (its peers get a grace)."""
        self._died: dict[int, BaseException] = {}  # ranks whose process died: node probed
        self.probes: dict[str | None, Future[bool]] = {}  # one per node, not per rank
        self.stragglers: dict[int, Future[Any]] = {}  # given up on: back to the pool later
        # The periodic raylet probes of the nodes of ranks still out, and when each was sent
        # (`watch_nodes`; `probes` above are the one-shot verdicts on a process death).
        self._watched: dict[str | None, tuple[Future[bool], float]] = {}

    def start(self, workers: Sequence[PooledWorker], runs: dict[int, Future[Any]]) -> None:
        self.workers, self.runs = workers, runs

    def take_in(self) -> None:
        """Take in the outcomes that came back: each rank's process goes back to the pool,
        holding what it holds (a dead one's rank waits for its node's probe)."""
        for rank, future in list(self.runs.items()):
            if not future.done():
                continue
            del self.runs[rank]
            worker = self.workers[rank]
            exc = future.exception()
            if exc is None:
                outcome: RunOutcome = future.result()
                self.pool.give_back(worker, outcome.held, alive=True)
                self.known[rank] = outcome
                self.bad = self.bad or ended_badly(outcome)
            elif isinstance(exc, ray.exceptions.RayActorError):
                self.pool.give_back(worker, None, alive=False)
                self._died[rank] = exc
                self._probe(worker.node_id)
                self.bad = True
            else:  # the call failed, not the process (it is idle again)
                self.pool.give_back(worker, None, alive=True)
                self.known[rank] = WorkerError.from_exception(exc, rank=rank)
                self.bad = True
        for rank, exc in list(self._died.items()):
            probe = self.probes[self.workers[rank].node_id]
            if probe.done():
                del self._died[rank]
                gone = probe.exception() is None and bool(probe.result())
                self.known[rank] = self._died_error(rank, exc, gone=gone)

    def watch_nodes(self, now: float) -> None:
        """Probe the raylets of the nodes of ranks still out (each every REPROBE_S, on the
        probes' threads; `now`: the monotonic clock); a node whose raylet refused has lost
        its processes, or will, and each of its ranks still out ends now as a node loss,
        without waiting for Ray's health checks to fail the calls."""
        for node, (probe, _) in list(self._watched.items()):
            if probe.done() and probe.exception() is None and probe.result():
                self._lost_node(node)
        out = [self.workers[r].node_id for r in self.runs]
        probed = {node: at for node, (_, at) in self._watched.items()}
        for node in nodes_to_probe(out, probed, now):
            probe = _probes.submit(raylet_gone, node)
            probe.add_done_callback(lambda _: self._wake())
            self._watched[node] = (probe, now)

    def _lost_node(self, node: str | None) -> None:
        for rank in [r for r in self.runs if self.workers[r].node_id == node]:
            del self.runs[rank]  # its call fails later, once Ray declares the node dead
            worker = self.workers[rank]
            worker.handle.abort.remote(self.pool.token)  # if it lives on, it lets go
            self.pool.give_back(worker, None, alive=False)
            gone = ConnectionRefusedError(f"the raylet of node {node} refuses connections")
            self.known[rank] = self._died_error(rank, gone, gone=True)
            self.bad = True

    def _probe(self, node_id: str | None) -> None:
        """Ask whether the node's raylet is gone too: the node died, not the process alone."""
        if node_id not in self.probes:
            probe = _probes.submit(raylet_gone, node_id)
            probe.add_done_callback(lambda _: self._wake())
            self.probes[node_id] = probe

    def _died_error(self, rank: int, exc: BaseException, *, gone: bool) -> WorkerError:
        worker = self.workers[rank]
        pid = worker.info.pid if worker.info else None
        return process_died(exc, rank=rank, node_id=worker.node_id, pid=pid, node_gone=gone)

    def let_go(self) -> None:
        """The ranks still out are told to let go (a peer ended badly); their outcomes
        come back as usual."""
        for rank in self.runs:
            self.workers[rank].handle.abort.remote(self.pool.token)

    def give_up(self) -> None:
        """The ranks still out are told to let go; they come back as stragglers."""
        for rank in self.runs:
            self.workers[rank].handle.abort.remote(self.pool.token)
        self.stragglers.update(self.runs)
        self.runs = {}

    def handed(self) -> set[int]:
        """The ranks handed their part (out, back, or died)."""
        return set(self.runs) | set(self.known) | set(self._died) | set(self.stragglers)

    def final(self) -> list[Outcome]:
        """Every rank's outcome at the verdict: a process whose node's probe did not answer
        in the grace died alone, a rank still out is stuck."""
        out: list[Outcome] = []
        for rank in range(len(self.workers)):
            if rank in self.known:
                out.append(self.known[rank])
            elif rank in self._died:
                out.append(self._died_error(rank, self._died[rank], gone=False))
            else:
                out.append(stuck(rank))
        return out

    def stragglers_back(self) -> bool:
        """Stragglers that let go since: the pool takes their processes back."""
        came = [rank for rank, future in self.stragglers.items() if future.done()]
        for rank in came:
            future = self.stragglers.pop(rank)
            worker = self.workers[rank]
            if future.exception() is None:
                self.pool.give_back(worker, future.result().held, alive=True)
            else:
                self.pool.give_back(worker, None, alive=False)
        return bool(came)
