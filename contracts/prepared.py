"""A prepared data set (`elastrain prepare`): token shards and their index, as files.

```
<out>/index.json                 written last: what a gpt/hf_causal_lm job reads
<out>/shards/<name>.bin          an input's (or part's) documents' token ids, flat little-endian
<out>/shards/<name>.docs         where each of them ends (uint64 token offsets)
<out>/shards/<name>.done.json    written after both: that input is finished (a retry skips it)
```

One shard per input file, in the sorted order of the inputs, or per part of a file larger
than `PART_BYTES` (text, JSON lines and Parquet are cut into parts, each its own task, so
that one big file uses every CPU; the parts' shards follow each other in the file's
order, so the token stream is the same however a file is cut); its documents in the
input's row order, each followed by the tokenizer's end-of-text token when it has one.
The held-out documents are a fixed, evenly spread share of the documents by their number
over all shards (`is_eval_document`): a document is all training or all held-out, so a
training window never holds a held-out token. Torch- and numpy-free: the control plane
checks and expands inputs with it, the workers write and read the files by it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from elastrain.contracts.datasets import SHARED_DATA_DIR, TENANT_DATA_DIR
from elastrain.contracts.files import read_bounded

INDEX_FILE = "index.json"
SHARDS_DIR = "shards"
#: The version of the layout above, in index.json.
FORMAT = 1
#: The kinds of input, by how they are read.
TEXT, JSON_LINES, PARQUET, ARROW = "text", "json", "parquet", "arrow"
_SUFFIXES = {
    ".txt": TEXT, ".text": TEXT, ".md": TEXT,
    ".jsonl": JSON_LINES, ".json": JSON_LINES, ".ndjson": JSON_LINES,
    ".parquet": PARQUET, ".pq": PARQUET,
    ".arrow": ARROW,
}  # fmt: skip
#: A Hugging Face `save_to_disk` folder holds this (with `dataset_info.json`) beside its
#: `*.arrow` files (Arrow IPC streams), which it lists in `_data_files`.
HF_STATE_FILE = "state.json"
#: The most input files one prepare job takes (each is a shard and a done marker).
MAX_INPUT_FILES = 100_000
#: The most a prepared folder's index.json and a save_to_disk folder's state.json may hold.
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_STATE_BYTES = 1024 * 1024
#: A text, JSON lines or Parquet file larger than this is prepared in parts of this many
#: bytes, each by its own task (about 10 s of one core's tokenizing), and a retry redoes
#: at most the parts not finished. Fixed, not derived from the cluster's CPUs: a retry on
#: fewer nodes must find the same parts done.
PART_BYTES = 32 * 1024 * 1024


class InputError(ValueError):
    """An input cannot be prepared; the message names it and says why."""


@dataclass(frozen=True)
class InputFile:
    """An input file, or the part of it whose records start in bytes [start, stop)."""

    path: str
    """Relative to the storage root (`data/<tenant>/...` or `shared/...`)."""
    kind: str
    size: int
    mtime_ns: int
    start: int = 0
    stop: int = -1
    """-1: to the end of the file."""

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop in (-1, self.size)

    @property
    def length(self) -> int:
        """The bytes of the file this part covers."""
        return (self.size if self.stop == -1 else self.stop) - self.start

    @property
    def key(self) -> str:
        """Names the part among an input's parts (a whole file: its path)."""
        return self.path if self.whole else f"{self.path}@{self.start}"

    def marker(self) -> dict[str, Any]:
        """What a done marker records of the input: a changed file is prepared again."""
        part = {} if self.whole else {"start": self.start, "stop": self.stop}
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns, **part}


def parts_of(source: InputFile, splittable: bool, part_bytes: int = PART_BYTES) -> list[InputFile]:
    """The parts a file is prepared in: itself when small or not splittable (Arrow: a
    `save_to_disk` set is already cut into files; a JSON array), else consecutive byte
    ranges of `part_bytes`, the last one to the end."""
    if not splittable or source.kind == ARROW or source.size <= part_bytes:
        return [source]
    starts = range(0, source.size, part_bytes)
    return [replace(source, start=lo, stop=min(lo + part_bytes, source.size)) for lo in starts]


