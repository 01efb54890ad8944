"""The verified load's fast path (`checkpoints/dcp/reader.py`):

- records whose zip entries other than the data are byte for byte those of a record
  decoded before are viewed from a remembered layout (no pickle), and decode to exactly
  what torch.load gives, whatever the dtype, strides or storage offset;
- a corrupt shard is still refused on that path, before any byte reaches the state;
- on two FSDP ranks each shard is hashed once, by the rank that reads it; the small
  records a rank reads from another rank's file (DCP stores replicated optimizer values
  once) come from the rank that verified that file, and a corrupt one makes every rank
  fall back; a record a rank read itself that is not the bytes the file's hashing rank
  verified is refused on every rank, the state untouched.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.fsdp import fully_shard

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp import reader as reader_module
from elastrain.checkpoints.dcp.records import ZipLayouts
from elastrain.checkpoints.dcp.writer import without_zip_crc32
from tests.unit.dist_utils import run_distributed
from tests.unit.test_checkpoints_dcp import (
    FIELDS,
    assert_same,
    build,
    ckpt_state,
    full_state,
    train,
)
from tests.unit.test_checkpoints_digest import flip_one_byte, save_two

torch.set_num_threads(1)


def _record(tensor: torch.Tensor) -> bytes:
    """A record as DigestingWriter writes it: torch.save without the zip crc32 (with it,
    every record's directory differs, and only the decode below tells them apart)."""
    buf = io.BytesIO()
    with without_zip_crc32():
        torch.save(tensor, buf)
    return buf.getvalue()


def test_remembered_layouts_decode_exactly_what_torch_load_does() -> None:
    g = torch.Generator().manual_seed(0)
    kinds = [
        lambda: torch.randn(3, 4, generator=g),
        lambda: torch.randn(4, 3, generator=g).t(),  # non-contiguous strides
        lambda: torch.randn(6, generator=g)[2:5],  # a storage offset (whole storage saved)
        lambda: torch.randn(5, 2, generator=g).to(torch.bfloat16),
        lambda: torch.randint(0, 1000, (7,), generator=g),
        lambda: torch.tensor(3.0),  # a scalar, as Adam's step
    ]
    tensors = [make() for make in kinds for _ in range(3)]  # three of each layout
    records = [_record(t) for t in tensors]
    # One buffer, records at odd offsets (as in a DCP shard): the data is not aligned.
    buffer = bytearray()
    offsets = []
    for record in records:
        buffer += b"x" * 3
        offsets.append(len(buffer))
        buffer += record
    reader = reader_module.VerifyingReader("/nonexistent", expected=None, process_group=None)
    whole = reader_module._as_tensor(memoryview(buffer))
    for tensor, record, offset in zip(tensors, records, offsets, strict=True):
        view = memoryview(buffer)[offset : offset + len(record)]
        got = reader._decode(view, whole, offset)
        want = torch.load(io.BytesIO(record), weights_only=True)
        assert got.dtype == want.dtype and got.size() == want.size()
        assert got.stride() == want.stride() and torch.equal(got, want)
        assert torch.equal(got, tensor)
    # The first of each layout went through torch's decoder, the two others did not.
    assert reader.layout_hits == 2 * len(kinds)

    # Same layout, other values: same key; another shape: another key.
    layouts = ZipLayouts()
    a = layouts.key(memoryview(_record(torch.randn(3, 4))))
    b = layouts.key(memoryview(_record(torch.randn(3, 4))))
    c = layouts.key(memoryview(_record(torch.randn(4, 3))))
    assert a is not None and b is not None and c is not None
    assert a[0] == b[0] != c[0]
    assert layouts.key(memoryview(b"not a zip at all, just bytes")) is None


def test_a_corrupt_shard_is_refused_on_the_fast_path(tmp_path: Path) -> None:
    refs = save_two(tmp_path, "xxh3")
    made: list[reader_module.VerifyingReader] = []
    original = reader_module.VerifyingReader.__init__

    def spy(self: reader_module.VerifyingReader, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    reader_module.VerifyingReader.__init__ = spy  # type: ignore[method-assign]
    try:
        model, optim = build("plain")
        train(model, optim, 1, seed=7)
        ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
        state = ckpt_state(model, optim)
        assert ckpt.load_latest(state) is not None
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        assert_same(full_state(model, optim), refs[2])
        assert made[-1].layout_hits > 0  # the Adam moments share their parameters' layouts

        # A byte of the last record's data (on the fast path: the layout of a parameter
        # seen before), in the newest checkpoint, and in the only other one.
        for step in (2, 1):
            shard = tmp_path / f"step_00000000{step}-a0" / "__0_0.distcp"
            flip_one_byte(shard, at=shard.stat().st_size - 400)
        model, optim = build("plain")
        train(model, optim, 1, seed=7)
        before = full_state(model, optim)
        state = ckpt_state(model, optim)
        assert ckpt.load_latest(state) is None
        assert_same(full_state(model, optim), before)  # nothing copied before the verdict
    finally:
        reader_module.VerifyingReader.__init__ = original  # type: ignore[method-assign]


# -- two FSDP ranks, model and optimizer -------------------------------------------------

WIDTH = 128


def build_wide() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP layers large enough that the replicated optimizer values (Adam's step, the
    param groups) are a small part of each shard file, as in real models: a rank then
    reads them from the other rank's file without hashing it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_wide(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    x = torch.randn(4, WIDTH, generator=g)
    optim.zero_grad()
    F.mse_loss(model(x), x).backward()
    optim.step()


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    made: list[reader_module.VerifyingReader] = []
    original = reader_module.VerifyingReader.__init__

    def spy(self: reader_module.VerifyingReader, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    reader_module.VerifyingReader.__init__ = spy  # type: ignore[method-assign]
    model, optim = build_wide()
    ckpt = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
    refs = {}
    for step in (1, 2):
        train_wide(model, optim, seed=step)
        ckpt.save(step=step, attempt=0, state=ckpt_state(model, optim), manifest_fields=FIELDS)
        refs[step] = full_state(model, optim)
    ckpt.close()
    out: dict[str, Any] = {}

    def load() -> tuple[int | None, dict[str, str], bool]:
        """(step loaded or None, skipped, whether the state is what it was when None)."""
        model, optim = build_wide()
        train_wide(model, optim, seed=99)
        before = full_state(model, optim)
        loader = ShardedCheckpointer(Path(root), rank=rank, world_size=world_size, async_save=False)
        state = ckpt_state(model, optim)
        outcome = loader.load_latest(state)
        if outcome is None:
            try:
                assert_same(full_state(model, optim), before)
                return None, {}, True
            except AssertionError:
                return None, {}, False
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        assert_same(full_state(model, optim), refs[outcome.info.step])
        return outcome.info.step, dict(outcome.skipped), True

    # 1. Intact: each rank hashed its own shard only; records of the other rank's file
    #    came from that rank.
    out["step"], _, _ = load()
    reader = made[-1]
    out["hashed"] = reader.hashed_bytes
    out["own_size"] = Path(root, "step_000000002-a0", f"__{rank}_0.distcp").stat().st_size
    out["received"] = sorted(reader.received_records)

    # 2. A byte of one of those records, on disk: every rank falls back to step 1.
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, out["received"])
    received = sorted({key for keys in gathered for key in keys})
    if rank == 0 and received:
        name, offset, length = received[0]
        flip_one_byte(Path(root, "step_000000002-a0", name), at=offset + length // 2)
    dist.barrier()
    out["fallback_step"], out["fallback_skipped"], _ = load()

    # 3. Records read by the rank itself (none sent), and one rank reading bytes that are
    #    not those its peer verified: refused on both ranks, the state untouched.
    reader_module.SHIP_BYTES = 0
    misreader = min(r for r, keys in enumerate(gathered) if keys)
    out["misreader"] = misreader
    if rank == misreader:
        read_foreign = reader_module.VerifyingReader._read_foreign

        def misread(self: reader_module.VerifyingReader, per_file: Any, records: Any) -> Any:
            problem = read_foreign(self, per_file, records)
            for key, data in records.items():
                records[key] = memoryview(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
            return problem

        reader_module.VerifyingReader._read_foreign = misread  # type: ignore[method-assign,assignment]
    out["misread_step"], _, out["untouched"] = load()
    out["misread_self_read"] = sorted(made[-1].self_read_records)
    reader_module.VerifyingReader.__init__ = original  # type: ignore[method-assign]
    return out


def test_two_ranks_hash_each_shard_once_and_share_small_records(tmp_path: Path) -> None:
    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout_s=300)
    received = [key for out in results for key in out["received"]]
    assert received, "the setup this test needs: a rank reads records of the other's file"
    for rank, out in enumerate(results):
        assert out["step"] == 2
        # Its own shard, not a byte more (before: the whole of the other rank's file too).
        assert out["hashed"] == out["own_size"], rank
        assert all(name != f"__{rank}_0.distcp" for name, _, _ in out["received"])
        assert out["fallback_step"] == 1
        reason = out["fallback_skipped"][str(tmp_path / "step_000000002-a0")]
        assert "digest mismatch" in reason and "xxh3-128" in reason
        # Step 2 corrupt, step 1 misread by rank 0: nothing left; both ranks refused it.
        assert out["misread_step"] is None and out["untouched"] is True
    misreader = results[0]["misreader"]
    assert results[misreader]["misread_self_read"]  # it read them itself in part 3
