"""Training windows over a prepared folder (`elastrain prepare`, `elastrain.contracts.prepared`).

Each shard's token ids are memory-mapped, never copied: a window reads the pages it
touches. The training stream is the virtual concatenation of the training documents (in
shard order, each shard's in its row order), the held-out stream that of the held-out
documents, so documents are packed into windows and no window crosses the split. Both are
fixed by the files: window `i` is always the same tokens, at any world size and after any
resume, which is what the elastic sampler's determinism rests on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from elastrain.contracts.prepared import INDEX_FILE, Index, read_index

_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DOC_ENDS = np.dtype("<u8")


def eval_mask(first: int, n: int, fraction: float) -> np.ndarray[Any, Any]:
    """Which of documents first..first+n-1 are held out: `contracts.prepared.is_eval_document`,
    vectorized (the same float arithmetic, so the same answer)."""
    if fraction <= 0:
        return np.zeros(n, dtype=bool)
    i = np.arange(first, first + n, dtype=np.float64)
    return np.floor((i + 1) * fraction) > np.floor(i * fraction)


def split_runs(
    ends: np.ndarray[Any, Any], held: np.ndarray[Any, Any], want_held: bool
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The [lo, hi) token ranges of one shard covered by runs of consecutive documents of
    one side of the split (`ends`: each document's end offset; `held`: its mask), as two
    int64 arrays."""
    chosen = held if want_held else ~held
    ends = np.asarray(ends, dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1])).astype(np.int64)
    edges = np.diff(np.concatenate(([False], chosen, [False])).astype(np.int8))
    first_docs, last_docs = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
    return starts[first_docs], ends[last_docs]


class VirtualTokens:
    """Token ranges of memory-mapped shards read as one sequence: `len()` and `[lo:hi]`
    (a fresh array of the tokens, gathered across ranges). The ranges are numpy arrays,
    not Python objects: a few bytes per run of documents, at any size."""

    def __init__(
        self,
        shards: list[np.ndarray[Any, Any]],
        shard: np.ndarray[Any, Any],
        lo: np.ndarray[Any, Any],
        hi: np.ndarray[Any, Any],
    ) -> None:
        keep = hi > lo
        self._shards = shards
        self._shard, self._lo = shard[keep].astype(np.int64), lo[keep].astype(np.int64)
        self._starts = np.concatenate(([0], np.cumsum(hi[keep] - lo[keep], dtype=np.int64)))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, span: slice) -> np.ndarray[Any, Any]:
        lo, hi, _ = span.indices(len(self))
        out = []
        k = int(np.searchsorted(self._starts, lo, side="right")) - 1
        while lo < hi and k < len(self._lo):
            offset = lo - int(self._starts[k])
            take = min(hi - lo, int(self._starts[k + 1]) - lo)
            start = int(self._lo[k]) + offset
            out.append(np.asarray(self._shards[int(self._shard[k])][start : start + take]))
            lo += take
            k += 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def prepared_streams(folder: Path) -> tuple[Index, VirtualTokens, VirtualTokens]:
    """The index, the training and the held-out token streams of a prepared folder."""
    index = read_index(folder)
    dtype = _DTYPES[index.token_dtype]
    shards: list[np.ndarray[Any, Any]] = []
    sides: dict[bool, list[tuple[np.ndarray[Any, Any], ...]]] = {False: [], True: []}
    first = 0
    for shard in index.shards:
        if shard.tokens:
            ids: np.ndarray[Any, Any] = np.memmap(folder / shard.bin_file, dtype=dtype, mode="r")
            ends: np.ndarray[Any, Any] = np.memmap(
                folder / shard.docs_file, dtype=DOC_ENDS, mode="r"
            )
            if len(ends) != shard.documents or len(ids) != shard.tokens:
                raise ValueError(f"shard {shard.name}: its files do not match {INDEX_FILE}")
            held = eval_mask(first, shard.documents, index.eval_fraction)
            for side in (False, True):
                lo, hi = split_runs(ends, held, want_held=side)
                sides[side].append((np.full(len(lo), len(shards), dtype=np.int64), lo, hi))
            shards.append(ids)
        first += shard.documents

    def stream(parts: list[tuple[np.ndarray[Any, Any], ...]]) -> VirtualTokens:
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return VirtualTokens(shards, empty, empty, empty)
        return VirtualTokens(shards, *(np.concatenate(c) for c in zip(*parts, strict=True)))

    return index, stream(sides[False]), stream(sides[True])