def kind_of(path: Path) -> str | None:
    return _SUFFIXES.get(path.suffix.lower())


def area_of(pattern: str) -> tuple[str, ...]:
    """The data area a storage-relative pattern lies in: (`data`, tenant) or (`shared`,)."""
    parts = Path(pattern).parts
    if parts[:1] == (SHARED_DATA_DIR,) and len(parts) > 1:
        return parts[:1]
    if parts[:1] == (TENANT_DATA_DIR,) and len(parts) > 2:
        return parts[:2]
    raise InputError(f"{pattern!r} lies in no data area")


def storage_relative_pattern(pattern: str, storage_root: Path, owner: str) -> str:
    """A tenant's input pattern (relative to its area, `shared/...`, or absolute inside
    either) relative to the storage root, as the workers expand it. Raises InputError."""
    raw = Path(pattern)
    if ".." in raw.parts:
        raise InputError(f"{pattern!r}: '..' is not allowed")
    root = storage_root.resolve()
    own, shared = root / TENANT_DATA_DIR / owner, root / SHARED_DATA_DIR
    if raw.is_absolute():
        if raw.is_relative_to(own):
            raw = raw.relative_to(own)
        elif raw.is_relative_to(shared):
            raw = Path(SHARED_DATA_DIR) / raw.relative_to(shared)
        else:
            raise InputError(f"{pattern!r} is outside your data area")
    if not raw.parts or raw.parts == (SHARED_DATA_DIR,):
        raise InputError(f"{pattern!r} names no file")
    if raw.parts[0] == SHARED_DATA_DIR:
        return str(raw)
    return str(Path(TENANT_DATA_DIR) / owner / raw)


def expand_inputs(patterns: list[str], storage_root: Path) -> list[InputFile]:
    """The files storage-relative `patterns` name (globs allowed, `**` too), sorted and
    without repeats; a `save_to_disk` folder is its `.arrow` files. Every match is resolved
    (links followed) and must stay in the pattern's own data area. Raises InputError for a
    pattern that matches nothing, a match outside its area, or a file of no known kind."""
    root = storage_root.resolve()
    found: dict[str, InputFile] = {}
    for pattern in patterns:
        area = root.joinpath(*area_of(pattern)).resolve()
        matches = sorted(root.glob(pattern)) if _is_glob(pattern) else [root / pattern]
        matches = [m for m in matches if m.exists()]
        if not matches:
            raise InputError(f"{_as_given(pattern)!r} matched no file in your data area")
        for match in matches:
            for real in _files_of(match, pattern):
                if not real.is_relative_to(area):
                    raise InputError(
                        f"{_as_given(pattern)!r}: a match is outside your data area (links "
                        "resolved)"
                    )
                kind = kind_of(real)
                if kind is None:
                    raise InputError(
                        f"{_as_given(pattern)!r}: {real.name!r} is not .txt, .jsonl, .json, "
                        ".parquet, .arrow nor a save_to_disk folder"
                    )
                stat = real.stat()
                rel = str(real.relative_to(root))
                found[rel] = InputFile(rel, kind, stat.st_size, stat.st_mtime_ns)
        if len(found) > MAX_INPUT_FILES:
            raise InputError(f"more than {MAX_INPUT_FILES} input files")
    return [found[k] for k in sorted(found)]


