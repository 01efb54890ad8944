"""A small GPT-style decoder LM: on the Tiny Shakespeare corpus shipped with the package, or
on the user's own text or token ids under the storage root (`data_path`).

The bundled corpus has character-level tokens (the vocabulary is the sorted set of its
characters, 65 symbols), so nothing is downloaded and the tokenizer is a dict. Samples are
fixed, non-overlapping windows of `seq_len + 1` tokens (`token_data.TokenWindows`): the
first `seq_len` are the input, the last `seq_len` the next-token targets. Sample `i` is
always the same window, which is what the elastic sampler's determinism rests on.

Blocks live in an `nn.ModuleDict` keyed by their index as a string ("0", "1", ...). That
keeps parameter names (`blocks.3.attn.in_proj.weight`) identical when a pipeline stage keeps
only some of the blocks, so a checkpoint saved under one split loads under any other.
"""

from __future__ import annotations

import math
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from elastrain.contracts.datasets import split_sizes
from elastrain.contracts.workload_params import GptParams, HfCausalLmParams
from elastrain.workers.api import Workload
from elastrain.workers.workloads import stage_block_range
from elastrain.workers.workloads.token_data import (
    TokenData,
    TokenWindows,
    char_vocab,
    encode_chars,
    load_token_data,
)

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

CORPUS = "tinyshakespeare.txt"


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def load_corpus() -> tuple[torch.Tensor, tuple[str, ...]]:
    """The corpus as a 1-D int64 tensor of character ids, and the vocabulary (id -> char)."""
    text = (
        resources.files("elastrain.workers.workloads").joinpath("data", CORPUS).read_text("utf-8")
    )
    vocab = char_vocab(text)
    return encode_chars(text, vocab), vocab


