"""`elastrain prepare` on a real Ray cluster (issue 43, items 3 and 4): JSON lines, Parquet,
text and a `save_to_disk` data set tokenized by Ray Data in a tracked job, with progress
points; bad inputs refused at submit; then a gpt trains on the result with falling loss.
A row without the text field fails
the job unretried, naming it. The split, resume and world-size guarantees are unit-tested (tests/unit/test_prepare.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastrain.api.cli.prepare import prepare_spec
from elastrain.contracts.prepared import read_index
from tests.integration.ray_service import (
    losses,
    ray_service,
    run_cli,
    submit,
    tiny_gpt_spec,
    wait_terminal,
)
from tests.unit.test_prepare import DOCS, write_inputs, write_tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.beside]


def test_prepare_on_the_cluster_then_train_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ray_service(tmp_path, num_cpus=3) as client:
        storage: Path = client.app.state.settings.storage_path  # type: ignore[attr-defined]
        area = storage / "data" / "default"
        docs = DOCS * 4  # enough tokens for a few hundred windows
        write_tokenizer(area / "tok", docs)
        write_inputs(area, docs)

        refused = client.post(
            "/v1/jobs",
            json={
                "name": "bad",
                "workload": {
                    "name": "prepare",
                    "params": {"inputs": ["in/*.csv"], "tokenizer": "tok", "out": "p"},
                },
                "scaling": {"min_workers": 1, "max_workers": 1},
            },
        )
        assert refused.status_code == 422, refused.text
        assert "workload.params.inputs.0: 'in/*.csv' matched no file" in refused.text

        (area / "bad").mkdir()
        (area / "bad" / "x.jsonl").write_text('{"body": "no text field"}\n')
        bad = submit(client, prepare_spec(["bad/*.jsonl"], tokenizer="tok", out="bad-out",
                                          text_field="text", eval_fraction=0.1))  # fmt: skip
        failed = wait_terminal(client, bad, timeout=120)
        assert failed["state"] == "FAILED" and failed["restarts"] == 0, failed
        assert "x.jsonl: row 1 has no field 'text' (it has: body)" in failed["last_error"]

        result = run_cli(
            client, monkeypatch, "prepare", "in/*.jsonl", "in/b.parquet", "in/c.txt", "in/hf",
            "--tokenizer", "tok", "--out", "prep", "--eval-fraction", "0.1", "--interval", "0.5",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "files 4/4" in result.stderr and "tokens/s" in result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1]) == {
            "workload": {"name": "gpt", "params": {"data_path": "prep"}}
        }
        index = read_index(area / "prep")
        assert [s.documents for s in index.shards] == [len(docs) // 4] * 4
        job_id = int(result.stderr.split()[0])
        points = client.get(f"/v1/jobs/{job_id}/metrics").json()
        assert points[-1]["tokens"] == index.tokens and points[-1]["files_done"] == 4

        params = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32, "data_path": "prep"}
        spec = tiny_gpt_spec(
            "on-prepared",
            workload={"name": "gpt", "params": params},
            training={"max_steps": 20, "eval_every": 10, "eval_samples": 16},
        )
        gpt = submit(client, spec)
        job = wait_terminal(client, gpt, timeout=300)
        assert job["state"] == "SUCCEEDED", job
        curve = losses(client, gpt)
        assert curve[20] < 0.7 * curve[1], curve
