"""`elastrain prepare-text INPUT OUT_DIR`: a text file as the gpt workload's token files.

Writes nanoGPT's layout: `train.bin` and `val.bin` (flat little-endian token ids, uint16
when the vocabulary fits, else uint32) and `meta.json` (vocab_size, token_dtype, the
vocabulary, token counts). The tokenizer is the bundled corpus's: one token per character,
ids in the sorted order of the characters, so the bundled text prepared here trains on
exactly the ids the built-in corpus uses. The held-out part is the end of the text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class PrepareError(ValueError):
    """The input cannot become token files; the message says why."""


@dataclass(frozen=True)
class Prepared:
    out_dir: Path
    vocab_size: int
    token_dtype: str
    train_tokens: int
    val_tokens: int


def prepare_text(source: Path, out_dir: Path, *, eval_fraction: float = 0.1) -> Prepared:
    if not 0 <= eval_fraction < 1:
        raise PrepareError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    try:
        text = source.read_text("utf-8")
    except UnicodeDecodeError as exc:
        raise PrepareError(
            f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from exc
    except OSError as exc:
        raise PrepareError(f"cannot read {source}: {exc.strerror}") from exc
    if not text:
        raise PrepareError(f"{source} is empty")
    vocab = sorted(set(text))
    dtype, name = (
        (np.dtype("<u2"), "uint16") if len(vocab) <= 2**16 else (np.dtype("<u4"), "uint32")
    )
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = np.fromiter((index[ch] for ch in text), dtype=dtype, count=len(text))
    held = math.ceil(len(ids) * eval_fraction) if eval_fraction > 0 else 0
    train, val = ids[: len(ids) - held], ids[len(ids) - held :]
    out_dir.mkdir(parents=True, exist_ok=True)
    train.tofile(out_dir / "train.bin")
    val.tofile(out_dir / "val.bin")
    meta = {
        "source": source.name,
        "tokenizer": "characters (sorted)",
        "vocab_size": len(vocab),
        "token_dtype": name,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "vocab": vocab,
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    return Prepared(out_dir, len(vocab), name, len(train), len(val))
