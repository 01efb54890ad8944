"""The `hf_causal_lm` workload and the Hugging Face export, on gloo/CPU.

A tiny llama trained by the real loop under DDP, FSDP2 and tensor parallelism (2 ranks)
follows the single-process run's losses; the checkpoint each one commits exports as a
folder that `AutoModelForCausalLM.from_pretrained` loads with no missing or unexpected
key and that gives the checkpoint's model's logits. The gpt exports as GPT-2 the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from elastrain.checkpoints.catalog import list_committed
from elastrain.checkpoints.dcp.export import export_checkpoint, load_model_weights
from elastrain.checkpoints.export import ExportError, export_in_child, pick_checkpoint
from elastrain.contracts.spec import JobSpec
from elastrain.contracts.workload_params import GptParams, HfCausalLmParams, params_problems
from elastrain.workers.workloads import WorkloadError
from elastrain.workers.workloads.hf_causal_lm import HfCausalLM, build, tp_style
from tests.unit.dist_utils import run_distributed
from tests.unit.test_workers_train import losses, run_jobs

STEPS = 4
LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
    "vocab_size": 65, "max_position_embeddings": 64,
}  # fmt: skip
GPT = {"n_layer": 2, "n_embd": 32, "n_head": 4, "seq_len": 16}


def spec(
    strategy: dict[str, Any],
    workload: dict[str, Any] | None = None,
    max_workers: int = 2,
    **training: Any,
) -> JobSpec:
    return JobSpec(
        name="hf",
        workload=workload or {"name": "hf_causal_lm", "params": {"config": LLAMA, "seq_len": 16}},
        strategy=strategy,
        scaling={"min_workers": 1, "max_workers": max_workers},
        training={
            "global_batch_size": 4, "micro_batch_size": 2, "max_steps": STEPS,
            "learning_rate": 1e-2, "seed": 5, **training,
        },
        checkpoint={"every_steps": 100},
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf")
    out: dict[str, Any] = {"root": root}
    ws2 = [
        ("ddp", str(root / "ddp"), spec({"kind": "ddp"}), []),
        # The decoder layers are FSDP units and, recomputed in the backward, the same
        # activation-checkpointing units: the losses do not change.
        ("fsdp", str(root / "fsdp"), spec({"kind": "fsdp"}, activation_checkpointing="full"), []),
        ("tp", str(root / "tp"), spec({"kind": "tp", "tensor_parallel": 2}), []),
    ]
    ws1 = [
        ("reference", str(root / "reference"), spec({"kind": "ddp"}), []),
        ("gpt", str(root / "gpt"), spec({"kind": "ddp"}, {"name": "gpt", "params": GPT}), []),
    ]
    out.update(run_distributed(run_jobs, 2, ws2, timeout_s=600)[0])
    out.update(run_distributed(run_jobs, 1, ws1, timeout_s=600)[0])
    return out


# -- the workload -----------------------------------------------------------------------


@pytest.mark.parametrize("label", ["ddp", "fsdp", "tp"])
def test_trains_like_the_single_process_run(runs: dict[str, Any], label: str) -> None:
    got, want = losses(runs[label]), losses(runs["reference"])
    assert len(got) == STEPS and got[-1] < got[0]
    # Same batches, same initial weights: only the float sums' grouping differs.
    assert got == pytest.approx(want, rel=1e-4)
    assert [c.step for c in runs[label]["commits"]] == [STEPS]


def test_tp_plan_is_the_models_own_on_torch_styles() -> None:
    model = build(HfCausalLmParams(config=LLAMA, seq_len=16)).model
    assert isinstance(model, HfCausalLM)
    plan = model.tensor_parallel_plan()
    for i in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert type(plan[f"lm.model.layers.{i}.self_attn.{proj}"]) is ColwiseParallel
        assert type(plan[f"lm.model.layers.{i}.self_attn.o_proj"]) is RowwiseParallel
        assert type(plan[f"lm.model.layers.{i}.mlp.down_proj"]) is RowwiseParallel
    assert "lm.model.layers.2.self_attn.q_proj" not in plan  # `*` only the layers there are
    names = {n for n, _ in model.named_modules()}
    assert set(plan) <= names
    assert [type(u).__name__ for u in model.shard_units()] == ["LlamaDecoderLayer"] * 2


def test_tp_styles_map_hf_names_and_refuse_the_rest() -> None:
    from torch.distributed.tensor import Replicate, Shard

    head = tp_style("colwise_gather_output")
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    col = tp_style("colwise")
    assert isinstance(col, ColwiseParallel) and col.output_layouts == (Shard(-1),)
    emb = tp_style("embedding_rowwise")
    assert isinstance(emb, RowwiseParallel) and emb.input_layouts == (Replicate(),)
    with pytest.raises(ValueError, match=r"'packed_colwise' of experts.*not supported"):
        tp_style("packed_colwise", "experts")


def test_tied_embeddings_refuse_tensor_parallelism() -> None:
    model = build(HfCausalLmParams(config={**LLAMA, "tie_word_embeddings": True}, seq_len=16)).model
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        model.tensor_parallel_plan()


def test_vocab_must_fit_the_model(tmp_path: Path) -> None:
    # At submit, where both are known (the bundled corpus has 65 characters) ...
    problems = params_problems("hf_causal_lm", {"config": {**LLAMA, "vocab_size": 50}})
    assert problems and problems[0].startswith("workload.params.config.vocab_size (50)")
    # ... and on the worker, where a text's characters are counted.
    with pytest.raises(WorkloadError, match=r"workload.params.config.vocab_size: .* 50 token"):
        params = {"config": {**LLAMA, "vocab_size": 50}, "data_path": _text(tmp_path, 60)}
        build(HfCausalLmParams.model_validate(params | {"seq_len": 16}))


def test_params_need_exactly_one_model_source() -> None:
    assert params_problems("hf_causal_lm", {})[0].startswith("workload.params.model:")
    both = {"config": LLAMA, "model": "m"}
    assert params_problems("hf_causal_lm", both)[0].startswith("workload.params.model:")
    no_type = params_problems("hf_causal_lm", {"config": {"hidden_size": 8}})
    assert no_type[0].startswith("workload.params.config.model_type")


def test_tensor_parallel_degree_must_divide_the_heads() -> None:
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\)"):
        spec({"kind": "tp", "tensor_parallel": 4}, max_workers=4)


def test_no_pipeline_split() -> None:
    with pytest.raises(ValueError, match="hf_causal_lm workload has no pipeline split"):
        spec({"kind": "pipeline", "pipeline_stages": 2, "microbatches": 2})


def test_auto_is_refused_its_size_is_unknown_at_submit() -> None:
    with pytest.raises(ValueError, match=r"strategy\.kind: 'auto' plans from the model's size"):
        spec({"kind": "auto"})


def test_builds_from_a_local_folder(tmp_path: Path) -> None:
    first = build(HfCausalLmParams(config=LLAMA, seq_len=16)).model
    first.lm.save_pretrained(tmp_path / "m")
    again = build(HfCausalLmParams(model=str(tmp_path / "m"), seq_len=16)).model
    x = torch.randint(0, 65, (1, 16))
    torch.testing.assert_close(again(x), first(x), rtol=0, atol=0)
    with pytest.raises(WorkloadError, match=r"workload\.params\.model: cannot load"):
        build(HfCausalLmParams(model=str(tmp_path / "absent"), seq_len=16))


def _text(folder: Path, chars: int) -> str:
    """A text file of `chars` distinct characters."""
    path = folder / "text.txt"
    path.write_text("".join(chr(0x4E00 + i) for i in range(chars)) * 4, encoding="utf-8")
    return str(path)


# -- export -----------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["ddp", "fsdp", "tp"])
def test_export_loads_in_transformers_with_the_checkpoints_logits(
    runs: dict[str, Any], label: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    info = pick_checkpoint(runs["root"] / label, None)
    assert info.step == STEPS
    files = export_checkpoint(info, "hf_causal_lm", {"config": LLAMA}, tmp_path)
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(files)
    loaded, report = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not report["missing_keys"] and not report["unexpected_keys"]
    # The checkpoint's model: the workload's, with the checkpoint's weights.
    reference = build(HfCausalLmParams(config=LLAMA, seq_len=16)).model
    reference.load_state_dict(load_model_weights(info), strict=True)
    x = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, reference(x))


def test_gpt_exports_as_gpt2(runs: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from elastrain.workers.workloads.gpt import build as build_gpt

    info = pick_checkpoint(runs["root"] / "gpt", None)
    export_checkpoint(info, "gpt", GPT, tmp_path)
    loaded, report = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(loaded, GPT2LMHeadModel)
    assert not report["missing_keys"] and not report["unexpected_keys"]
    reference = build_gpt(GptParams.model_validate(GPT)).model
    reference.load_state_dict(load_model_weights(info), strict=True)
    x = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, reference(x))


def test_export_picks_a_step_and_names_the_ones_there_are(runs: dict[str, Any]) -> None:
    root = runs["root"] / "ddp"
    assert pick_checkpoint(root, STEPS).step == STEPS
    with pytest.raises(ExportError, match=rf"step 99: .*\(steps: {STEPS}\)"):
        pick_checkpoint(root, 99)
    with pytest.raises(ExportError, match="no committed checkpoint"):
        pick_checkpoint(runs["root"] / "nothing", None)
    assert list_committed(root)


def test_the_child_process_exports_and_refuses_a_damaged_checkpoint(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """What the API runs: `python -m elastrain.checkpoints.dcp.export` in a child process."""
    import shutil

    info = pick_checkpoint(runs["root"] / "tp", None)
    export_in_child(
        info.path, "hf_causal_lm", {"config": LLAMA}, tmp_path / "ok", trusted_root=runs["root"]
    )
    assert (tmp_path / "ok" / "model.safetensors").is_file()
    damaged = tmp_path / "damaged" / info.path.name
    shutil.copytree(info.path, damaged)
    shard = next(damaged.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=rf"^{info.path.name}: .*digest"):
        export_in_child(damaged, "hf_causal_lm", {"config": LLAMA}, tmp_path / "bad")
