"""The gpt workload's data files on the storage root: where they are, and whether they can work.

A `data_path` (and `eval_path`) names a file under the storage root, the folder every node
shares: relative to it (`data/shakespeare/train.bin`) or absolute inside it. The API checks
at submit what can be checked without reading the data (the path stays inside the root once
links are resolved, the file exists and is a regular file, a binary file holds whole token
ids, there are enough tokens for one training window on each side of the split), so that a
typo is a 422 naming the field, not an attempt that fails on a worker. The workers resolve
the path the same way (`workers.workloads.load_workload`). Torch-free.
"""

from __future__ import annotations

import math
from pathlib import Path

from contracts.workload_params import TOKEN_WIDTH, GptParams


class DataPathError(ValueError):
    """The path cannot name a data file under the storage root; the message says why."""


def resolve_data_path(path: str, storage_root: Path) -> Path:
    """The real absolute path of a data file, refusing anything outside the storage root."""
    raw = Path(path)
    if ".." in raw.parts:
        raise DataPathError(f"{path!r}: '..' is not allowed; name the file from the storage root")
    root = storage_root.resolve()
    real = (raw if raw.is_absolute() else root / raw).resolve()
    if not real.is_relative_to(root):
        raise DataPathError(f"{path!r} lies outside the storage root ({root}), links resolved")
    return real


def split_sizes(tokens: int, held_out_fraction: float) -> tuple[int, int]:
    """(training tokens, held-out tokens) of a file of `tokens`: the held-out part is the
    end of the file, rounded up."""
    held = math.ceil(tokens * held_out_fraction) if held_out_fraction > 0 else 0
    return tokens - held, held


def data_path_problems(params: GptParams, storage_root: Path) -> list[str]:
    """What is wrong with the params' data files, one line per problem, each starting with
    `workload.params.<key>:` ([] when they can work, or when no data_path is given)."""
    window = params.seq_len + 1
    problems: list[str] = []
    for key in ("data_path", "eval_path"):
        path = getattr(params, key)
        if path is None:
            continue
        where = f"workload.params.{key}"
        try:
            real = resolve_data_path(path, storage_root)
        except DataPathError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if not real.exists():
            problems.append(
                f"{where}: {path!r} does not exist under the storage root "
                f"({storage_root.resolve()}); copy the data there first"
            )
            continue
        if not real.is_file():
            problems.append(f"{where}: {path!r} is not a regular file")
            continue
        size = real.stat().st_size
        if params.token_dtype is not None:
            width = TOKEN_WIDTH[params.token_dtype]
            if size % width:
                problems.append(
                    f"{where}: {size} bytes is not a whole number of {params.token_dtype} "
                    f"token ids ({width} bytes each); is token_dtype right?"
                )
                continue
            tokens = size // width
        else:
            tokens = size  # an upper bound for UTF-8 text: the worker counts characters
        if key == "eval_path":
            if tokens < window:
                problems.append(f"{where}: {tokens} tokens, fewer than one window ({window})")
            continue
        train, held = split_sizes(tokens, params.held_out_fraction)
        if train < window:
            problems.append(
                f"{where}: {train} tokens for training, fewer than one window of seq_len + 1 "
                f"= {window}"
            )
        if 0 < held < window:
            problems.append(
                f"{where}: {held} held-out tokens, fewer than one window of seq_len + 1 = "
                f"{window}; hold out more (eval_fraction) or give an eval_path"
            )
    return problems
