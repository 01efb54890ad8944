"""`elastrain prepare` on the cluster: input files tokenized by Ray Data into token shards.

A prepare job is one worker process (world size 1) that runs this instead of the training
loop. It lists the inputs (`elastrain.contracts.prepared.expand_inputs`), skips those a
done marker says are finished (a retried attempt redoes no finished file), and hands the
rest to Ray Data: one task per file reads it as a stream (text, JSON lines, Parquet, Arrow
IPC) and tokenizes its documents in batches with the `tokenizers` library, on whichever
node has a free CPU; this process only appends the ids each task yields to the file's
shard, in order, and reports progress (rows, bytes, tokens, tokens/s, ETA) as metric
points, shown by `elastrain metrics` and the dashboard like a training job's. The index
is written last.

A file, or a part of one larger than `PART_BYTES` (text, JSON lines, Parquet), is the
unit of parallelism and of resumption: one big file uses many CPUs too, and a retry redoes
only its unfinished parts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from elastrain.contracts.datasets import DataPathError, resolve_under, tokenizer_file
from elastrain.contracts.messages import Control, StepMetrics
from elastrain.contracts.prepared import (
    ARROW,
    INDEX_FILE,
    JSON_LINES,
    PARQUET,
    PART_BYTES,
    SHARDS_DIR,
    TEXT,
    Index,
    InputError,
    InputFile,
    Shard,
    area_of,
    expand_inputs,
    parts_of,
    token_dtype_for,
)
from elastrain.contracts.workload_params import PrepareParams
from elastrain.workers.workloads import WorkloadError
from elastrain.workers.workloads.prepared_data import DOC_ENDS, eval_mask

#: End-of-text tokens looked for, in this order, to close each document.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>")
#: A text file's documents are its paragraphs: separated by a blank line.
_PARAGRAPH = re.compile(r"\n[ \t]*\n")
#: A progress point at most this often (seconds).
REPORT_EVERY_S = 1.0
#: The last progress point's step, so that a retried attempt's points go on from it.
STEP_FILE = "step.json"
#: The CPUs one tokenizing task holds: one file at a time on one core.
TASK_CPUS = 1.0


def build(params: PrepareParams) -> Preparation:
    return Preparation(params)


@dataclass(frozen=True)
class Progress:
    files: int
    files_done: int
    rows: int
    bytes: int
    tokens: int
    total_bytes: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far, by input bytes (None before any)."""
        if self.bytes <= 0 or self.elapsed_s <= 0:
            return None
        return max(0.0, (self.total_bytes - self.bytes) * self.elapsed_s / self.bytes)

    def point(self, step: int) -> StepMetrics:
        return StepMetrics(
            step=step,
            loss=None,
            tokens_per_s=self.tokens_per_s,
            samples_per_s=self.rows / self.elapsed_s if self.elapsed_s > 0 else None,
            custom={
                "rows": self.rows,
                "bytes": self.bytes,
                "tokens": self.tokens,
                "files_done": self.files_done,
                "files": self.files,
                "progress": self.bytes / self.total_bytes if self.total_bytes else 1.0,
                "eta_s": self.eta_s,
            },
        )


# ---------------------------------------------------------------------------------------
# One file: documents, tokenized (runs in a Ray Data task, or in one process for a bench)
# ---------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    """The tokenizer (once per process): tasks on every node read it from the storage root."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def eos_id(tok: Any) -> int | None:
    for name in EOS_NAMES:
        if (found := tok.token_to_id(name)) is not None:
            return int(found)
    return None


def documents(
    source: InputFile, root: Path, field: str, batch: int
) -> Iterator[tuple[list[str], int]]:
    """Batches of one input's (or part's) documents' texts, each with the bytes of the part
    read so far. Raises InputError for a non-UTF-8 file, a missing or non-text field."""
    path = root / source.path
    stop = source.start + source.length
    if source.kind == TEXT:
        yield from _text_documents(path, batch, source.start, stop)
    elif source.kind == JSON_LINES:
        yield from _json_documents(path, field, batch, source.start, stop)
    elif source.kind == PARQUET:
        yield from _parquet_documents(path, field, batch, source.start, stop)
    elif source.kind == ARROW:
        yield from _arrow_documents(path, field, batch)
    else:
        raise InputError(f"{path.name}: unknown kind {source.kind!r}")


