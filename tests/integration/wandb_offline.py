"""Read back an offline W&B run (`run-<id>.wandb` under WANDB_DIR), for tests.

wandb 0.2x+ writes its records in Go (wandb-core) and ships no Python reader, so this is
the file format itself: LevelDB's log format (32 KiB blocks; each record chunk a 7-byte
header of CRC32, length and type: full, first, middle, last) after a 7-byte file header
(":W&B", magic 0xBEE1, version 0), each record a `wandb_internal_pb2.Record`."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32 * 1024
_HEADER = struct.Struct("<IHB")  # crc32, length, chunk type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    at, pending = 7, b""
    while at + _HEADER.size <= len(data):
        left = _BLOCK - at % _BLOCK
        if left < _HEADER.size:  # a block's tail too short for a header is padding
            at += left
            continue
        _crc, length, kind = _HEADER.unpack_from(data, at)
        if length == 0 and kind == 0:
            break  # zeros: the end of what was written
        chunk = data[at + _HEADER.size : at + _HEADER.size + length]
        at += _HEADER.size + length
        if kind == _FIRST:
            pending = chunk
            continue
        if kind == _MIDDLE:
            pending += chunk
            continue
        payload = pending + chunk if kind == _LAST else chunk
        pending = b""
        record = pb.Record()
        record.ParseFromString(payload)
        yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    run_id: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None


def read_run(path: Path) -> OfflineRun:
    run = OfflineRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.name = record.run.run_id, record.run.display_name
            for item in record.run.config.update:  # the config given to `wandb.init`
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
