"""Shard records written from per-layout templates (`checkpoints/dcp/tensor_records.py`):

- a template's bytes are torch.save's own, for the tensor it was taken from and for any
  other tensor of the same layout (the data is the only part that differs);
- tensors whose torch.save output could depend on more than the layout get no template;
- a DCP save writes the same shard files, byte for byte, with templates or with one
  torch.save per tensor, on one rank and on two FSDP ranks; torch's own FileSystemReader
  loads them.
"""

from __future__ import annotations

import filecmp
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp.tensor_records import (
    clear_templates,
    record_parts,
    serialization_settings,
)
from elastrain.checkpoints.dcp.writer import without_zip_crc32
from tests.unit.dist_utils import run_distributed
from tests.unit.test_checkpoints_dcp import assert_same, build, train

torch.set_num_threads(1)


def torch_saved(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def templated(tensor: torch.Tensor) -> bytes | None:
    parts = record_parts(tensor, serialization_settings())
    return None if parts is None else b"".join(bytes(p) for p in parts)


LAYOUTS = {
    "float32 matrix": lambda: torch.randn(3, 5),
    "transposed (non-contiguous, dense)": lambda: torch.randn(4, 6).t(),
    "bfloat16": lambda: torch.randn(7, dtype=torch.bfloat16),
    "int64": lambda: torch.randint(0, 1000, (11,)),
    "bool": lambda: torch.rand(9) > 0.5,
    "scalar (Adam's step)": lambda: torch.tensor(float(torch.randint(1, 99, ()))),
    "empty": lambda: torch.zeros(0),
    "1 MiB": lambda: torch.randn(256, 1024),
}


@pytest.mark.parametrize("make", LAYOUTS.values(), ids=list(LAYOUTS))
def test_template_bytes_are_torch_saves_for_any_data_of_the_layout(make: Any) -> None:
    clear_templates()
    with without_zip_crc32():
        first, second = make(), make()
        assert templated(first) == torch_saved(first)
        # From the template the first tensor left: the second's own bytes.
        assert templated(second) == torch_saved(second)
        if second.numel() > 1:
            assert torch_saved(first) != torch_saved(second)  # the data does differ


def test_no_template_where_torch_save_writes_more_than_the_layout() -> None:
    clear_templates()
    with without_zip_crc32():
        settings = serialization_settings()
        assert record_parts(nn.Parameter(torch.randn(3)), settings) is None  # a subclass
        assert record_parts(torch.randn(3, requires_grad=True), settings) is None
        assert record_parts(torch.randn(3, dtype=torch.complex64).conj(), settings) is None
        tagged = torch.randn(3)
        tagged.note = "pickled with the tensor"  # type: ignore[attr-defined]
        assert record_parts(tagged, settings) is None
        assert record_parts(torch.randn(3), settings) is not None
    # With the zip crc32 on, the headers carry a digest of the data: never templated.
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        assert serialization_settings() is None
        assert record_parts(torch.randn(3), serialization_settings()) is None
    finally:
        torch.serialization.set_crc32_options(crc32)


def odd_state() -> dict[str, Any]:
    """A model + AdamW state and the odd items a state can hold."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    m, o = get_state_dict(model, optim)
    base = torch.randn(10, 10)
    return {
        "model": m,
        "optim": o,
        "extra": {
            "bf16_t": torch.randn(5, 3, dtype=torch.bfloat16).t(),
            "slice": base[2:4],  # storage larger than the tensor: DCP clones it
            "ints": torch.arange(6),
            "param": nn.Parameter(torch.randn(2)),  # saved through torch.save
            "count": 3,
            "name": "x",
        },
    }


def saved_folder(root: Path, *, templates: bool, state: dict[str, Any]) -> Path:
    ckpt = ShardedCheckpointer(
        root, rank=0, world_size=1, async_save=False, template_records=templates
    )
    ckpt.save(step=1, attempt=0, state=state, manifest_fields={})
    ckpt.close()
    return root / "step_000000001-a0"


def same_metadata(a: Path, b: Path) -> bool:
    """`.metadata` files equal but for `storage_meta` (the folder and a random save id,
    different for every save by design)."""
    ma, mb = (pickle.loads((p / ".metadata").read_bytes()) for p in (a, b))
    ma.storage_meta = mb.storage_meta = None
    return pickle.dumps(ma) == pickle.dumps(mb)


def test_one_rank_shards_identical_and_loadable_by_torch(tmp_path: Path) -> None:
    clear_templates()
    state = odd_state()
    new = saved_folder(tmp_path / "templates", templates=True, state=state)
    old = saved_folder(tmp_path / "torch_save", templates=False, state=state)
    shards = sorted(p.name for p in new.glob("*.distcp"))
    assert shards == ["__0_0.distcp"]
    assert filecmp.cmp(new / shards[0], old / shards[0], shallow=False)
    assert same_metadata(new, old)
    # Torch's own reader, no elastrain code on the load path.
    target = odd_state()
    for group in ("model", "extra"):
        for key, value in target[group].items():
            if isinstance(value, torch.Tensor):
                target[group][key] = torch.zeros_like(value)
    dcp.load(target, storage_reader=FileSystemReader(new), no_dist=True)
    assert_same(target["model"], state["model"])
    assert_same(target["extra"], state["extra"])


def _fsdp_save_both(rank: int, world_size: int, root: str) -> None:
    model, optim = build("fsdp")
    train(model, optim, steps=2, seed=0)
    m, o = get_state_dict(model, optim)
    for templates in (True, False):
        ckpt = ShardedCheckpointer(
            Path(root) / str(templates),
            rank=rank,
            world_size=world_size,
            async_save=True,
            template_records=templates,
        )
        ckpt.save(step=1, attempt=0, state={"model": m, "optim": o}, manifest_fields={})
        ckpt.close()


def test_two_fsdp_ranks_async_shards_identical(tmp_path: Path) -> None:
    run_distributed(_fsdp_save_both, 2, str(tmp_path))
    new, old = (tmp_path / str(t) / "step_000000001-a0" for t in (True, False))
    shards = sorted(p.name for p in new.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    for name in shards:
        assert filecmp.cmp(new / name, old / name, shallow=False), name
    assert same_metadata(new, old)