def splittable(source: InputFile, root: Path) -> bool:
    """Whether a file can be cut into parts: not a JSON array (one value, read whole)."""
    if source.kind != JSON_LINES:
        return True
    with (root / source.path).open("rb") as f:
        return not f.read(64).lstrip().startswith(b"[")


def _first_line_at(f: IO[bytes], start: int) -> int:
    """The offset of the first line starting at or after `start`: the line holding byte
    start - 1 belongs to the part before (the part a line starts in reads it whole)."""
    if start == 0:
        return 0
    f.seek(start - 1)
    f.readline()
    return f.tell()


def _lines(f: IO[bytes], pos: int) -> Iterator[tuple[int, bytes]]:
    f.seek(pos)
    for line in f:
        yield pos, line
        pos += len(line)


def _blank(line: bytes) -> bool:
    return not line.strip(b" \t\r\n")


def _follows_blank_line(f: IO[bytes], pos: int) -> bool:
    """Whether the line before the one starting at `pos` is blank (or there is none)."""
    if pos == 0:
        return True
    lo = max(0, pos - 4096)
    f.seek(lo)
    before = f.read(pos - lo)[:-1]  # without the newline that ends it
    if b"\n" in before or lo == 0:
        return _blank(before.rsplit(b"\n", 1)[-1])
    return _blank(before)  # a line over 4 KiB long: blank only if all of it is


def _text_documents(
    path: Path, batch: int, start: int, stop: int
) -> Iterator[tuple[list[str], int]]:
    """A text file's paragraphs (runs of non-blank lines) that start in [start, stop),
    read as a stream: a paragraph running past `stop` is read whole."""
    with path.open("rb") as f:
        pos = _first_line_at(f, start)
        # A paragraph begun before `start` belongs to the part before.
        inside = not _follows_blank_line(f, pos)
        docs: list[str] = []
        lines: list[bytes] = []
        first = pos
        for at, line in _lines(f, pos):
            if _blank(line):
                if lines:
                    docs.append(_decoded(b"".join(lines), path, first))
                    lines = []
                    if len(docs) >= batch:
                        yield docs, min(at, stop) - start
                        docs = []
                inside = False
                continue
            if inside:
                continue
            if not lines:
                if at >= stop:
                    break
                first = at
            lines.append(line)
        if lines:
            docs.append(_decoded(b"".join(lines), path, first))
        if docs:
            yield docs, stop - start


def _decoded(raw: bytes, path: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8").rstrip()
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path.name} is not UTF-8 text ({exc.reason} at byte {offset + exc.start})"
        ) from exc


def _json_documents(
    path: Path, field: str, batch: int, start: int, stop: int
) -> Iterator[tuple[list[str], int]]:
    with path.open("rb") as f:
        if start == 0 and f.read(64).lstrip().startswith(b"["):  # one array, not lines
            f.seek(0)
            rows = _json_loads(f.read(), path, "line 1")
            if not isinstance(rows, list):
                raise InputError(f"{path.name}: not JSON lines nor an array of objects")
            texts = [_field(r, field, path, f"row {n}") for n, r in enumerate(rows, 1)]
            for lo in range(0, len(texts), batch):
                yield texts[lo : lo + batch], f.tell()
            return
        texts, done = [], 0
        for n, (at, raw) in enumerate(_lines(f, _first_line_at(f, start)), 1):
            if at >= stop:
                break
            done = at + len(raw) - start
            if not raw.strip():
                continue
            # Line numbers are known in a file's first part; later parts name the byte.
            line = f"line {n}" if start == 0 else f"the line at byte {at}"
            row = _json_loads(raw, path, line)
            texts.append(_field(row, field, path, line.replace("line", "row", 1)))
            if len(texts) >= batch:
                yield texts, done
                texts = []
        if texts:
            yield texts, done


