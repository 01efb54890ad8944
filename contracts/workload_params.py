"""The built-in workloads' parameters, typed: checked at submit, not discovered by a worker.

Torch-free, so the API validates `workload.params` of a `gpt` or `synthetic` job the moment
it is submitted: an unknown key, a wrong type or an impossible value is a 422 that names
`workload.params.<key>` and what is allowed, instead of an attempt that fails on a worker
and burns restarts. The workers' factories (`workers/workloads/`) take these models as they
are, so the fields and their defaults are written here only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

Count = Annotated[StrictInt, Field(ge=1)]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


DataPath = Annotated[str, Field(min_length=1, max_length=1024)]
#: Bytes per token id of each binary format.
TOKEN_WIDTH = {"uint16": 2, "uint32": 4}
#: Held out of `data_path` when no `eval_path` is given (nanoGPT's split).
DEFAULT_EVAL_FRACTION = 0.1
#: The bundled tiny Shakespeare's vocabulary: its distinct characters.
BUNDLED_VOCAB = 65


class _TokenData:
    """The data fields' meaning, shared by the built-ins that read token streams (the gpt,
    hf_causal_lm): `data_path`, `token_dtype`, `vocab_size`, `eval_path`, `eval_fraction`,
    `tokenizer`."""

    if TYPE_CHECKING:  # fields of the pydantic models this is mixed into
        data_path: str | None
        tokenizer: str | None
        eval_path: str | None
        eval_fraction: float | None

    @property
    def held_out_fraction(self) -> float:
        """The share of the token stream (its end) held out for evaluation: eval_fraction,
        by default 0.1 of a data_path without eval_path and none of the bundled corpus."""
        if self.eval_path is not None:
            return 0.0
        if self.eval_fraction is not None:
            return self.eval_fraction
        return DEFAULT_EVAL_FRACTION if self.data_path is not None else 0.0

    @property
    def has_held_out(self) -> bool:
        return self.eval_path is not None or self.held_out_fraction > 0


def token_data_problem(p: Any) -> str | None:
    """What is inconsistent in the data fields of a gpt or hf_causal_lm's params, or None."""
    needs_data = [k for k in ("token_dtype", "vocab_size", "eval_path")
                  if getattr(p, k) is not None]  # fmt: skip
    if p.data_path is None and needs_data:
        return (
            f"workload.params.{needs_data[0]}: only with workload.params.data_path (the "
            "bundled corpus has its own vocabulary)"
        )
    if p.token_dtype is not None and p.vocab_size is None:
        return (
            "workload.params.vocab_size: required with token_dtype (the number of "
            "distinct token ids; every id in the file must be below it)"
        )
    if p.token_dtype is None and p.vocab_size is not None:
        return (
            "workload.params.vocab_size: only with token_dtype (a text file's vocabulary "
            "is its characters)"
        )
    if p.token_dtype == "uint16" and (p.vocab_size or 0) > 2**16:
        return (
            f"workload.params.vocab_size ({p.vocab_size}) does not fit uint16 ids "
            "(at most 65536); use token_dtype uint32"
        )
    if p.eval_path is not None and p.eval_fraction is not None:
        return "workload.params.eval_fraction: give eval_path or eval_fraction, not both"
    if p.tokenizer is not None and (p.data_path is None or p.token_dtype is not None):
        return (
            "workload.params.tokenizer: only with a text data_path (token_dtype files hold "
            "token ids already; the bundled corpus is characters)"
        )
    return None


class GptParams(_TokenData, _Params):
    """A GPT decoder on the bundled tiny Shakespeare corpus (characters), or on the user's
    data under the storage root: UTF-8 text (characters) or a flat file of token ids."""

    n_layer: Annotated[Count, Field(le=128)] = 4
    n_embd: Annotated[Count, Field(le=16384)] = 128
    n_head: Annotated[Count, Field(le=256)] = 4
    seq_len: Annotated[Count, Field(le=65536)] = 64
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    stride: Annotated[Count, Field(le=65536)] | None = None
    data_path: DataPath | None = None
    """Under the storage root (relative to it, or absolute inside it): text, or token ids."""
    token_dtype: Literal["uint16", "uint32"] | None = None
    """None: data_path is UTF-8 text, one token per character. Else flat little-endian ids."""
    vocab_size: Annotated[StrictInt, Field(ge=1, le=2**32)] | None = None
    eval_path: DataPath | None = None
    """A held-out file in the same format; else the last `eval_fraction` of data_path."""
    eval_fraction: Annotated[float, Field(ge=0, lt=1)] | None = None
    tokenizer: DataPath | None = None
    """A Hugging Face tokenizer in the data area: a folder holding `tokenizer.json` (or the
    file): a text data_path is tokenized with it instead of one token per character, and
    the vocabulary is the tokenizer's. Loaded with the `tokenizers` library; nothing is
    downloaded."""

    @model_validator(mode="after")
    def _consistent(self) -> GptParams:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"workload.params.n_embd ({self.n_embd}) must be divisible by "
                f"workload.params.n_head ({self.n_head})"
            )
        if (problem := token_data_problem(self)) is not None:
            raise ValueError(problem)
        return self


