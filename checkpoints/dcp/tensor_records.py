"""The bytes `torch.save(tensor)` writes, without running torch.save for every tensor.

DCP's shard writer serialises every tensor of the state with its own `torch.save`: a
pickler class built per call, the pickling, ~40 small writes through Python. That is
~0.3-0.5 ms of Python per tensor, all of it holding the GIL; with the ~600 tensors of a
12-layer model and its Adam state it is most of the Python an async save runs in its
background thread, where it takes the GIL from a training loop that launches kernels from
Python (docs/bench-checkpoint.md, "One rank with a spare core").

With the zip format's crc32 off (as every shard is written, `writer.without_zip_crc32`),
what torch.save writes for a plain tensor is a prefix that depends only on the tensor's
layout (dtype, sizes, strides, storage offset and size), the storage's bytes, and a
suffix that depends only on the layout too. So the prefix and suffix are taken once per
layout from a real torch.save and reused: a tensor's record is then three writes. The
bytes are torch.save's own (tests compare them byte for byte), so the shard stays what
torch's FileSystemReader reads.

Only tensors whose torch.save output cannot depend on anything but that layout get a
template: plain `torch.Tensor` (no subclass, no Python attributes), strided, on the CPU,
not requiring grad, not quantized, no conjugate or negative bit. Anything else, or any
save with the crc32 on, goes through torch.save as before.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import torch

# Records named by torch.save for a lone tensor's only storage.
_DATA_RECORD = "data/0"
# Layouts seen in this process (a model's state has few distinct ones); bounded anyway.
MAX_TEMPLATES = 4096

_lock = threading.Lock()
_templates: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}


def serialization_settings() -> tuple[Any, ...] | None:
    """The torch.save settings a template depends on; None when templates must not be
    used (crc32 on: the zip headers would then carry a digest of the data). Read once
    per shard (each read of torch's config costs as much as a template write)."""
    if torch.serialization.get_crc32_options():
        return None
    from torch.utils.serialization import config

    return (config.save.storage_alignment, torch.serialization.DEFAULT_PROTOCOL)


def layout_key(tensor: torch.Tensor, settings: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """What torch.save's bytes around the data depend on (under `settings`, from
    `serialization_settings()`), or None when `tensor`'s record cannot be templated."""
    if (
        settings is None
        or type(tensor) is not torch.Tensor
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or getattr(tensor, "__dict__", None)
    ):
        return None
    return (
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
        settings,
    )


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor`'s whole storage (what torch.save writes as its data record),
    without a copy."""
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    array: Any = as_bytes.numpy()  # a buffer; numpy's stubs do not say so to mypy
    return memoryview(array).cast("B")


def _template_from(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """(prefix, suffix) of `tensor`'s torch.save around its data record, checked: the
    record must hold exactly the storage's bytes."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    raw = buf.getbuffer()
    reader = torch._C.PyTorchFileReader(io.BytesIO(raw))
    if set(reader.get_all_records()) & {"data/1", "data/2"}:
        return None  # more than one storage: not a lone plain tensor
    start = reader.get_record_offset(_DATA_RECORD)  # type: ignore[attr-defined]  # not in torch's stubs
    data = storage_bytes(tensor)
    end = start + len(data)
    if end > len(raw) or raw[start:end] != data:
        return None
    return bytes(raw[:start]), bytes(raw[end:])


def record_parts(
    tensor: torch.Tensor, settings: tuple[Any, ...] | None
) -> tuple[bytes, memoryview, bytes] | None:
    """(prefix, data, suffix) whose concatenation is what `torch.save(tensor)` writes
    under `settings` (`serialization_settings()`, read while the shard is written), or
    None when `tensor` must go through torch.save itself."""
    key = layout_key(tensor, settings)
    if key is None:
        return None
    with _lock:
        template = _templates.get(key)
    if template is None:
        template = _template_from(tensor)
        if template is None:
            return None
        with _lock:
            if len(_templates) >= MAX_TEMPLATES:
                _templates.clear()
            _templates[key] = template
    prefix, suffix = template
    return prefix, storage_bytes(tensor), suffix


def clear_templates() -> None:
    """Forget every template (tests)."""
    with _lock:
        _templates.clear()
