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

A file is the unit of parallelism and of resumption: many files use many CPUs, and a
large single file is better split into several.
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
    SHARDS_DIR,
    TEXT,
    Index,
    InputError,
    InputFile,
    Shard,
    area_of,
    expand_inputs,
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


def documents(path: Path, kind: str, field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    """Batches of one file's documents' texts, each with the bytes of the file read so far.
    Raises InputError for a non-UTF-8 file, a missing or non-text field."""
    if kind == TEXT:
        yield from _text_documents(path, batch)
    elif kind == JSON_LINES:
        yield from _json_documents(path, field, batch)
    elif kind == PARQUET:
        yield from _parquet_documents(path, field, batch)
    elif kind == ARROW:
        yield from _arrow_documents(path, field, batch)
    else:
        raise InputError(f"{path.name}: unknown kind {kind!r}")


def _text_documents(path: Path, batch: int) -> Iterator[tuple[list[str], int]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path.name} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from exc
    docs = [d.rstrip() for d in _PARAGRAPH.split(text) if d.strip()]
    for lo in range(0, len(docs), batch):
        yield docs[lo : lo + batch], int(len(data) * min(1.0, (lo + batch) / len(docs)))


def _json_documents(path: Path, field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    with path.open("rb") as f:
        head = f.read(64).lstrip()
        f.seek(0)
        if head.startswith(b"["):  # one JSON array of objects, not lines
            rows = _json_loads(f.read(), path, 1)
            if not isinstance(rows, list):
                raise InputError(f"{path.name}: not JSON lines nor an array of objects")
            texts = [_field(r, field, path, n) for n, r in enumerate(rows, 1)]
            for lo in range(0, len(texts), batch):
                yield texts[lo : lo + batch], f.tell()
            return
        texts, done = [], 0
        for lineno, raw in enumerate(f, 1):
            done += len(raw)
            if not raw.strip():
                continue
            texts.append(_field(_json_loads(raw, path, lineno), field, path, lineno))
            if len(texts) >= batch:
                yield texts, done
                texts = []
        if texts:
            yield texts, done


def _json_loads(raw: bytes, path: Path, lineno: int) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path.name} is not UTF-8 ({exc.reason} on line {lineno}, byte {exc.start})"
        ) from exc
    except ValueError as exc:
        raise InputError(f"{path.name}: line {lineno} is not JSON ({exc})") from exc


def _field(row: Any, field: str, path: Path, lineno: int) -> str:
    if not isinstance(row, dict) or field not in row:
        have = ", ".join(list(row)[:20]) if isinstance(row, dict) else type(row).__name__
        raise InputError(
            f"{path.name}: row {lineno} has no field {field!r} (it has: {have}); give --text-field"
        )
    text = row[field]
    if not isinstance(text, str):
        raise InputError(f"{path.name}: row {lineno}: {field!r} is {type(text).__name__}, not text")
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


def _parquet_documents(path: Path, field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    with pq.ParquetFile(path) as f:
        _check_column(f.schema_arrow, field, path)
        rows, seen = max(1, f.metadata.num_rows), 0
        size = path.stat().st_size
        for record in f.iter_batches(batch_size=batch, columns=[field]):
            seen += record.num_rows
            yield _texts(record.column(0)), int(size * seen / rows)


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
    """One input's documents tokenized, in pieces: the ids (each document closed by the
    end-of-text token, when the tokenizer has one) and where each document ends."""
    tok = load_tokenizer(tokenizer)
    eos = eos_id(tok)
    np_dtype = np.dtype("<u2") if dtype == "uint16" else np.dtype("<u4")
    empty = True
    for texts, done in documents(root / source.path, source.kind, field, batch):
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
        yield {
            "path": source.path,
            "ids": np.asarray(flat, dtype=np_dtype).tobytes(),
            "lengths": np.asarray(lengths, dtype=DOC_ENDS).tobytes(),
            "rows": len(texts),
            "bytes": sum(len(t.encode("utf-8")) for t in texts),
            "tokens": len(flat),
            "done_bytes": done,
        }
    if empty:
        raise InputError(f"{Path(source.path).name} holds no text (empty input)")


# ---------------------------------------------------------------------------------------
# This process: shards, markers, the index
# ---------------------------------------------------------------------------------------


def shard_name_of(source: str) -> str:
    """A shard's name from its input's path: stable when inputs are added or removed."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


class ShardWriter:
    """One input's shard, written to `.part` files and renamed when whole; then its
    done marker, which is what makes a retry skip the input."""

    def __init__(self, out: Path, source: InputFile, settings: dict[str, Any]) -> None:
        self.out, self.source, self.settings = out, source, settings
        self.name = shard_name_of(source.path)
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
        marker = json.loads(done_marker(out, shard_name_of(source.path)).read_text())
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
        done = {f.path: s for f in files if (s := finished_shard(out, f, settings)) is not None}
        pending = [f for f in files if f.path not in done]
        # An earlier run's index must not name shards this run rewrites.
        (out / INDEX_FILE).unlink(missing_ok=True)
        total = sum(f.size for f in pending) or 1
        # Points go on from the last attempt's: a job's steps only grow.
        start, step, last = time.monotonic(), _last_step(out), 0.0
        counts = {"rows": 0, "bytes": 0, "tokens": 0, "done_bytes": 0}
        finished_bytes, files_done = 0, len(done)

        def progress() -> Progress:
            return Progress(len(files), files_done, counts["rows"], finished_bytes +
                            counts["done_bytes"], counts["tokens"], total,
                            time.monotonic() - start)  # fmt: skip

        writer: ShardWriter | None = None
        by_path = {f.path: f for f in pending}
        try:
            for piece in self._pieces(pending, root, str(tok_path), settings, use_ray):
                if abort is not None and abort.is_set():
                    from elastrain.workers.api import AttemptAborted

                    raise AttemptAborted()
                if writer is None or writer.source.path != piece["path"]:
                    if writer is not None:
                        done[writer.source.path] = writer.finish()
                        finished_bytes += writer.source.size
                        files_done += 1
                        counts["done_bytes"] = 0
                    if piece["path"] in done:  # order is preserved: never seen again
                        raise RuntimeError(f"{piece['path']}: its pieces came out of order")
                    writer = ShardWriter(out, by_path[piece["path"]], settings)
                writer.add(piece)
                for key in ("rows", "bytes", "tokens"):
                    counts[key] += int(piece[key])
                counts["done_bytes"] = min(int(piece["done_bytes"]), writer.source.size)
                if time.monotonic() - last >= REPORT_EVERY_S:
                    step, last = step + 1, time.monotonic()
                    report(progress().point(step))
                    _save_step(out, step)
                    if take_control() in (Control.STOP, Control.LEAVE):
                        writer.discard()
                        return None
            if writer is not None:
                done[writer.source.path] = writer.finish()
                finished_bytes += writer.source.size
                files_done += 1
                counts["done_bytes"] = 0
                writer = None
        except InputError as exc:
            raise WorkloadError(f"workload.params.inputs: {exc}") from exc
        finally:
            if writer is not None:
                writer.discard()
        report(progress().point(step + 1))
        _save_step(out, step + 1)
        shards = [done[f.path] for f in files]
        if sum(s.tokens for s in shards) == 0:
            raise WorkloadError("workload.params.inputs: no text in any input (empty input)")
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
