"""Token streams for the gpt workload, cut into fixed windows.

Three sources: the bundled tiny Shakespeare (characters), a user's UTF-8 text file
(characters: the vocabulary is the sorted set of characters, exactly as for the bundled
corpus; or, with `tokenizer`, the ids a Hugging Face tokenizer gives it, the vocabulary
the tokenizer's), or a flat file of little-endian uint16/uint32 token ids (nanoGPT's `train.bin`),
memory-mapped, so a file larger than RAM costs only the pages the sampled windows touch.

Window `i` of a stream is always the same tokens, which is what the elastic sampler's
determinism (the same sample ids at any world size, after any resume) rests on. A held-out
split is either its own file (`eval_path`) or the END of `data_path`: the training windows
stop before it, so no training window ever contains a held-out token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from elastrain.contracts.datasets import split_sizes, tokenizer_file
from elastrain.workers.workloads import WorkloadError

if TYPE_CHECKING:
    from elastrain.workers.workloads.prepared_data import VirtualTokens

_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
#: Token ids checked against vocab_size this many at a time (bounded memory on any file).
_CHECK_CHUNK = 1 << 24


class TokenWindows:
    """Indexable `(input, target)` pairs over tokens[start:end]: window `i` covers
    [start + i*stride, start + i*stride + seq_len + 1); inputs are its first seq_len tokens,
    targets its last seq_len, both int64."""

    def __init__(
        self,
        tokens: torch.Tensor | np.ndarray[Any, Any] | VirtualTokens,
        seq_len: int,
        stride: int | None = None,
        *,
        start: int = 0,
        end: int | None = None,
    ) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride or seq_len + 1  # default: non-overlapping windows
        self.start = start
        self.end = len(tokens) if end is None else end
        span = self.end - self.start
        self._len = max(0, (span - (seq_len + 1)) // self.stride + 1) if span > seq_len else 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range [0, {self._len})")
        lo = self.start + i * self.stride
        window = self.tokens[lo : lo + self.seq_len + 1]
        if isinstance(window, np.ndarray):
            window = torch.from_numpy(window.astype(np.int64))
        else:
            window = window.long()
        return window[:-1], window[1:]


def char_vocab(*texts: str) -> tuple[str, ...]:
    return tuple(sorted(set().union(*texts)))


def encode_chars(text: str, vocab: tuple[str, ...]) -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long)


@dataclass(frozen=True)
class TokenData:
    train: TokenWindows
    held_out: TokenWindows | None
    vocab_size: int


def load_token_data(
    *,
    data_path: str,
    token_dtype: str | None,
    vocab_size: int | None,
    eval_path: str | None,
    held_out_fraction: float,
    seq_len: int,
    stride: int | None,
    tokenizer: str | None = None,
) -> TokenData:
    """The user's data as training windows and (maybe) held-out windows."""
    if Path(data_path).is_dir():
        return _load_prepared(data_path, seq_len, stride)
    tokens: torch.Tensor | np.ndarray[Any, Any]
    held_tokens: torch.Tensor | np.ndarray[Any, Any] | None
    if tokenizer is not None:
        encode, size = _tokenizer(tokenizer)
        tokens = encode(_read_text(data_path, "data_path"))
        held_tokens = encode(_read_text(eval_path, "eval_path")) if eval_path else None
    elif token_dtype is None:
        text = _read_text(data_path, "data_path")
        held_text = _read_text(eval_path, "eval_path") if eval_path else ""
        vocab = char_vocab(text, held_text)
        tokens = encode_chars(text, vocab)
        held_tokens = encode_chars(held_text, vocab) if eval_path else None
        size = len(vocab)
    else:
        if vocab_size is None:
            raise WorkloadError("workload.params.vocab_size: required with token_dtype")
        tokens = _map_ids(data_path, token_dtype, vocab_size, "data_path")
        held_tokens = (
            _map_ids(eval_path, token_dtype, vocab_size, "eval_path") if eval_path else None
        )
        size = vocab_size
    train_end, held = split_sizes(len(tokens), held_out_fraction)
    train = TokenWindows(tokens, seq_len, stride, end=train_end)
    if len(train) == 0:
        raise WorkloadError(
            f"workload.params.data_path: {train_end} training tokens, fewer than one window "
            f"of seq_len + 1 = {seq_len + 1}"
        )
    held_out = None
    if held_tokens is not None:
        held_out = TokenWindows(held_tokens, seq_len, stride)
    elif held:
        held_out = TokenWindows(tokens, seq_len, stride, start=train_end)
    return TokenData(train=train, held_out=held_out, vocab_size=size)