class HfCausalLmParams(_TokenData, _Params):
    """A Hugging Face causal LM (`transformers`), built from a config or a local folder,
    trained on the same token streams as the gpt. Nothing is downloaded."""

    model: DataPath | None = None
    """A folder in the tenant's data area holding `config.json` (and maybe weights,
    `model.safetensors`): loaded with `from_pretrained(folder, local_files_only=True)`."""
    config: dict[str, Any] | None = None
    """A config to build an untrained model from: `AutoConfig.for_model(**config)`, so it
    names `model_type` (e.g. llama) and that model's fields (hidden_size, ...)."""
    seq_len: Annotated[Count, Field(le=65536)] = 64
    stride: Annotated[Count, Field(le=65536)] | None = None
    data_path: DataPath | None = None
    token_dtype: Literal["uint16", "uint32"] | None = None
    vocab_size: Annotated[StrictInt, Field(ge=1, le=2**32)] | None = None
    eval_path: DataPath | None = None
    eval_fraction: Annotated[float, Field(ge=0, lt=1)] | None = None
    tokenizer: DataPath | None = None
    """As the gpt's: a folder holding `tokenizer.json`, for a text data_path."""

    @model_validator(mode="after")
    def _consistent(self) -> HfCausalLmParams:
        if (self.model is None) == (self.config is None):
            raise ValueError(
                "workload.params.model: give exactly one of model (a local folder with "
                "config.json) or config (e.g. {model_type: llama, hidden_size: 64, ...})"
            )
        if self.config is not None:
            if not isinstance(self.config.get("model_type"), str):
                raise ValueError(
                    "workload.params.config.model_type: required, a transformers model type "
                    "such as 'llama'"
                )
            model_vocab = self.config.get("vocab_size")
            data_vocab = self.data_vocab_size
            if isinstance(model_vocab, int) and data_vocab is not None and data_vocab > model_vocab:
                raise ValueError(
                    f"workload.params.config.vocab_size ({model_vocab}) is smaller than the "
                    f"data's vocabulary ({data_vocab}): every token id must have an "
                    "embedding row; raise config.vocab_size"
                )
        if (problem := token_data_problem(self)) is not None:
            raise ValueError(problem)
        return self

    @property
    def data_vocab_size(self) -> int | None:
        """The data's vocabulary when known without reading it (a text file's is not)."""
        if self.data_path is None:
            return BUNDLED_VOCAB
        return self.vocab_size  # None for text: its characters', or its tokenizer's


class SyntheticParams(_Params):
    """MSE regression on seeded random data (tests and benchmarks)."""

    num_samples: Annotated[Count, Field(le=100_000_000)] = 4096
    in_dim: Annotated[Count, Field(le=65536)] = 16
    hidden: Annotated[Count, Field(le=65536)] = 64
    out_dim: Annotated[Count, Field(le=65536)] = 4
    n_layer: Annotated[Count, Field(le=128)] = 4
    data_seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 1234


class PrepareParams(_Params):
    """`elastrain prepare`: text, JSON lines, Parquet or `save_to_disk` data sets in the
    data area tokenized on the cluster with Ray Data into token shards and an index in
    the folder `out` (`elastrain.contracts.prepared`), which a gpt or hf_causal_lm's
    `data_path` names."""

    inputs: Annotated[list[DataPath], Field(min_length=1, max_length=256)]
    """Files in the data area, globs allowed (`books/*.jsonl`, `wiki/**/*.parquet`), or
    `save_to_disk` folders."""
    tokenizer: DataPath
    """A folder holding `tokenizer.json` (or the file), as the gpt's."""
    out: Annotated[str, Field(min_length=1, max_length=255)]
    """The folder to write, in the tenant's own data area."""
    text_field: Annotated[str, Field(min_length=1, max_length=255)] = "text"
    """The column (JSON lines, Parquet, save_to_disk) holding each document's text."""
    eval_fraction: Annotated[float, Field(ge=0, lt=1)] = DEFAULT_EVAL_FRACTION
    """The share of documents held out (whole documents, evenly spread)."""
    batch_rows: Annotated[Count, Field(le=65536)] = 256
    """Documents per tokenizer call in each Ray Data task."""


BUILTIN_PARAMS: dict[str, type[_Params]] = {
    "gpt": GptParams,
    "hf_causal_lm": HfCausalLmParams,
    "synthetic": SyntheticParams,
    "prepare": PrepareParams,
}


def params_problems(workload: str, params: dict[str, Any]) -> list[str]:
    """What is wrong with `params` for the built-in `workload`, one line per problem, each
    starting with `workload.params.<key>` ([] when they are fine)."""
    model = BUILTIN_PARAMS[workload]
    try:
        model.model_validate(params)
    except ValidationError as exc:
        allowed = ", ".join(model.model_fields)
        problems = []
        for error in exc.errors():
            key = ".".join(str(p) for p in error["loc"])
            msg = str(error["msg"]).removeprefix("Value error, ")
            if not key:  # a check across fields: its message names them
                problems.append(msg)
            elif error["type"] == "extra_forbidden":
                problems.append(
                    f"workload.params.{key}: unknown parameter of {workload!r}; allowed: {allowed}"
                )
            else:
                problems.append(f"workload.params.{key}: {msg}")
        return problems
    return []
