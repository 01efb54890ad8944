"""A training project may name its modules as elastrain's parts are named (`service`,
`workers`, `checkpoints`, `api`, `contracts`): elastrain installs `elastrain` alone, so on a
real local Ray the job's own `import service` gets the job's module, and the job trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import a_zip, spec_dict
from tests.integration.ray_service import ray_service, submit, wait_terminal

# On a local Ray of its own, no timing asserted: `make test` runs it beside the other Ray tests.
pytestmark = [pytest.mark.ray, pytest.mark.beside]

#: The factory lives in the project's own `workers` package and imports the project's own
#: `service` module and `checkpoints` package; each says whose it is.
FILES = {
    "service.py": "OWNER = 'project'\n",
    "checkpoints/__init__.py": "OWNER = 'project'\n",
    "api.py": "OWNER = 'project'\n",
    "workers/__init__.py": "",
    "workers/model.py": """\
import torch
from torch import nn

import api
import checkpoints
import elastrain
import service


def build():
    seen = {m.__name__: getattr(m, "OWNER", m.__file__) for m in (api, checkpoints, service)}
    if set(seen.values()) != {"project"}:
        raise ValueError(f"the project's modules were not its own: {seen}")
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = list(zip(x, x.sum(dim=1, keepdim=True)))
    return elastrain.Workload(model=nn.Linear(4, 1), dataset=data, loss_fn=nn.functional.mse_loss)
""",
}


def test_a_project_with_modules_named_like_elastrains_parts_trains(tmp_path: Path) -> None:
    with ray_service(tmp_path, num_cpus=2, warm_workers_per_node=1) as client:
        upload = client.post(
            "/v1/packages", content=a_zip(FILES), headers={"Content-Type": "application/zip"}
        )
        assert upload.status_code == 201, upload.text
        spec = spec_dict(
            name="same-names",
            workload={"entrypoint": "workers.model:build", "package": upload.json()["digest"]},
            scaling={"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.5},
            training={"max_steps": 3},
        )
        job = submit(client, spec)
        final = wait_terminal(client, job, timeout=240)
        assert final["state"] == "SUCCEEDED", final
