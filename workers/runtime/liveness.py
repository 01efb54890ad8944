"""Whether a node's raylet is gone, asked directly rather than waiting for Ray to say so.

When a node's raylet dies (kill -9, a crashed host agent) its worker processes exit at once,
so an attempt's driver sees its ranks' processes die seconds before Ray's health checks
declare the node dead (`health_check_period_ms` x `health_check_failure_threshold`: 15 s
and more by default). Told only "the process died", the scheduler would count a node loss
as the job's failure. So the driver asks the node's raylet itself: a refused connection to
its node-manager port means nothing listens there any more, the node is lost; an answer,
or no answer in time (a partition: Ray's own verdict will come), leaves it a process death.

A raylet killed alone (its host's agent crashed, the OOM killer) need not take the node's
worker processes with it at once: they may train on for seconds (their calls and their
collectives go to each other directly), and calls to them, once they exit, neither answer
nor fail until the GCS declares the node dead. Meanwhile a grow or a recovery may place a
rank there. So while an attempt runs, its driver probes the raylet of every node its ranks
are on, every REPROBE_S (`nodes_to_probe`), and a refusal ends their part as a node loss
at once.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray

#: How long a probe may wait for the raylet's port to answer.
PROBE_TIMEOUT_S = 0.5
#: How often the raylet of a node an attempt's ranks run on is probed: one connection per
#: node per second (the address is looked up once per node).
REPROBE_S = 1.0


def nodes_to_probe(
    nodes: Iterable[str | None], probed_at: Mapping[str | None, float], now: float
) -> set[str]:
    """The nodes (of ranks still out) to probe at `now`: those not probed within the last
    REPROBE_S (`probed_at`: node -> when it last was). Unknown nodes are not probed."""
    return {
        node for node in nodes if node and now - probed_at.get(node, float("-inf")) >= REPROBE_S
    }


#: node id -> its raylet's (address, port), once Ray said so: a node keeps both for life.
_raylets: dict[str, tuple[str, int]] = {}


def raylet_gone(
    node_id: str | None,
    nodes: Callable[[], list[dict[str, Any]]] = ray.nodes,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> bool:
    """True when `node_id`'s raylet is known dead to Ray or refuses connections. False when
    it answers, cannot be reached in time, or the node is not known: only a certain death
    turns a process death into a node loss."""
    if not node_id:
        return False
    raylet = _raylets.get(node_id)
    if raylet is None:
        try:
            known = [n for n in nodes() if n.get("NodeID") == node_id]
        except Exception:  # the GCS is unreachable: no verdict from here
            return False
        if not known:
            return False
        node = known[0]
        if not node.get("Alive", True):
            return True
        address, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
        if not address or not port:
            return False
        raylet = _raylets[node_id] = (str(address), int(port))
    try:
        with socket.create_connection(raylet, timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout or an unreachable network: not a verdict
        return False