def _load_prepared(folder: str, seq_len: int, stride: int | None) -> TokenData:
    """A prepared folder's windows: its training documents' stream, and its held-out
    documents' (`elastrain.workers.workloads.prepared_data`)."""
    from elastrain.workers.workloads.prepared_data import prepared_streams

    try:
        index, train_tokens, held_tokens = prepared_streams(Path(folder))
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"workload.params.data_path: {folder} ({exc})") from exc
    train = TokenWindows(train_tokens, seq_len, stride)
    if len(train) == 0:
        raise WorkloadError(
            f"workload.params.data_path: {len(train_tokens)} training tokens, fewer than one "
            f"window of seq_len + 1 = {seq_len + 1}"
        )
    held = TokenWindows(held_tokens, seq_len, stride) if len(held_tokens) else None
    return TokenData(train=train, held_out=held, vocab_size=index.vocab_size)


#: Text is tokenized in pieces of about this many characters, cut after a newline.
_ENCODE_CHARS = 1 << 20


def _tokenizer(path: str) -> tuple[Callable[[str], np.ndarray[Any, Any]], int]:
    """A Hugging Face tokenizer's `encode` (text -> token ids) and its vocabulary size,
    from `path` (a tokenizer.json, or a folder holding one)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # the hf extra is not installed on this worker
        raise WorkloadError(
            "workload.params.tokenizer: the workers lack the `tokenizers` library (the "
            "hf extra: pip install 'elastrain[hf]')"
        ) from exc
    try:
        tok = Tokenizer.from_file(str(tokenizer_file(Path(path))))
    except Exception as exc:  # tokenizers raises its own Exception for a bad file
        raise WorkloadError(f"workload.params.tokenizer: cannot load {path} ({exc})") from exc
    size = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if size <= 2**16 else np.uint32

    def encode(text: str) -> np.ndarray[Any, Any]:
        # In pieces cut after a newline (encoded as one, with the Rust library's threads):
        # the whole of a large file as one string would be one long sequence.
        pieces, start = [], 0
        while start < len(text):
            end = text.find("\n", start + _ENCODE_CHARS)
            end = len(text) if end < 0 else end + 1
            pieces.append(text[start:end])
            start = end
        ids = [e.ids for e in tok.encode_batch(pieces, add_special_tokens=False)]
        return np.fromiter((i for part in ids for i in part), dtype=dtype)

    return encode, size


def _read_text(path: str, key: str) -> str:
    try:
        return Path(path).read_text("utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(
            f"workload.params.{key}: {path} is not UTF-8 text ({exc.reason} at byte "
            f"{exc.start}); for token ids give token_dtype"
        ) from exc
    except OSError as exc:
        raise WorkloadError(f"workload.params.{key}: cannot read {path} ({exc})") from exc


def _map_ids(path: str, token_dtype: str, vocab_size: int, key: str) -> np.ndarray[Any, Any]:
    dtype = _NUMPY_DTYPES[token_dtype]
    try:
        ids: np.ndarray[Any, Any] = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"workload.params.{key}: cannot map {path} ({exc})") from exc
    for lo in range(0, len(ids), _CHECK_CHUNK):
        top = int(ids[lo : lo + _CHECK_CHUNK].max())
        if top >= vocab_size:
            raise WorkloadError(
                f"workload.params.vocab_size: {path} holds token id {top}, not below "
                f"vocab_size {vocab_size}"
            )
    return ids
