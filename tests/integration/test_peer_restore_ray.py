"""A sharded (FSDP) job loses a node of a real 3-node Ray cluster mid-run and resumes
from its peers' memory: the survivors hold their own shards and the lost rank's buddy
copy, the next attempt re-shards them to world size 2, at most the step being copied is
trained again, and the loss curve is that of the same job run without interruption."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cluster_service import multi_node_service
from tests.integration.ray_service import submit, tiny_gpt_spec, wait_for, wait_terminal

pytestmark = [pytest.mark.ray, pytest.mark.chaos]

MAX_STEPS = 150


def per_step(client, job_id: int, key: str) -> dict[int, float]:  # type: ignore[no-untyped-def]
    return {m["step"]: m[key] for m in client.get(f"/v1/jobs/{job_id}/metrics").json()}


def test_fsdp_node_loss_resumes_from_peer_memory(tmp_path: Path) -> None:
    with multi_node_service(tmp_path) as (client, nodes):
        spec = tiny_gpt_spec(
            "fsdp-peers",
            strategy={"kind": "fsdp"},
            scaling={"min_workers": 1, "max_workers": 3, "cpus_per_worker": 1},
            training={"global_batch_size": 24, "micro_batch_size": 4, "max_steps": MAX_STEPS},
            # Checkpoints far apart: a resume from one would recompute many steps.
            checkpoint={"every_steps": 100, "memory_every": 1},
            failure={"max_restarts": 0},
        )
        job_id = submit(client, spec)
        wait_for(
            client, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 12, what="step 12"
        )
        events = client.get(f"/v1/jobs/{job_id}/events").json()
        ranks = next(e["details"]["ranks"] for e in events if e["kind"] == "placement")
        assert len(set(ranks.values())) == 3  # one rank per node: each has a buddy elsewhere
        nodes.remove(nodes.node_of(ranks["2"]))
        final = wait_terminal(client, job_id, timeout=400)
        assert final["state"] == "SUCCEEDED", final
        assert final["restarts"] == 0

        events = client.get(f"/v1/jobs/{job_id}/events").json()
        lost = [e["details"] for e in events if e["kind"] == "node_lost"]
        resumed = [e["details"] for e in events if e["kind"] == "resumed"]
        assert lost and lost[0]["ranks"] == [2], lost
        assert len(resumed) == 1, resumed
        (r,) = resumed
        # From the survivors' memory, at world size 2. Nothing is trained twice unless the
        # node died during the refresh of the step just done (its copy then incomplete: the
        # one before it is restored, one step older); the gloo tests of every strategy
        # (tests/unit/test_peer_memory.py) lose ranks at a step boundary and check 0.
        assert (r["source"], r["saved_world_size"]) == ("peer", 3), r
        assert r["steps_recomputed"] in (0, 1), r
        assert r["step"] >= 12 and r["step"] < 100  # newer than any checkpoint
        timelines = [e["details"] for e in events if e["kind"] == "timeline"]
        restored = [p for p in timelines[-1]["phases"] if p["phase"] == "state_restored"]
        assert [p["source"] for p in restored] == ["peer"], timelines[-1]

        # The same job without interruption (on the two nodes left): the same curve.
        steady = submit(client, {**spec, "name": "steady"})
        assert wait_terminal(client, steady, timeout=400)["state"] == "SUCCEEDED"
        assert per_step(client, job_id, "batch_crc") == per_step(client, steady, "batch_crc")
        interrupted, baseline = per_step(client, job_id, "loss"), per_step(client, steady, "loss")
        assert interrupted.keys() == baseline.keys() == set(range(1, MAX_STEPS + 1))
        worst = max(abs(interrupted[s] - loss) / abs(loss) for s, loss in baseline.items())
        assert worst < 1e-3, f"largest relative loss difference {worst:.2e}"
