"""What a job's code writes into shared storage, met by a real `elastrain serve` (auth on)
over a real local Ray (issue 45, items 1 and 2):

- a folder planted under the next job id, holding a "committed checkpoint" of step 900,
  is set aside when that job first launches: the job trains from step 0 and says so;
- a link planted in the job's checkpoints folder as a newer step (into another tenant's
  data area, which holds a manifest) is never exported: the export is the job's own step;
- a DCP `.metadata` replaced by a pickle that would write a file makes the export a 409
  with a reason, and the file is never written.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import pytest

from elastrain.checkpoints.layout import step_dir_name
from elastrain.contracts.storage import JobStorage
from tests.e2e.server import serve_argv, start_server
from tests.integration.ray_service import wait_terminal

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

TOKEN = "operator-admin-token-hostile-files-0123456789"


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_planted_folders_links_and_pickles_are_never_adopted_followed_or_run(
    tmp_path: Path,
) -> None:
    server = start_server(
        tmp_path / "srv",
        token=TOKEN,
        env={"ELASTRAIN_RAY_NUM_CPUS": "2", "ELASTRAIN_WARM_WORKERS_PER_NODE": "1"},
        argv=serve_argv,
        startup_timeout=120,
    )
    storage = tmp_path / "srv" / "storage"
    marker = tmp_path / "pwned"
    try:
        # An export converts on the cluster (a Ray task starting a worker, then a child
        # importing torch and transformers): minutes on CI's busy cores, as the CLI allows.
        with server.http(timeout=300) as client:
            # Planted by some job's code before job 1 exists: weights of "step 900".
            planted = JobStorage.of(storage, 1).checkpoints / step_dir_name(900, 1)
            planted.mkdir(parents=True)
            (planted / "manifest.json").write_text(json.dumps({"step": 900}))
            made = client.post(
                "/v1/jobs",
                json={
                    "name": "victim",
                    "workload": {
                        "name": "gpt",
                        "params": {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16},
                    },
                    "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.5},
                    "training": {"global_batch_size": 8, "micro_batch_size": 8, "max_steps": 4},
                    "checkpoint": {"every_steps": 2, "keep_last": 2, "async_save": False},
                    "failure": {"max_restarts": 0},
                },
            )
            assert made.status_code == 201, made.text
            job_id = made.json()["id"]
            assert job_id == 1
            job = wait_terminal(client, job_id, timeout=240)
            assert job["state"] == "SUCCEEDED", job
            events = client.get(f"/v1/jobs/{job_id}/events").json()
            assert [e for e in events if e["kind"] == "folder_set_aside"], events
            assert not [e for e in events if e["kind"] == "resumed"], events
            steps = [p["step"] for p in client.get(f"/v1/jobs/{job_id}/metrics").json()]
            assert steps == [1, 2, 3, 4]  # from scratch, not from the planted step 900
            assert (storage / "jobs" / "1.set-aside" / "checkpoints" / planted.name).is_dir()

            # A link as a newer step, into tenant b's data area, where a committed
            # checkpoint of step 99 lies (a copy of this job's step 2, relabelled).
            ckpts = JobStorage.of(storage, job_id).checkpoints
            theirs = storage / "data" / "b" / "model"
            shutil.copytree(ckpts / step_dir_name(2, 1), theirs)
            manifest = json.loads((theirs / "manifest.json").read_text())
            (theirs / "manifest.json").write_text(json.dumps({**manifest, "step": 99}))
            (ckpts / step_dir_name(99, 1)).symlink_to(theirs)
            answer = client.get(f"/v1/jobs/{job_id}/export", params={"format": "hf"})
            assert answer.status_code == 200, answer.text
            assert answer.headers["X-Elastrain-Step"] == "4"
            with tarfile.open(fileobj=io.BytesIO(answer.content)) as tar:
                assert "model.safetensors" in tar.getnames()
            # Converted by a task on the cluster, packed by the API, then deleted.
            assert list((storage / "exports").iterdir()) == []

            # The job's code replaces its newest checkpoint's metadata with a pickle.
            (ckpts / step_dir_name(4, 1) / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
            refused = client.get(f"/v1/jobs/{job_id}/export", params={"format": "hf"})
            assert refused.status_code == 409, refused.text
            detail = refused.json()["detail"]
            assert "posix.system" in detail and "nothing of it was run" in detail, detail
            assert str(storage) not in detail  # names the step, not the server's paths
            assert (theirs / "manifest.json").is_file()
        assert not marker.exists()
    finally:
        server.stop()
