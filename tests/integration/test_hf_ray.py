"""A Hugging Face llama on real Ray: trained by the service under DDP, FSDP2 and tensor
parallelism (from a config, and from a model folder in the tenant's data area), then
exported with `elastrain export` and loaded back with `from_pretrained`: no missing or
unexpected key, and the checkpoint's logits."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from elastrain.checkpoints.dcp.export import load_model_weights
from elastrain.checkpoints.export import pick_checkpoint
from elastrain.contracts.storage import JobStorage
from elastrain.contracts.workload_params import HfCausalLmParams
from elastrain.workers.workloads.hf_causal_lm import build
from tests.integration.ray_service import (
    losses,
    ray_service,
    run_cli,
    submit,
    tiny_gpt_spec,
    wait_terminal,
)

# On a local Ray of its own, no timing asserted: `make test` runs it beside the other Ray tests.
pytestmark = [pytest.mark.ray, pytest.mark.beside]

LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
    "vocab_size": 65, "max_position_embeddings": 64,
}  # fmt: skip
STEPS = 8


def hf_spec(name: str, params: dict[str, Any], strategy: dict[str, Any]) -> dict[str, Any]:
    return tiny_gpt_spec(
        name,
        workload={"name": "hf_causal_lm", "params": {**params, "seq_len": 32}},
        strategy=strategy,
        training={"max_steps": STEPS, "learning_rate": 0.01},
        checkpoint={"every_steps": 4},
    )


def test_llama_trains_under_each_strategy_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ray_service(tmp_path, num_cpus=2) as client:
        storage: Path = client.app.state.settings.storage_path  # type: ignore[attr-defined]
        # A model folder in the tenant's data area, named relative to it.
        config = dict(LLAMA)
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config.pop("model_type"), **config)
        ).save_pretrained(storage / "data" / "default" / "tiny-llama")

        # Refused at submit, naming the field.
        missing = client.post("/v1/jobs", json=hf_spec("x", {"model": "nope"}, {"kind": "ddp"}))
        assert missing.status_code == 422 and "workload.params.model" in missing.text
        small = {"config": {**LLAMA, "vocab_size": 32}}
        too_small = client.post("/v1/jobs", json=hf_spec("x", small, {"kind": "ddp"}))
        assert too_small.status_code == 422
        assert "workload.params.config.vocab_size (32)" in too_small.text

        jobs = {
            "ddp": submit(client, hf_spec("hf-ddp", {"config": LLAMA}, {"kind": "ddp"})),
            "fsdp": submit(client, hf_spec("hf-fsdp", {"model": "tiny-llama"}, {"kind": "fsdp"})),
            "tp": submit(
                client, hf_spec("hf-tp", {"config": LLAMA}, {"kind": "tp", "tensor_parallel": 2})
            ),
        }
        for kind, job_id in jobs.items():
            final = wait_terminal(client, job_id, timeout=600)
            assert final["state"] == "SUCCEEDED", (kind, final)
            curve = losses(client, job_id)
            assert sorted(curve) == list(range(1, STEPS + 1)) and curve[STEPS] < curve[1], kind
        assert client.get(f"/v1/jobs/{jobs['tp']}").json()["strategy"] == "tp2"

        for kind, job_id in jobs.items():
            out = tmp_path / f"export-{kind}"
            done = run_cli(
                client, monkeypatch, "export", str(job_id), "--format", "hf", "--out", str(out)
            )
            assert done.exit_code == 0, done.output
            assert f"step {STEPS}:" in done.output
            loaded, report = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
            assert not report["missing_keys"] and not report["unexpected_keys"], report
            info = pick_checkpoint(JobStorage.of(storage, job_id).checkpoints, STEPS)
            reference = build(HfCausalLmParams(config=LLAMA, seq_len=32)).model
            reference.load_state_dict(load_model_weights(info), strict=True)
            x = torch.randint(0, 65, (2, 32))
            with torch.no_grad():
                torch.testing.assert_close(loaded(input_ids=x).logits, reference(x))

        # An earlier step, over REST: a tar of the folder.
        got = client.get(f"/v1/jobs/{jobs['ddp']}/export", params={"format": "hf", "step": 4})
        assert got.status_code == 200 and got.headers["x-elastrain-step"] == "4"
        with tarfile.open(fileobj=io.BytesIO(got.content)) as tar:
            assert {"config.json", "model.safetensors"} <= set(tar.getnames())
        absent = run_cli(
            client, monkeypatch, "export", str(jobs["ddp"]), "--step", "5", "--out", "o"
        )
        assert absent.exit_code != 0 and "step 5" in absent.output and "4, 8" in absent.output
        other = submit(client, tiny_gpt_spec("syn", workload={"name": "synthetic", "params": {}}))
        refused = client.get(f"/v1/jobs/{other}/export")
        assert refused.status_code == 422 and "hf_causal_lm and gpt" in refused.text
        client.post(f"/v1/jobs/{other}/cancel")
