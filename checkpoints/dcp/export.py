"""A committed checkpoint as a Hugging Face model folder: `config.json`,
`model.safetensors` (and `generation_config.json` where the model has one), which
`AutoModelForCausalLM.from_pretrained(folder)` loads as it is.

The model's weights are read from the DCP checkpoint as whole tensors in this one
process (DCP reshards on load: a checkpoint saved by FSDP, tensor parallel or DDP at any
world size reads the same), verified against the manifest's digests as they are read
(`elastrain.checkpoints.dcp.reader.VerifyingReader`), without the optimizer state. Then:

- `hf_causal_lm` jobs: the workload's own HF model, its parameter names without the
  wrapper's `lm.` prefix, saved with `save_pretrained` (which drops tied copies);
- `gpt` jobs: the same weights as a `GPT2LMHeadModel` (`gpt_to_gpt2`): the fused
  attention projection is reordered from the gpt's per-head `[q k v]` rows to GPT-2's
  `[q | k | v]`, and every Linear is transposed into GPT-2's `Conv1D` layout.

Needs torch and `transformers` (the `hf` extra). The API runs it in a child process
(`elastrain.checkpoints.export.export_in_child`): `python -m elastrain.checkpoints.dcp.export CHECKPOINT
WORKLOAD PARAMS_JSON OUT [MODEL_FOLDER]`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from elastrain.checkpoints.catalog import CheckpointInfo
from elastrain.checkpoints.export import EXPORTABLE, REFUSED, ExportError
from elastrain.checkpoints.integrity import CorruptCheckpoint
from elastrain.checkpoints.manifest import ManifestError, read_manifest

#: The hf_causal_lm wrapper's prefix (`elastrain.workers.workloads.hf_causal_lm.PREFIX`).
_HF_PREFIX = "lm."


def load_model_weights(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The model's weights in the checkpoint as whole tensors, by parameter name (the
    optimizer state is not read). Raises CorruptCheckpoint when a file fails its digest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from elastrain.checkpoints.dcp.checkpointer import corrupt_shard_reason
    from elastrain.checkpoints.dcp.reader import VerifyingReader

    reader = VerifyingReader(info.path, expected=info.manifest.files, process_group=None)
    metadata = reader.read_metadata()
    weights: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            weights[key.removeprefix("model.")] = torch.empty(
                meta.size, dtype=meta.properties.dtype
            )
    if not weights:
        raise ExportError(f"checkpoint of step {info.step} holds no model weights")
    with warnings.catch_warnings():  # one process on purpose, no process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # DCP wraps the reader's CorruptCheckpoint in its
            # CheckpointException, a BaseException
            reason = corrupt_shard_reason(exc)
            if reason is None:
                raise
            raise CorruptCheckpoint(info.path, reason) from exc
    return weights


def export_checkpoint(
    info: CheckpointInfo,
    workload: str,
    params: Mapping[str, Any],
    out: Path,
    *,
    model_folder: Path | None = None,
) -> list[str]:
    """Write the checkpoint's model as a Hugging Face folder at `out`; returns the file
    names written. `params`: the job's `workload.params`; `model_folder`: an
    hf_causal_lm's `model` folder, resolved (its config is the model's)."""
    weights = load_model_weights(info)
    if workload == "hf_causal_lm":
        model = _hf_model(params, model_folder)
        _load_exactly(model, {k.removeprefix(_HF_PREFIX): v for k, v in weights.items()})
    elif workload == "gpt":
        model = _gpt2_model(params, weights)
        _load_exactly(model, gpt_to_gpt2(weights, n_head=int(params.get("n_head", 4))))
    else:
        raise ExportError(
            f"workload {workload!r}: only {' and '.join(EXPORTABLE)} jobs export as "
            "Hugging Face models"
        )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def _hf_model(params: Mapping[str, Any], model_folder: Path | None) -> Any:
    """The job's HF model, untrained (its weights come from the checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config_dict = params.get("config")
    if isinstance(config_dict, dict):
        fields = dict(config_dict)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    elif model_folder is not None:
        config = AutoConfig.from_pretrained(model_folder, local_files_only=True)
    else:
        raise ExportError("workload.params: neither config nor a model folder")
    model = AutoModelForCausalLM.from_config(config)
    if model_folder is not None and (model_folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_folder)
    return model.float()


def _load_exactly(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Load every weight, and refuse a checkpoint that misses or adds any: an export must
    be the trained model, not partly a fresh one. Tied copies count once."""
    result = model.load_state_dict(dict(weights), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ExportError(
            f"the checkpoint's weights do not fit the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


# ---------------------------------------------------------------------------------------
# gpt -> GPT-2
# ---------------------------------------------------------------------------------------


def _gpt2_model(params: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, n_embd = weights["tok_emb.weight"].shape
    config = GPT2Config(
        vocab_size=int(vocab),
        n_positions=int(weights["pos_emb.weight"].shape[0]),
        n_embd=int(n_embd),
        n_layer=int(params.get("n_layer", 4)),
        n_head=int(params.get("n_head", 4)),
        activation_function="gelu",  # the gpt's F.gelu (exact), not GPT-2's tanh one
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=False,  # the gpt's head is its own matrix
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def gpt_to_gpt2(weights: Mapping[str, torch.Tensor], *, n_head: int) -> dict[str, torch.Tensor]:
    """The gpt's parameters under GPT2LMHeadModel's names and layouts."""
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": weights["tok_emb.weight"],
        "transformer.wpe.weight": weights["pos_emb.weight"],
        "transformer.ln_f.weight": weights["ln_f.weight"],
        "transformer.ln_f.bias": weights["ln_f.bias"],
        "lm_head.weight": weights["head.weight"],
    }
    layers = sorted({int(k.split(".")[1]) for k in weights if k.startswith("blocks.")})
    for i in layers:
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{dst}{b}.weight"] = weights[f"{src}{a}.weight"]
            out[f"{dst}{b}.bias"] = weights[f"{src}{a}.bias"]
        w, bias = weights[f"{src}attn.in_proj.weight"], weights[f"{src}attn.in_proj.bias"]
        d = w.shape[1]
        # Rows [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (per head) -> [q | k | v], heads in order.
        w = w.view(n_head, 3, d // n_head, d).transpose(0, 1).reshape(3 * d, d)
        bias = bias.view(n_head, 3, d // n_head).transpose(0, 1).reshape(3 * d)
        out[f"{dst}attn.c_attn.weight"] = w.t().contiguous()  # Conv1D: (in, out)
        out[f"{dst}attn.c_attn.bias"] = bias.contiguous()
        for a, b in (
            ("attn.proj", "attn.c_proj"),
            ("mlp.fc", "mlp.c_fc"),
            ("mlp.proj", "mlp.c_proj"),
        ):
            out[f"{dst}{b}.weight"] = weights[f"{src}{a}.weight"].t().contiguous()
            out[f"{dst}{b}.bias"] = weights[f"{src}{a}.bias"]
    return out


def main(argv: list[str]) -> int:
    """`python -m elastrain.checkpoints.dcp.export CHECKPOINT WORKLOAD PARAMS_JSON OUT [MODEL]`:
    exit status `REFUSED` with the reason on stderr when the export cannot be made."""
    import json
    import sys

    checkpoint, workload, params, out, *folder = argv
    try:
        info = CheckpointInfo.from_manifest(Path(checkpoint), read_manifest(checkpoint))
        export_checkpoint(
            info, workload, json.loads(params), Path(out),
            model_folder=Path(folder[0]) if folder else None,
        )  # fmt: skip
    except (ExportError, CorruptCheckpoint, ManifestError) as exc:
        print(str(exc), file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
