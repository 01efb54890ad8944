"""The `hf_causal_lm` workload: a Hugging Face causal LM (`transformers`, the `hf` extra)
trained by elastrain's own loop, on the gpt's token streams.

The model comes from `config` (`AutoConfig.for_model(**config)`, then
`AutoModelForCausalLM.from_config`: untrained, seeded like every other workload) or from a
local folder (`from_pretrained(folder, local_files_only=True)`): nothing is downloaded.

`HfCausalLM` wraps the model so that the loop sees what it expects of any workload: token
ids in, logits out (the gpt's `lm_loss` then applies: targets are already shifted by the
windows, so HF's own label shifting is not used), `shard_units()` (the decoder layers: FSDP
units and activation-checkpointing units) and `tensor_parallel_plan()` (the model's own TP
plan, `base_model_tp_plan` in its config, mapped onto torch's DTensor parallel styles). Its
parameters are the HF model's under `lm.`: `lm.model.layers.0.self_attn.q_proj.weight`;
the export (`elastrain.checkpoints.export`) strips the prefix back off.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from elastrain.contracts.workload_params import HfCausalLmParams
from elastrain.workers.api import Workload
from elastrain.workers.workloads import WorkloadError
from elastrain.workers.workloads.gpt import lm_loss, token_windows

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle
    from transformers import PreTrainedModel

#: The wrapper's name for the HF model: a prefix of every parameter name in checkpoints.
PREFIX = "lm."

#: HF TP styles that ignore the module's layout and need nothing from us: the strategy
#: replicates whatever the plan leaves whole.
_REPLICATED_STYLES = frozenset({"replicate", "replicated_with_grad_allreduce"})


class HfCausalLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab) of the wrapped HF causal LM."""

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No KV cache in training: it only costs memory.
        logits: torch.Tensor = self.lm(input_ids=x, use_cache=False).logits
        return logits

    def shard_units(self) -> list[nn.Module]:
        """The decoder layers (the classes HF itself never splits across devices,
        `_no_split_modules`): FSDP shards them one by one, then the root."""
        kinds = set(getattr(self.lm, "_no_split_modules", None) or ())
        return [m for m in self.lm.modules() if type(m).__name__ in kinds]

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """The model's own TP plan (`model.tp_plan`: `base_model_tp_plan` of its config plus
        the LM head's), on torch's DTensor styles (`tp_style`), with every `*` expanded to
        the layer indices the model has. A plan entry whose module is absent is dropped
        (e.g. a gate a config turned off)."""
        hf_plan = _hf_tp_plan(self.lm)
        if not hf_plan:
            raise ValueError(
                f"the {type(self.lm).__name__} model has no tensor-parallel plan "
                "(base_model_tp_plan in its config): use ddp or fsdp"
            )
        modules = [name for name, _ in self.lm.named_modules() if name]
        plan: dict[str, ParallelStyle] = {}
        for pattern, style in hf_plan.items():
            if style in _REPLICATED_STYLES:
                continue
            torch_style = tp_style(style, pattern)
            # HF's `*` stands for one name part (a layer index), not any run of them.
            regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
            for name in modules:
                if regex.fullmatch(name):
                    plan[PREFIX + name] = torch_style
        if _tied(self.lm) and plan:
            raise ValueError(
                "tensor parallelism of a model whose LM head is tied to its embeddings "
                "(tie_word_embeddings) is not supported: untie them in the config, or use "
                "ddp or fsdp"
            )
        return plan


