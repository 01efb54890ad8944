"""`elastrain prepare` on a real Ray cluster (issue 43, items 3 and 4): JSON lines, Parquet,
text and a `save_to_disk` data set tokenized by Ray Data in a tracked job, with progress
points; bad inputs refused at submit; then a gpt trains on the result with falling loss.
A row without the text field fails
the job unretried, naming it; a prepare job whose process is killed retries without
redoing finished inputs. The split, parts, resume and world-size guarantees are
unit-tested (tests/unit/test_prepare.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from elastrain.api.cli.prepare import prepare_spec
from elastrain.contracts.prepared import read_index, storage_relative_prepare_paths
from elastrain.contracts.workload_params import PrepareParams
from elastrain.workers.prepare import Preparation
from tests.integration.ray_service import (
    losses,
    ray_service,
    run_cli,
    submit,
    tiny_gpt_spec,
    wait_terminal,
)
from tests.unit.test_prepare import DOCS, write_inputs, write_tokenizer
from tests.waiting import wait_until

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


def test_a_prepare_job_survives_its_worker_killed_and_redoes_no_finished_file(
    tmp_path: Path,
) -> None:
    """The prepare job's process killed (-9) once the first inputs are done: the job
    retries, the new attempt prepares only the inputs not finished, and the result is
    the same tokens as an uninterrupted preparation of the same files."""
    with ray_service(tmp_path, num_cpus=3) as client:
        storage: Path = client.app.state.settings.storage_path  # type: ignore[attr-defined]
        area = storage / "data" / "default"
        write_tokenizer(area / "tok", DOCS)
        (area / "in").mkdir(parents=True)
        for f in range(6):  # ~0.5 s of tokenizing each on one core
            rows = (json.dumps({"text": f"{f} {n} {DOCS[n % len(DOCS)]}"}) for n in range(20_000))
            (area / "in" / f"{f}.jsonl").write_text("\n".join(rows) + "\n")
        spec = prepare_spec(["in/*.jsonl"], tokenizer="tok", out="prep", text_field="text",
                            eval_fraction=0.0)  # fmt: skip
        job_id = submit(client, spec)
        shards = area / "prep" / "shards"
        wait_until(lambda: len(list(shards.glob("*.done.json"))) >= 2, 180,
                   "two inputs done", poll_s=0.02)  # fmt: skip
        finished = {p.name: p.stat().st_mtime_ns for p in shards.glob("*.done.json")}
        placement = next(e["details"] for e in client.get(f"/v1/jobs/{job_id}/events").json()
                         if e["kind"] == "placement")  # fmt: skip
        os.kill(int(placement["pids"]["0"]), signal.SIGKILL)

        job = wait_terminal(client, job_id, timeout=300)
        assert job["state"] == "SUCCEEDED" and job["restarts"] == 1, job
        assert len(finished) < 6, "every input was done before the kill: nothing was tested"
        for name, mtime in finished.items():  # not prepared again
            assert (shards / name).stat().st_mtime_ns == mtime, name
        index = read_index(area / "prep")
        given = {**spec["workload"]["params"], "out": "ref"}
        params = storage_relative_prepare_paths(given, storage, "default")
        reference = Preparation(PrepareParams.model_validate(params)).run(
            storage, lambda _: None, use_ray=False
        )
        assert reference is not None
        assert [(s.source, s.tokens, s.documents) for s in index.shards] == [
            (s.source, s.tokens, s.documents) for s in reference.shards
        ]
        for ours, theirs in zip(index.shards, reference.shards, strict=True):
            assert (area / "prep" / ours.bin_file).read_bytes() == (
                area / "ref" / theirs.bin_file
            ).read_bytes()
        steps = [p["step"] for p in client.get(f"/v1/jobs/{job_id}/metrics").json()]
        assert steps == sorted(set(steps)), "a retried attempt's progress points go on"
