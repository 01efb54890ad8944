"""Reading a checkpoint a job wrote, in a process that must not run the job's code.

A job's code can write every byte of its checkpoint folder. DCP's `.metadata` is a pickle,
and DCP's `FileSystemReader` unpickles it whole (`pickle.load`): a planted one runs
whatever it names, as whoever reads it. The export (`elastrain.checkpoints.dcp.export`)
runs in a child of the API, so that reader made a tenant the operator. Here the metadata
is read with an unpickler that resolves only the globals DCP's `Metadata` is made of (its
dataclasses, `torch.Size`, dtypes, a path): a pickle naming anything else is refused
before anything is called. The shard files' tensors are decoded by torch's weights-only
decoder (DCP's reader, through `elastrain.checkpoints.dcp.reader`), and the plan the export
makes holds no pickled (byte) item; `UntrustedReader` refuses one all the same.

Everything else a reader of a job's folder needs, on top of that: the folder is opened
without following a link at any step below a trusted root (`confined.open_dir`), every
file name the metadata gives is a plain name in that folder, the metadata file is bounded
in size, and the tensors the metadata asks to allocate cannot outgrow the bytes that are
really on disk (`check_allocation`: a planted `torch.Size` of 10^12 would otherwise have
the reader allocate terabytes).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from elastrain.checkpoints.confined import ConfinedFileError, plain_name, read_bounded
from elastrain.checkpoints.dcp.reader import VerifyingReader

#: DCP's metadata holds a record per tensor chunk: ~1 KiB each for a big sharded state.
MAX_METADATA_BYTES = 64 * 1024 * 1024
_METADATA_NAME = ".metadata"

#: The only globals a DCP `.metadata` pickle may name (found by recording what a real one
#: of every item kind resolves), besides `torch.<dtype>`.
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
    """A checkpoint folder that a reader refuses to trust, and why (no server path)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedCheckpoint(
            f"{_METADATA_NAME} names {module}.{name}, which a checkpoint's metadata never "
            "holds: refused, nothing of it was run"
        )


def load_metadata(data: bytes) -> Metadata:
    """DCP's `Metadata` from the bytes of a `.metadata` file a job may have written."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UntrustedCheckpoint:
        raise
    except Exception as exc:  # truncated or garbled: what it was matters, not where
        raise UntrustedCheckpoint(f"{_METADATA_NAME} is not DCP metadata: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpoint(f"{_METADATA_NAME} holds a {type(metadata).__name__}")
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not plain_name(name):
            raise UntrustedCheckpoint(
                f"{_METADATA_NAME} places {getattr(index, 'fqn', '?')} in {name!r}, "
                "not a file of the checkpoint's own folder"
            )
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            raise UntrustedCheckpoint(f"{_METADATA_NAME}: a record at {offset!r}+{length!r}")
    return metadata


def fd_path(fd: int) -> Path:
    """A path that names the folder `fd` is open on, whatever is renamed or linked since
    (Linux's /proc): readers that take a path read exactly that folder."""
    return Path(f"/proc/self/fd/{fd}")


def check_allocation(metadata: Metadata, wanted: list[str], folder: Path) -> None:
    """Refuse to allocate the tensors `wanted` (metadata keys) when they would need more
    bytes than the folder's files really hold on disk (blocks, not sizes: a sparse file
    holds none): the metadata's sizes are the job's to choose."""
    need = 0
    for key in wanted:
        meta = metadata.state_dict_metadata[key]
        if isinstance(meta, TensorStorageMetadata):
            count = 1
            for dim in meta.size:
                count *= int(dim)
            need += count * meta.properties.dtype.itemsize
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
    """`VerifyingReader` for a folder a job wrote, read by a process of the control plane:
    the metadata through `load_metadata`, no pickled (byte) item loaded."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            data = read_bounded(_METADATA_NAME, MAX_METADATA_BYTES, dir_fd=fd)
        except (ConfinedFileError, FileNotFoundError) as exc:
            raise UntrustedCheckpoint(str(exc) or f"no {_METADATA_NAME}") from None
        finally:
            os.close(fd)
        metadata = load_metadata(data)
        self.storage_data = metadata.storage_data
        return metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        for item in plan.items:  # DCP's planner loads them with torch.load(weights_only=False)
            if item.type == LoadItemType.BYTE_IO:
                raise UntrustedCheckpoint(f"{item.storage_index.fqn} is a pickled item: not read")
        return super().prepare_local_plan(plan)