def tp_style(style: str, where: str = "") -> ParallelStyle:
    """A Hugging Face TP style name (transformers' `ALL_PARALLEL_STYLES`) as torch's DTensor
    style, with the layouts HF gives it: `colwise` splits a Linear's outputs and hands the
    next layer its shard, `rowwise` splits inputs and all-reduces, the `_rep` and
    `_gather_output` variants take or give whole tensors, `embedding_rowwise` splits an
    embedding's vocabulary rows (the partial sums are all-reduced). The styles for packed,
    MoE and sequence-parallel layers are not mapped: a clear error, not a wrong split."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    if style in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    raise ValueError(
        f"tensor-parallel style {style!r} of {where or 'a module'} in the model's plan is not "
        "supported by elastrain (colwise, rowwise and their _rep / gather / embedding "
        "variants are): use ddp or fsdp"
    )


def _hf_tp_plan(lm: nn.Module) -> dict[str, str]:
    """The model's TP plan, FQN patterns -> style names, from whichever transformers this
    is: `model.tp_plan` (v5) or the class's `_tp_plan` plus the config's
    `base_model_tp_plan` under the base model's prefix (v4)."""
    plan = getattr(lm, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return {str(k): str(v) for k, v in plan.items()}
    merged: dict[str, str] = {}
    prefix = getattr(lm, "base_model_prefix", "")
    base = getattr(getattr(lm, "config", None), "base_model_tp_plan", None) or {}
    for key, value in base.items():
        merged[f"{prefix}.{key}" if prefix else key] = value
    merged.update(getattr(type(lm), "_tp_plan", None) or {})
    return merged


def _tied(lm: nn.Module) -> bool:
    out = getattr(lm, "get_output_embeddings", lambda: None)()
    emb = getattr(lm, "get_input_embeddings", lambda: None)()
    return out is not None and emb is not None and out.weight is emb.weight


# ---------------------------------------------------------------------------------------
# Building the model
# ---------------------------------------------------------------------------------------


def build_model(params: HfCausalLmParams) -> PreTrainedModel:
    """The HF model the params name, on CPU in float32 (the strategies move it and cast
    for mixed precision). Raises WorkloadError naming the field."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise WorkloadError(
            "workload.name: hf_causal_lm needs transformers on the workers (pip install "
            "'elastrain[hf]')"
        ) from exc
    if params.config is not None:
        config = dict(params.config)
        model_type = config.pop("model_type")
        try:
            hf_config = AutoConfig.for_model(model_type, **config)
        except (ValueError, TypeError) as exc:
            raise WorkloadError(f"workload.params.config: {exc}") from exc
        try:
            model = AutoModelForCausalLM.from_config(hf_config)
        except (ValueError, TypeError) as exc:
            raise WorkloadError(f"workload.params.config: {exc}") from exc
    else:
        assert params.model is not None  # the params' validator: exactly one
        try:
            model = AutoModelForCausalLM.from_pretrained(params.model, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise WorkloadError(
                f"workload.params.model: cannot load {params.model} ({exc})"
            ) from exc
    model.float()  # the folder's weights may be half precision; parameters train in fp32
    model.train()
    return model


def model_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the input embedding: the ids the model can take."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0])


def build(params: HfCausalLmParams) -> Workload:
    """The built-in `hf_causal_lm` workload: the gpt's data, a Hugging Face model."""
    data = token_windows(params)
    lm = build_model(params)
    vocab = model_vocab_size(lm)
    if data.vocab_size > vocab:
        field = "config.vocab_size" if params.config is not None else "model"
        raise WorkloadError(
            f"workload.params.{field}: the model takes {vocab} token ids, the data has "
            f"{data.vocab_size} (workload.params.vocab_size, the tokenizer's, or the text's "
            "characters): "
            "every token id must have an embedding row"
        )
    wrapped = HfCausalLM(lm)
    n_params = sum(p.numel() for p in wrapped.parameters())
    layers = len(wrapped.shard_units())
    hidden = int(getattr(lm.config, "hidden_size", 0) or 0)
    seq = params.seq_len
    return Workload(
        model=wrapped,
        dataset=data.train,
        eval_dataset=data.held_out,
        loss_fn=lm_loss,
        tokens_per_sample=seq,
        # The gpt's count: 6 FLOPs per parameter per token plus the attention's 12·L·d·T.
        flops_per_sample=seq * (6.0 * n_params + 12.0 * layers * hidden * seq),
    )
