"""Preemption notices: a watcher on every node turns a cloud's notice into a Ray drain.

Clouds tell a machine 30-120 s ahead that it will be taken away: AWS answers
`http://169.254.169.254/latest/meta-data/spot/instance-action` (404 until there is a notice,
then JSON with the `time` it happens), GCE `.../computeMetadata/v1/instance/preempted`
(`TRUE`), and node agents (the AWS node termination handler, a custom script) can write a
file. `ELASTRAIN_PREEMPTION_NOTICE` names what to watch on every node: a file path, or an
http(s) URL (a 404 or an unreachable address means no notice); `{node_id}` in it stands
for the node's Ray id (one file per node where the nodes share a filesystem). The file or body holds
nothing, `TRUE`, a number of seconds left, or JSON with `time` (ISO 8601) and `action`.

On a notice the node's watcher drains its own node through Ray's drain API (reason
preemption, with the deadline): Ray places nothing new there, and the control plane sees
the drain like any other (jobs leave the node at a step boundary, their state handed on
in memory). It also leaves the notice in Ray's KV store, so the dashboard shows why.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastrain.contracts.runtime import NOTICE_KV_NAMESPACE, NOTICE_KV_PREFIX, PreemptionNotice

log = logging.getLogger("elastrain.notice")

#: When a notice gives no time: the shortest warning a cloud gives (GCE: 30 s).
DEFAULT_WARNING_S = 30.0
POLL_INTERVAL_S = 1.0
#: GCE's metadata server answers only requests that carry this header.
_HEADERS = {"Metadata-Flavor": "Google"}


def parse_notice(text: str, now: float) -> tuple[float, str] | None:
    """(deadline, reason) of a notice's text, or None when it says there is none."""
    body = text.strip()
    if body.upper() == "FALSE":
        return None
    if not body or body.upper() == "TRUE":
        return now + DEFAULT_WARNING_S, "preemption notice"
    try:
        return now + float(body), "preemption notice"
    except ValueError:
        pass
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return now + DEFAULT_WARNING_S, f"preemption notice: {body[:200]}"
    if not isinstance(data, dict):
        return now + DEFAULT_WARNING_S, "preemption notice"
    action = str(data.get("action", "")) or "preemption"
    when = data.get("time")
    try:
        deadline = datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp()
    except ValueError:
        deadline = now + DEFAULT_WARNING_S
    return deadline, f"preemption notice: {action}"


def read_source(source: str, timeout: float = 1.0) -> str | None:
    """The notice's text at `source` (a path or an http(s) URL), None when there is none."""
    if source.startswith(("http://", "https://")):
        request = urllib.request.Request(source, headers=_HEADERS)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return str(answer.read(4096).decode(errors="replace"))
        except (urllib.error.URLError, TimeoutError, OSError):
            return None  # 404 (no notice yet) or no metadata server here
    path = Path(source)
    try:
        return path.read_text(errors="replace")[:4096] if path.exists() else None
    except OSError:
        return None


class NoticeWatcher:
    """One per node (wrapped with `ray.remote`, no CPU): polls `source`, and on a notice
    drains this node through Ray and records the notice. Drains once."""

    def __init__(self, source: str, interval_s: float = POLL_INTERVAL_S) -> None:
        self.source = source
        self.interval_s = interval_s
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.gcs_address = context.gcs_address
        # `{node_id}` in the source: one path per node on a filesystem the nodes share.
        self.source = source.replace("{node_id}", self.node_id)
        self.notice: PreemptionNotice | None = None
        threading.Thread(target=self._watch, name="preemption-notice", daemon=True).start()

    def ping(self) -> str:
        return self.node_id

    def _watch(self) -> None:
        while self.notice is None:
            try:
                text = read_source(self.source)
                parsed = parse_notice(text, time.time()) if text is not None else None
                if parsed is not None:
                    self._drain(*parsed)
            except Exception:
                log.exception("preemption notice watcher")
            time.sleep(self.interval_s)

    def _drain(self, deadline: float, reason: str) -> None:
        from ray.core.generated import autoscaler_pb2

        notice = PreemptionNotice(node_id=self.node_id, reason=reason, deadline=deadline)
        internal_kv._internal_kv_put(
            NOTICE_KV_PREFIX + self.node_id, notice.to_json(), namespace=NOTICE_KV_NAMESPACE
        )
        gcs = ray._raylet.GcsClient(address=self.gcs_address)  # type: ignore[attr-defined]
        accepted, why = gcs.drain_node(
            self.node_id,
            autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
                "DRAIN_NODE_REASON_PREEMPTION"
            ),
            reason,
            int(deadline * 1000),
        )
        log.warning("node %s: %s (deadline %.0f); drain accepted: %s %s",
                    self.node_id, reason, deadline, accepted, why)  # fmt: skip
        self.notice = notice


class NoticeWatchers:
    """The runtime's watchers: one started on every alive node that has none."""

    def __init__(self, source: str | None, namespace: str) -> None:
        self.source = source
        self.namespace = namespace
        self.handles: dict[str, Any] = {}

    def ensure(self, nodes: Iterable[dict[str, Any]]) -> None:
        if not self.source:
            return
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        self.handles = {k: h for k, h in self.handles.items() if k in alive}
        for node_id in sorted(alive - set(self.handles)):
            self.handles[node_id] = (
                ray.remote(NoticeWatcher)
                .options(
                    name=f"elastrain-notice-{node_id}",
                    namespace=self.namespace,
                    get_if_exists=True,
                    num_cpus=0,
                    max_restarts=-1,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote(self.source)
            )
