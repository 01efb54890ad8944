"""A committed checkpoint as a Hugging Face model folder that
`AutoModelForCausalLM.from_pretrained(folder)` loads as it is.

The model's weights are read as whole tensors in one process (DCP reshards: any strategy
or world size reads the same), digest-verified before they are decoded, without the
optimizer state. `hf_causal_lm` jobs save the workload's HF model (names without the
wrapper's `lm.`); `gpt` jobs a `GPT2LMHeadModel` (`gpt_to_gpt2`).

Needs torch and `transformers`; run in a child process by
`elastrain.checkpoints.export.export_in_child` (see `main`).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from elastrain.checkpoints.catalog import CheckpointInfo
from elastrain.checkpoints.confined import open_dir
from elastrain.checkpoints.dcp.untrusted import (
    UntrustedCheckpoint,
    UntrustedReader,
    check_allocation,
    fd_path,
)
from elastrain.checkpoints.export import EXPORTABLE, REFUSED, ExportError
from elastrain.checkpoints.integrity import CorruptCheckpoint
from elastrain.checkpoints.manifest import ManifestError, read_manifest
from elastrain.contracts.files import ConfinedFileError, read_bounded

#: A model folder's config.json / generation_config.json: a few KiB in practice.
MAX_CONFIG_BYTES = 1024 * 1024

#: The hf_causal_lm wrapper's prefix (`elastrain.workers.workloads.hf_causal_lm.PREFIX`).
_HF_PREFIX = "lm."


def load_model_weights(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The model's weights as whole tensors, by parameter name, read as untrusted input.
    Raises CorruptCheckpoint for a bad digest, UntrustedCheckpoint for a folder no reader
    may trust."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from elastrain.checkpoints.dcp.checkpointer import corrupt_shard_reason

    reader = UntrustedReader(info.path, expected=info.manifest.files, process_group=None)
    metadata = reader.read_metadata()
    wanted = [
        key
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    ]
    if not wanted:
        raise ExportError(f"checkpoint of step {info.step} holds no model weights")
    check_allocation(metadata, wanted, Path(info.path))
    weights: dict[str, torch.Tensor] = {}
    for key in wanted:
        meta = metadata.state_dict_metadata[key]
        assert isinstance(meta, TensorStorageMetadata)
        weights[key.removeprefix("model.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # one process on purpose, no process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
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
    """Write the model as a Hugging Face folder at `out`; returns the names written.
    `params`: `workload.params`; `model_folder`: an hf_causal_lm's resolved `model`."""
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
    """The job's HF model, untrained. Of the tenant's model folder only JSON is read."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config_dict = params.get("config")
    generation: dict[str, Any] | None = None
    fields: dict[str, Any] | None
    if isinstance(config_dict, dict):
        fields = dict(config_dict)
    elif model_folder is not None:
        fields = _folder_json(model_folder, "config.json")
        if fields is None:
            raise ExportError(f"workload.params.model: {params.get('model')} has no config.json")
        generation = _folder_json(model_folder, "generation_config.json")
    else:
        raise ExportError("workload.params: neither config nor a model folder")
    config = _config_for(fields, params)
    model = AutoModelForCausalLM.from_config(config)
    if generation is not None:
        try:
            model.generation_config = GenerationConfig.from_dict(generation)
        except (ValueError, TypeError) as exc:
            raise ExportError(f"workload.params.model: generation_config.json: {exc}") from None
    return model.float()


def _config_for(fields: dict[str, Any], params: Mapping[str, Any]) -> Any:
    """A transformers config of a model type transformers ships (never `auto_map`'s code)."""
    from transformers import AutoConfig

    where = "config" if isinstance(params.get("config"), dict) else "model"
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        custom = " (auto_map: a model with code of its own)" if "auto_map" in fields else ""
        raise ExportError(
            f"workload.params.{where}: the config names no model_type{custom}; an export "
            "needs a model type transformers ships"
        )
    fields.pop("auto_map", None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"workload.params.{where}: model_type {model_type!r}: {exc}") from None


def _folder_json(folder: Path, name: str) -> dict[str, Any] | None:
    """A JSON object of the model folder, read bounded and through no link; None if absent."""
    try:
        data = read_bounded(str(folder / name), MAX_CONFIG_BYTES)
    except FileNotFoundError:
        return None
    except ConfinedFileError as exc:
        raise ExportError(f"workload.params.model: {exc}") from None
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ExportError(f"workload.params.model: {name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ExportError(f"workload.params.model: {name} is not a JSON object")
    return value


def _load_exactly(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Load every weight; refuse missing or extra ones (an export must be the trained
    model, not partly a fresh one). Tied copies count once."""
    result = model.load_state_dict(dict(weights), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ExportError(
            f"the checkpoint's weights do not fit the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


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
    """The gpt's parameters under GPT2LMHeadModel's names and layouts: the fused
    attention rows reordered, every Linear transposed into `Conv1D`'s (in, out)."""
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
    """`python -m elastrain.checkpoints.dcp.export CHECKPOINT WORKLOAD PARAMS_JSON OUT
    MODEL_FOLDER TRUSTED_ROOT` (the last two may be empty): exit status `REFUSED`, the
    reason on stderr, when it cannot be made. The checkpoint is entered from TRUSTED_ROOT
    (else its parent) through no link, and read through that fd."""
    checkpoint, workload, params, out, folder, root = (*argv, "", "")[:6]
    step_dir = Path(checkpoint)
    try:
        fd = open_dir(Path(root) if root else step_dir.parent, step_dir)
        try:
            info = CheckpointInfo.from_manifest(fd_path(fd), read_manifest(fd_path(fd)))
            export_checkpoint(
                info, workload, json.loads(params), Path(out),
                model_folder=Path(folder) if folder else None,
            )  # fmt: skip
        finally:
            os.close(fd)
    except (CorruptCheckpoint, ManifestError) as exc:
        print(f"{step_dir.name}: {exc.reason}", file=sys.stderr)
        return REFUSED
    except (ExportError, UntrustedCheckpoint, ConfinedFileError) as exc:
        print(f"{step_dir.name}: {exc}", file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