def _files_of(match: Path, pattern: str) -> list[Path]:
    real = match.resolve()
    if real.is_file():
        return [real]
    state = real / HF_STATE_FILE
    if real.is_dir() and state.is_file():
        try:
            state_json = read_bounded(str(state), MAX_STATE_BYTES)  # a job may have written it
            files = [f["filename"] for f in json.loads(state_json)["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{_as_given(pattern)!r}: a bad {HF_STATE_FILE} ({exc})") from exc
        return [(real / name).resolve() for name in files]
    if real.is_dir():
        raise InputError(
            f"{_as_given(pattern)!r}: {match.name!r} is a folder but not a save_to_disk data "
            f"set (no {HF_STATE_FILE}); name its files (e.g. {match.name}/*.jsonl)"
        )
    return []


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _as_given(pattern: str) -> str:
    """A storage-relative pattern as the tenant wrote it (its own area dropped)."""
    parts = Path(pattern).parts
    return str(Path(*parts[2:])) if parts[:1] == (TENANT_DATA_DIR,) else pattern


def is_eval_document(i: int, fraction: float) -> bool:
    """Whether document `i` (counted over all shards) is held out: exactly
    `floor(n * fraction)` of the first n documents are, spread evenly (one every
    1/fraction), so a held-out share does not depend on how the inputs were cut."""
    return fraction > 0 and math.floor((i + 1) * fraction) > math.floor(i * fraction)


def eval_count(n: int, fraction: float) -> int:
    return math.floor(n * fraction) if fraction > 0 else 0


def token_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class Shard:
    """One input's (or part's) tokens: `<out>/shards/<name>.bin` and `.docs`."""

    name: str
    source: str
    tokens: int
    documents: int
    rows: int
    bytes: int

    @property
    def bin_file(self) -> str:
        return f"{SHARDS_DIR}/{self.name}.bin"

    @property
    def docs_file(self) -> str:
        return f"{SHARDS_DIR}/{self.name}.docs"


@dataclass(frozen=True)
class Index:
    vocab_size: int
    token_dtype: str
    tokenizer: str
    eos_id: int | None
    text_field: str
    eval_fraction: float
    shards: list[Shard] = field(default_factory=list)
    train_tokens: int = 0
    eval_tokens: int = 0
    format: int = FORMAT

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_json(self) -> str:
        body = asdict(self)
        body["documents"] = self.documents
        body["tokens"] = self.tokens
        body["eval_documents"] = eval_count(self.documents, self.eval_fraction)
        body["split"] = "document i is held out when floor((i+1)*f) > floor(i*f)"
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Index:
        body = json.loads(text)
        if body.get("format") != FORMAT:
            raise ValueError(f"index format {body.get('format')!r}, expected {FORMAT}")
        shards = [Shard(**s) for s in body["shards"]]
        keys = ("vocab_size", "token_dtype", "tokenizer", "eos_id", "text_field",
                "eval_fraction", "train_tokens", "eval_tokens")  # fmt: skip
        return cls(shards=shards, **{k: body[k] for k in keys})


def read_index(folder: Path) -> Index:
    """The index of a prepared folder. Raises ValueError (a missing or bad index.json)."""
    try:
        # Written by a job: a link, a FIFO or a file of any size is refused, not followed.
        return Index.from_json(read_bounded(str(folder / INDEX_FILE), MAX_INDEX_BYTES).decode())
    except OSError as exc:
        raise ValueError(f"no readable {INDEX_FILE} ({exc.strerror})") from exc
    except (KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"a bad {INDEX_FILE} ({exc!r})") from exc


def is_prepared(folder: Path) -> bool:
    return folder.is_dir() and (folder / INDEX_FILE).is_file()


def out_folder(out: str, storage_root: Path, owner: str) -> Path:
    """The folder a prepare job writes: `out` in the owner's own area (never the shared
    one, never outside), links resolved. Raises InputError."""
    raw = Path(out)
    if raw.is_absolute() or ".." in raw.parts or raw.parts[:1] == (SHARED_DATA_DIR,):
        raise InputError(
            f"{out!r}: a folder name in your own data area (relative, no '..', not shared/)"
        )
    area = (storage_root / TENANT_DATA_DIR / owner).resolve()
    real = (area / raw).resolve()
    if not real.is_relative_to(area) or real == area:
        raise InputError(f"{out!r} is outside your data area (links resolved)")
    if real.exists() and not real.is_dir():
        raise InputError(f"{out!r} exists and is not a folder")
    if real.is_dir() and any(real.iterdir()) and not (real / SHARDS_DIR).is_dir():
        raise InputError(
            f"{out!r} holds other files (no earlier prepare's {SHARDS_DIR}/); name a new folder"
        )
    return real


def prepare_problems(params: Any, storage_root: Path, owner: str) -> list[str]:
    """What is wrong with a prepare job's params for `owner` (a PrepareParams), one line
    per problem, each starting with `workload.params.<key>`: inputs that match nothing or
    lie outside the data area, a missing tokenizer, an out folder it may not write."""
    from elastrain.contracts.datasets import tokenizer_problems

    problems = list(tokenizer_problems(params, storage_root, owner))
    patterns: list[str] = []
    for i, pattern in enumerate(params.inputs):
        try:
            patterns.append(storage_relative_pattern(pattern, storage_root, owner))
            expand_inputs(patterns[-1:], storage_root)
        except InputError as exc:
            problems.append(f"workload.params.inputs.{i}: {exc}")
    try:
        out_folder(params.out, storage_root, owner)
    except InputError as exc:
        problems.append(f"workload.params.out: {exc}")
    return problems


def prepared_problems(params: Any, path: str, folder: Path) -> list[str]:
    """What is wrong with training a gpt or hf_causal_lm (`params`) on the prepared folder
    its data_path names: the folder carries its vocabulary, dtype and split."""
    where = "workload.params.data_path"
    if not is_prepared(folder):
        if (folder / SHARDS_DIR).is_dir():
            return [
                f"{where}: {path!r} is not finished (no {INDEX_FILE}); is its prepare job done?"
            ]
        return [
            f"{where}: {path!r} is not a regular file, nor a prepared folder (with {INDEX_FILE})"
        ]
    try:
        index = read_index(folder)
    except ValueError as exc:
        return [f"{where}: {path!r}: {exc}"]
    own = ("token_dtype", "vocab_size", "tokenizer", "eval_path", "eval_fraction")
    given = [k for k in own if getattr(params, k) is not None]
    if given:
        return [
            f"workload.params.{given[0]}: {path!r} is prepared: its index gives the "
            "vocabulary, the token ids' type and the held-out documents; leave it out"
        ]
    window = params.seq_len + 1
    problems = []
    if index.train_tokens < window:
        problems.append(
            f"{where}: {index.train_tokens} training tokens, fewer than one window of "
            f"seq_len + 1 = {window}"
        )
    if 0 < index.eval_tokens < window:
        problems.append(
            f"{where}: {index.eval_tokens} held-out tokens, fewer than one window of seq_len "
            f"+ 1 = {window}; prepare with a larger --eval-fraction, or 0"
        )
    config = getattr(params, "config", None) or {}
    model_vocab = config.get("vocab_size")
    if isinstance(model_vocab, int) and model_vocab < index.vocab_size:
        problems.append(
            f"workload.params.config.vocab_size ({model_vocab}) is smaller than the prepared "
            f"data's vocabulary ({index.vocab_size}); raise config.vocab_size"
        )
    return problems


def storage_relative_prepare_paths(
    params: dict[str, Any], storage_root: Path, owner: str
) -> dict[str, Any]:
    """A prepare job's params as its worker receives them: every input pattern, the
    tokenizer and the out folder relative to the storage root, checked again at every
    launch (links may have changed since the submit). The worker expands the patterns in
    their own areas (`expand_inputs`). Raises InputError or DataPathError."""
    from elastrain.contracts.datasets import DataPathError, resolve_data_path

    root = storage_root.resolve()
    out = dict(params)
    inputs = []
    for i, pattern in enumerate(params.get("inputs") or []):
        try:
            inputs.append(storage_relative_pattern(pattern, root, owner))
        except InputError as exc:
            raise InputError(f"workload.params.inputs.{i}: {exc}") from exc
    out["inputs"] = inputs
    if isinstance(params.get("tokenizer"), str):
        try:
            real = resolve_data_path(params["tokenizer"], root, owner)
        except DataPathError as exc:
            raise DataPathError(f"workload.params.tokenizer: {exc}") from exc
        out["tokenizer"] = str(real.relative_to(root))
    try:
        out["out"] = str(out_folder(str(params.get("out")), root, owner).relative_to(root))
    except InputError as exc:
        raise InputError(f"workload.params.out: {exc}") from exc
    return out