def token_windows(params: GptParams | HfCausalLmParams) -> TokenData:
    """The training (and held-out) windows the params' data fields name: the bundled
    corpus without `data_path`, else the user's file (`token_data.load_token_data`)."""
    if params.data_path is None:
        tokens, vocab = load_corpus()
        train_end, held = split_sizes(len(tokens), params.held_out_fraction)
        train = TokenWindows(tokens, params.seq_len, params.stride, end=train_end)
        held_out = (
            TokenWindows(tokens, params.seq_len, params.stride, start=train_end) if held else None
        )
        return TokenData(train=train, held_out=held_out, vocab_size=len(vocab))
    return load_token_data(
        data_path=params.data_path, token_dtype=params.token_dtype,
        vocab_size=params.vocab_size, eval_path=params.eval_path,
        held_out_fraction=params.held_out_fraction, seq_len=params.seq_len,
        stride=params.stride, tokenizer=params.tokenizer,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused input projection.

    `in_proj`'s output rows are grouped by head, `[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`
    (Megatron's fused layout) rather than `[q | k | v]`: tensor parallelism splits the
    rows into contiguous blocks, and this order gives each rank whole heads with their
    queries, keys and values, so attention needs no communication. The head count a rank
    runs is read from the projection's output, which is why it is not stored.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.in_proj = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (B, T, heads*3*hd) -> three (B, heads, T, hd), the layout SDPA expects; `heads`
        # is this rank's share under tensor parallelism.
        qkv = self.in_proj(x).view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab).

    Any of `tok_emb`/`pos_emb`/`drop` (first stage) and `ln_f`/`head` (last stage) may be
    None in a pipeline stage: then the stage takes or returns hidden states (B, T, n_embd)
    instead. The LM head is deliberately not tied to the token embedding, because the two
    live on different pipeline stages.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        n_layer: int,
        n_embd: int,
        n_head: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.n_layer = n_layer
        self.tok_emb: nn.Embedding | None = nn.Embedding(vocab_size, n_embd)
        self.pos_emb: nn.Embedding | None = nn.Embedding(seq_len, n_embd)
        self.drop: nn.Dropout | None = nn.Dropout(dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(n_embd, n_head, dropout) for i in range(n_layer)}
        )
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(n_embd)
        self.head: nn.Linear | None = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(_init_weights)
        # GPT-2 style: scale residual projections by depth so the residual stream's
        # variance does not grow with n_layer.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            assert self.pos_emb is not None and self.drop is not None
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            assert self.ln_f is not None
            x = self.head(self.ln_f(x))
        return x

    def shard_units(self) -> list[nn.Module]:
        """FSDP shards these one by one (per block), then the root (embeddings, head)."""
        return list(self.blocks.values())

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """How tensor parallelism splits this model (Megatron-style, on DTensor).

        In each block the attention's fused input projection and the MLP's first layer
        are split by output features (column parallel) and their output projections by
        input features (row parallel): a rank computes whole heads and a slice of the
        MLP's hidden units, and each block costs one all-reduce in the forward for
        attention and one for the MLP (and two in the backward). The embeddings are split
        by rows (token / position ids; the partial sums are all-reduced) and the LM head
        by vocabulary, its logits gathered for the loss. The layer norms are not split;
        the strategy replicates them. Only the modules this (pipeline stage) model holds
        are named.
        """
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, ParallelStyle] = {}
        if self.tok_emb is not None:
            plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
            plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate())
        for name in self.blocks:
            plan[f"blocks.{name}.attn.in_proj"] = ColwiseParallel()
            plan[f"blocks.{name}.attn.proj"] = RowwiseParallel()
            plan[f"blocks.{name}.mlp.fc"] = ColwiseParallel()
            plan[f"blocks.{name}.mlp.proj"] = RowwiseParallel()
        if self.head is not None:
            plan["head"] = ColwiseParallel(output_layouts=Replicate())
        return plan

    def pipeline_stage(self, stage_index: int, num_stages: int) -> GPT:
        """The part of the model pipeline stage `stage_index` of `num_stages` runs.

        The stage shares its sub-modules (and so its parameters) with `self`; use it in
        place of the full model, not alongside it.
        """
        lo, hi = stage_block_range(self.n_layer, stage_index, num_stages)
        stage = GPT.__new__(GPT)
        nn.Module.__init__(stage)
        stage.seq_len, stage.n_layer = self.seq_len, self.n_layer
        first, last = stage_index == 0, stage_index == num_stages - 1
        stage.tok_emb = self.tok_emb if first else None
        stage.pos_emb = self.pos_emb if first else None
        stage.drop = self.drop if first else None
        stage.blocks = nn.ModuleDict({str(i): self.blocks[str(i)] for i in range(lo, hi)})
        stage.ln_f = self.ln_f if last else None
        stage.head = self.head if last else None
        return stage


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------


def build(params: GptParams) -> Workload:
    """The built-in `gpt` workload. The default params are ~0.8M parameters: trains on CPU.

    Without `data_path` it trains on the bundled corpus; with it, on the user's data
    (`elastrain.workers.workloads.token_data`; the service resolves the path under the storage root,
    `elastrain.contracts.datasets`), holding out `eval_path` or the end of the file.
    """
    data = token_windows(params)
    model = GPT(
        vocab_size=data.vocab_size,
        seq_len=params.seq_len,
        n_layer=params.n_layer,
        n_embd=params.n_embd,
        n_head=params.n_head,
        dropout=params.dropout,
    )
    n_params = sum(p.numel() for p in model.parameters())
    seq_len, n_layer, n_embd = params.seq_len, params.n_layer, params.n_embd
    return Workload(
        model=model,
        dataset=data.train,
        eval_dataset=data.held_out,
        loss_fn=lm_loss,
        tokens_per_sample=seq_len,
        # nanoGPT's and torchtitan's count: 6 FLOPs per parameter per token (2 forward,
        # 4 backward) plus the attention scores and their use, 12·L·d·T per token.
        flops_per_sample=seq_len * (6.0 * n_params + 12.0 * n_layer * n_embd * seq_len),
    )