def _json_loads(raw: bytes, path: Path, line: str) -> Any:
    """`line`: where the value is, as the errors name it ("line 3")."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path.name} is not UTF-8 ({exc.reason} on {line}, byte {exc.start})"
        ) from exc
    except ValueError as exc:
        raise InputError(f"{path.name}: {line} is not JSON ({exc})") from exc


def _field(row: Any, field: str, path: Path, where: str) -> str:
    """`where`: the row, as the errors name it ("row 3")."""
    if not isinstance(row, dict) or field not in row:
        have = ", ".join(list(row)[:20]) if isinstance(row, dict) else type(row).__name__
        raise InputError(
            f"{path.name}: {where} has no field {field!r} (it has: {have}); give --text-field"
        )
    text = row[field]
    if not isinstance(text, str):
        raise InputError(f"{path.name}: {where}: {field!r} is {type(text).__name__}, not text")
    return text


def _check_column(schema: Any, field: str, path: Path) -> None:
    import pyarrow as pa  # type: ignore[import-untyped]

    if field not in schema.names:
        raise InputError(
            f"{path.name} has no column {field!r} (it has: {', '.join(schema.names[:20])}); "
            "give --text-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise InputError(f"{path.name}: column {field!r} is {kind}, not text")


def _parquet_documents(
    path: Path, field: str, batch: int, start: int, stop: int
) -> Iterator[tuple[list[str], int]]:
    """The rows of the row groups whose data starts in [start, stop)."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    with pq.ParquetFile(path) as f:
        _check_column(f.schema_arrow, field, path)
        groups = [i for i in range(f.num_row_groups) if start <= _group_offset(f, i) < stop]
        if not groups:
            return
        rows = max(1, sum(f.metadata.row_group(i).num_rows for i in groups))
        seen = 0
        for record in f.iter_batches(batch_size=batch, row_groups=groups, columns=[field]):
            seen += record.num_rows
            yield _texts(record.column(0)), int((stop - start) * seen / rows)


def _group_offset(f: Any, i: int) -> int:
    """Where a Parquet row group's data starts in the file."""
    column = f.metadata.row_group(i).column(0)
    offsets = [column.data_page_offset]
    if column.has_dictionary_page and column.dictionary_page_offset is not None:
        offsets.append(column.dictionary_page_offset)
    return int(min(offsets))


