"""Reading a checkpoint a job wrote, in a process that must not run the job's code.

A job's code can write every byte of its checkpoint folder, and DCP's `FileSystemReader`
unpickles `.metadata` whole: a planted pickle would run what it names as the export (a
child of the API). Here the metadata goes through an unpickler resolving only the globals
DCP's `Metadata` is made of, refusing any other before anything is called. Shard tensors
are decoded weights-only (DCP's reader); pickled (byte) items are refused.

Also: the folder is entered through no link below a trusted root (`confined.open_dir`),
every file the metadata names is a plain name in it, the metadata is bounded in size, and
the tensors it asks to allocate cannot outgrow the bytes really on disk
(`check_allocation`: a planted `torch.Size` of 10^12 would allocate terabytes).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from elastrain.checkpoints.confined import plain_name
from elastrain.checkpoints.dcp.reader import VerifyingReader
from elastrain.checkpoints.layout import DCP_METADATA_NAME
from elastrain.contracts.files import ConfinedFileError, read_bounded

#: DCP's metadata holds a record per tensor chunk: ~1 KiB each for a big sharded state.
MAX_METADATA_BYTES = 64 * 1024 * 1024
#: The only globals a `.metadata` pickle may name (recorded from real ones of every item
#: kind), besides `torch.<dtype>`.
_ALLOWED_GLOBALS = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
    }
)


class UntrustedCheckpoint(ValueError):
    """A checkpoint folder a reader refuses to trust, and why (no server path)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedCheckpoint(
            f"{DCP_METADATA_NAME} names {module}.{name}, which a checkpoint's metadata never "
            "holds: refused, nothing of it was run"
        )


def load_metadata(data: bytes) -> Metadata:
    """DCP's `Metadata` from the bytes of a `.metadata` file a job may have written."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UntrustedCheckpoint:
        raise
    except Exception as exc:  # truncated or garbled: what it was matters, not where
        raise UntrustedCheckpoint(f"{DCP_METADATA_NAME} is not DCP metadata: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpoint(f"{DCP_METADATA_NAME} holds a {type(metadata).__name__}")
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not plain_name(name):
            raise UntrustedCheckpoint(
                f"{DCP_METADATA_NAME} places {getattr(index, 'fqn', '?')} in {name!r}, "
                "not a file of the checkpoint's own folder"
            )
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            raise UntrustedCheckpoint(f"{DCP_METADATA_NAME}: a record at {offset!r}+{length!r}")
    return metadata


def fd_path(fd: int) -> Path:
    """A path naming the folder `fd` is open on, whatever is renamed or linked since."""
    return Path(f"/proc/self/fd/{fd}")


def check_allocation(metadata: Metadata, wanted: list[str], folder: Path) -> None:
    """Refuse the tensors `wanted` (metadata keys) when they need more bytes than the
    folder's files hold on disk (blocks, not sizes: a sparse file holds none)."""
    need = 0
    for key in wanted:
        meta = metadata.state_dict_metadata[key]
        if isinstance(meta, TensorStorageMetadata):
            need += math.prod(meta.size) * meta.properties.dtype.itemsize
    have = 0
    for name in {info.relative_path for info in (metadata.storage_data or {}).values()}:
        try:
            found = os.lstat(folder / name)
        except OSError:
            continue
        if stat.S_ISREG(found.st_mode):
            have += found.st_blocks * 512
    if need > have:
        raise UntrustedCheckpoint(
            f"the metadata asks for {need} bytes of weights, the checkpoint's files hold {have}"
        )


class UntrustedReader(VerifyingReader):
    """`VerifyingReader` for a job's folder: metadata through `load_metadata`, no pickled
    (byte) item loaded."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            data = read_bounded(os.path.join(self.path, DCP_METADATA_NAME), MAX_METADATA_BYTES)
        except (ConfinedFileError, FileNotFoundError) as exc:
            raise UntrustedCheckpoint(str(exc) or f"no {DCP_METADATA_NAME}") from None
        metadata = load_metadata(data)
        self.storage_data = metadata.storage_data
        return metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        for item in plan.items:  # DCP's planner loads them with torch.load(weights_only=False)
            if item.type == LoadItemType.BYTE_IO:
                raise UntrustedCheckpoint(f"{item.storage_index.fqn} is a pickled item: not read")
        return super().prepare_local_plan(plan)