def _arrow_documents(path: Path, field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader: Any = pa.ipc.open_stream(source)  # what datasets' save_to_disk writes
            schema, records = reader.schema, iter(reader)
        except pa.ArrowInvalid:  # the Arrow file format (random access) instead
            source.seek(0)
            file = pa.ipc.open_file(source)
            schema = file.schema
            records = (file.get_batch(i) for i in range(file.num_record_batches))
        _check_column(schema, field, path)
        for record in records:
            column = record.column(record.schema.get_field_index(field))
            for lo in range(0, len(column), batch):
                yield _texts(column.slice(lo, batch)), source.tell()


def _texts(column: Any) -> list[str]:
    return [t for t in column.to_pylist() if t is not None]


def tokenize_file(
    source: InputFile, root: Path, tokenizer: str, field: str, batch: int, dtype: str
) -> Iterator[dict[str, Any]]:
    """One input's (or part's) documents tokenized, in pieces: the ids (each document
    closed by the end-of-text token, when the tokenizer has one) and where each document
    ends. A part with no documents yields one empty piece (its shard is empty); a whole
    file with none is an error."""
    tok = load_tokenizer(tokenizer)
    eos = eos_id(tok)
    np_dtype = np.dtype("<u2") if dtype == "uint16" else np.dtype("<u4")
    empty = True
    for texts, done in documents(source, root, field, batch):
        texts = [t for t in texts if t]
        if not texts:
            continue
        empty = False
        encoded = tok.encode_batch_fast(texts, add_special_tokens=False)
        flat: list[int] = []
        lengths = []
        for e in encoded:
            flat.extend(e.ids)
            if eos is not None:
                flat.append(eos)
            lengths.append(len(e.ids) + (eos is not None))
        yield _piece(source, np.asarray(flat, dtype=np_dtype), lengths, texts, done)
    if empty and source.whole:
        raise InputError(f"{Path(source.path).name} holds no text (empty input)")
    if empty:
        yield _piece(source, np.zeros(0, dtype=np_dtype), [], [], source.length)


def _piece(
    source: InputFile, ids: np.ndarray, lengths: list[int], texts: list[str], done: int
) -> dict[str, Any]:
    return {
        "key": source.key,
        "ids": ids.tobytes(),
        "lengths": np.asarray(lengths, dtype=DOC_ENDS).tobytes(),
        "rows": len(texts),
        "bytes": sum(len(t.encode("utf-8")) for t in texts),
        "tokens": len(ids),
        "done_bytes": done,
    }


# ---------------------------------------------------------------------------------------
# This process: shards, markers, the index
# ---------------------------------------------------------------------------------------


def shard_name_of(key: str) -> str:
    """A shard's name from its input's (or part's) key: stable when inputs are added or
    removed."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ShardWriter:
    """One input's shard, written to `.part` files and renamed when whole; then its
    done marker, which is what makes a retry skip the input."""

    def __init__(self, out: Path, source: InputFile, settings: dict[str, Any]) -> None:
        self.out, self.source, self.settings = out, source, settings
        self.name = shard_name_of(source.key)
        shards = out / SHARDS_DIR
        self._bin = shards / f"{self.name}.bin"
        self._docs = shards / f"{self.name}.docs"
        self._ids: IO[bytes] = open(self._bin.with_suffix(".bin.part"), "wb")  # noqa: SIM115
        self._ends: IO[bytes] = open(self._docs.with_suffix(".docs.part"), "wb")  # noqa: SIM115
        self.tokens = self.documents = self.rows = self.bytes = 0

    def add(self, piece: dict[str, Any]) -> None:
        lengths = np.frombuffer(piece["lengths"], dtype=DOC_ENDS)
        self._ids.write(piece["ids"])
        self._ends.write(
            (np.cumsum(lengths, dtype=np.uint64) + self.tokens).astype(DOC_ENDS).tobytes()
        )
        self.tokens += int(piece["tokens"])
        self.documents += len(lengths)
        self.rows += int(piece["rows"])
        self.bytes += int(piece["bytes"])

    def finish(self) -> Shard:
        for f, final in ((self._ids, self._bin), (self._ends, self._docs)):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(f.name, final)
        shard = Shard(self.name, self.source.path, self.tokens, self.documents, self.rows,
                      self.bytes)  # fmt: skip
        marker = {"input": self.source.marker(), **self.settings, "shard": asdict(shard)}
        _write_atomic(done_marker(self.out, self.name), json.dumps(marker))
        return shard

    def discard(self) -> None:
        for f in (self._ids, self._ends):
            f.close()
            Path(f.name).unlink(missing_ok=True)


def done_marker(out: Path, name: str) -> Path:
    return out / SHARDS_DIR / f"{name}.done.json"


def finished_shard(out: Path, source: InputFile, settings: dict[str, Any]) -> Shard | None:
    """The shard a done marker says is finished for this very input (same size and time)
    and settings (tokenizer, field); None: prepare it."""
    try:
        marker = json.loads(done_marker(out, shard_name_of(source.key)).read_text())
        if marker["input"] != source.marker() or any(
            marker.get(k) != v for k, v in settings.items()
        ):
            return None
        shard = Shard(**marker["shard"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (out / shard.bin_file).is_file() or not (out / shard.docs_file).is_file():
        return None
    return shard


def _last_step(out: Path) -> int:
    try:
        return int(json.loads((out / SHARDS_DIR / STEP_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _save_step(out: Path, step: int) -> None:
    (out / SHARDS_DIR / STEP_FILE).write_text(json.dumps({"step": step}))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_stale_shards(out: Path, kept: set[str]) -> None:
    """Shards of inputs no longer named (an earlier run's), and parts of unfinished ones."""
    for path in (out / SHARDS_DIR).iterdir():
        if path.name != STEP_FILE and path.name.split(".")[0] not in kept:
            path.unlink(missing_ok=True)


def split_counts(out: Path, shards: list[Shard], fraction: float) -> tuple[int, int]:
    """(training tokens, held-out tokens) of the shards, documents split by `eval_mask`."""
    train = held = first = 0
    for shard in shards:
        ends = np.fromfile(out / shard.docs_file, dtype=DOC_ENDS).astype(np.int64)
        lengths = np.diff(np.concatenate(([0], ends)))
        mask = eval_mask(first, len(ends), fraction)
        held += int(lengths[mask].sum())
        train += int(lengths[~mask].sum())
        first += len(ends)
    return train, held


def _empty_inputs(parts: list[InputFile], shards: list[Shard]) -> list[str]:
    """The names of the files cut into parts whose parts all held no document (a whole
    file with none fails in its task)."""
    documents: dict[str, int] = {}
    for part, shard in zip(parts, shards, strict=True):
        if not part.whole:
            documents[part.path] = documents.get(part.path, 0) + shard.documents
    return [Path(path).name for path, n in documents.items() if n == 0]


class Tally:
    """What has been prepared so far, for the progress points: an input counts as done
    when all its parts are."""

    def __init__(self, files: int, parts: list[InputFile], done: set[str], total: int) -> None:
        self.files, self.total = files, total
        self.parts_left: dict[str, int] = {}
        for part in parts:
            if part.key not in done:
                self.parts_left[part.path] = self.parts_left.get(part.path, 0) + 1
        self.rows = self.bytes = self.tokens = 0
        self.finished_bytes = self.part_bytes = 0
        self.start = time.monotonic()

    def add(self, piece: dict[str, Any], part: InputFile) -> None:
        self.rows += int(piece["rows"])
        self.bytes += int(piece["bytes"])
        self.tokens += int(piece["tokens"])
        self.part_bytes = min(int(piece["done_bytes"]), part.length)

    def finished(self, part: InputFile) -> None:
        self.finished_bytes += part.length
        self.part_bytes = 0
        self.parts_left[part.path] -= 1

    def progress(self) -> Progress:
        files_done = self.files - sum(1 for n in self.parts_left.values() if n > 0)
        return Progress(
            self.files, files_done, self.rows, self.finished_bytes + self.part_bytes,
            self.tokens, self.total, time.monotonic() - self.start,
        )  # fmt: skip


@dataclass
class Preparation:
    params: PrepareParams

    def run(
        self,
        storage_root: Path,
        report: Callable[[StepMetrics], None],
        take_control: Callable[[], Control] = lambda: Control.NONE,
        abort: threading.Event | None = None,
        *,
        use_ray: bool = True,
    ) -> Index | None:
        """Prepare every unfinished input and write the index; None when stopped first
        (a cancel, a drain): the finished inputs stay done for the next attempt."""
        p = self.params
        root = storage_root.resolve()
        try:
            if area_of(p.out)[0] != "data":
                raise InputError(f"{p.out!r} is not in a tenant's own area")
            out = resolve_under(p.out, root)
        except (InputError, DataPathError) as exc:
            raise WorkloadError(f"workload.params.out: {exc}") from exc
        try:
            tok_path = tokenizer_file(resolve_under(p.tokenizer, root))
        except DataPathError as exc:
            raise WorkloadError(f"workload.params.tokenizer: {exc}") from exc
        try:
            files = expand_inputs(p.inputs, root)
        except InputError as exc:
            raise WorkloadError(f"workload.params.inputs: {exc}") from exc
        try:
            tok = load_tokenizer(str(tok_path))
        except Exception as exc:  # tokenizers raises its own Exception for a bad file
            raise WorkloadError(f"workload.params.tokenizer: cannot load it ({exc})") from exc
        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos = eos_id(tok)
        settings: dict[str, Any] = {
            "tokenizer": hashlib.sha256(tok_path.read_bytes()).hexdigest(),
            "text_field": p.text_field,
            "token_dtype": token_dtype_for(vocab),
            "eos_id": eos,
        }
        (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        parts = [part for f in files for part in parts_of(f, splittable(f, root), PART_BYTES)]
        done = {f.key: s for f in parts if (s := finished_shard(out, f, settings)) is not None}
        pending = [f for f in parts if f.key not in done]
        # An earlier run's index must not name shards this run rewrites.
        (out / INDEX_FILE).unlink(missing_ok=True)
        tally = Tally(len(files), parts, set(done), sum(f.length for f in pending) or 1)
        # Points go on from the last attempt's: a job's steps only grow.
        step, last = _last_step(out), 0.0
        writer: ShardWriter | None = None
        by_key = {f.key: f for f in pending}
        try:
            for piece in self._pieces(pending, root, str(tok_path), settings, use_ray):
                if abort is not None and abort.is_set():
                    from elastrain.workers.api import AttemptAborted

                    raise AttemptAborted()
                if writer is None or writer.source.key != piece["key"]:
                    if writer is not None:
                        done[writer.source.key] = writer.finish()
                        tally.finished(writer.source)
                    if piece["key"] in done:  # order is preserved: never seen again
                        raise RuntimeError(f"{piece['key']}: its pieces came out of order")
                    writer = ShardWriter(out, by_key[piece["key"]], settings)
                writer.add(piece)
                tally.add(piece, writer.source)
                if time.monotonic() - last >= REPORT_EVERY_S:
                    step, last = step + 1, time.monotonic()
                    report(tally.progress().point(step))
                    _save_step(out, step)
                    if take_control() in (Control.STOP, Control.LEAVE):
                        writer.discard()
                        return None
            if writer is not None:
                done[writer.source.key] = writer.finish()
                tally.finished(writer.source)
                writer = None
        except InputError as exc:
            raise WorkloadError(f"workload.params.inputs: {exc}") from exc
        finally:
            if writer is not None:
                writer.discard()
        report(tally.progress().point(step + 1))
        _save_step(out, step + 1)
        shards = [done[f.key] for f in parts]
        if sum(s.tokens for s in shards) == 0:
            raise WorkloadError("workload.params.inputs: no text in any input (empty input)")
        if empty := _empty_inputs(parts, shards):
            raise WorkloadError(f"workload.params.inputs: {empty[0]} holds no text (empty input)")
        train, held = split_counts(out, shards, p.eval_fraction)
        index = Index(
            vocab_size=vocab, token_dtype=str(settings["token_dtype"]), tokenizer=p.tokenizer,
            eos_id=eos, text_field=p.text_field, eval_fraction=p.eval_fraction,
            shards=shards, train_tokens=train, eval_tokens=held,
        )  # fmt: skip
        _write_atomic(out / INDEX_FILE, index.to_json())
        remove_stale_shards(out, {s.name for s in shards})
        return index

    def _pieces(
        self,
        pending: list[InputFile],
        root: Path,
        tokenizer: str,
        settings: dict[str, Any],
        use_ray: bool,
    ) -> Iterator[dict[str, Any]]:
        """Every pending input's tokenized pieces, input by input in order: from Ray Data
        tasks spread over the cluster, or (use_ray False: the bench's baseline) here."""
        args = (root, tokenizer, self.params.text_field, self.params.batch_rows,
                str(settings["token_dtype"]))  # fmt: skip
        if not pending:
            return
        if not use_ray:
            for source in pending:
                yield from tokenize_file(source, *args)
            return
        yield from ray_pieces(pending, args)


def ray_pieces(pending: list[InputFile], args: tuple[Any, ...]) -> Iterator[dict[str, Any]]:
    """The pieces from a Ray Data pipeline: a task per input (TASK_CPUS each), its pieces
    as they come, in input order."""
    import ray.data
    from ray.data.context import DataContext

    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.op_resource_reservation_enabled = False
    items = [{"source": json.dumps(asdict(f))} for f in pending]
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _tokenize_batch,
        batch_size=1,
        batch_format="pyarrow",
        fn_args=args,
        num_cpus=TASK_CPUS,
        # One core per task: the tokenizer's own threads would contend with the others'.
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}},
    )
    try:
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            yield from cast("Any", table).to_pylist()
    except Exception as exc:
        if (found := _input_error(exc)) is not None:
            raise found from exc
        raise


def _tokenize_batch(batch: Any, *args: Any) -> Iterator[Any]:
    import pyarrow as pa

    _at_normal_priority()
    for source in batch.column("source").to_pylist():
        f = InputFile(**json.loads(source))
        for piece in tokenize_file(f, *args):
            yield pa.Table.from_pylist([piece])


def _at_normal_priority() -> None:
    """Tokenize at niceness 0, as a training rank runs (`workers.process.run_at_normal_priority`,
    not imported here: it would load torch into every task): Ray starts its workers at 15,
    where any normal-priority process beside them takes their core (measured: a task per
    file ran 4x slower than the same loop in a plain process on a busy machine). The
    calling thread's only (Linux keeps niceness per thread); needs CAP_SYS_NICE or a nice
    rlimit, else the task runs at Ray's niceness."""
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, thread) > 0:
            os.setpriority(os.PRIO_PROCESS, thread, 0)


def _input_error(exc: BaseException) -> InputError | None:
    """The InputError a Ray task raised, found in what Ray raised here: Ray's error holds
    the task's own exception as `cause` (and is an InputError itself, with a traceback for
    its message)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        if isinstance(current, InputError) and not isinstance(cause, BaseException):
            # Its first line: Ray Data appends its retry advice to a failed task's error.
            return InputError((str(current).strip().splitlines() or [""])[0])
        for nxt in (cause, current.__cause__, current.__context__):
            if isinstance(nxt, BaseException):
                pending.append(nxt)
    text = str(exc)
    if "InputError: " in text:
        return InputError(text.rsplit("InputError: ", 1)[1].strip().splitlines()[0])
    return None
