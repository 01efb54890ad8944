"""An async save of a state in host memory written from the live tensors, with no staging
copy (`ShardedCheckpointer.save(in_place=True)`), the next update waiting for the write:

- `wait_staged()` returns once the save no longer reads the live tensors: the write is
  over, or the tensor being written is and the ones not yet written are copied then
  (`live_tensors`), so the tensors the update then changes are saved as they were at
  the save; the non-tensor values (a param group's learning rate) are copied at save();
- a writer that cannot hand tensors back (DCP's own loop) holds the update for the
  whole write;
- a failed write raises at `wait_staged()` in the caller when it fails before, later
  at the next poll, as a failed staging copy and a failed write do;
- the strategy's state for such a save holds copies of the module buffers (a forward may
  change them in place: batch norm, DDP's broadcast) and the live weights;
- `writes_in_place` decides it: host memory, async, no write known to take over half a
  step.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict_saver

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp.checkpointer import CheckpointSaveError
from elastrain.checkpoints.dcp.live_tensors import LiveTensors
from elastrain.checkpoints.dcp.shard_file import DigestingStream
from elastrain.workers.checkpointing import writes_in_place
from elastrain.workers.strategies.base import Strategy

TENSORS = ("a", "b", "c", "d")  # written in this order (DCP's plan: sorted by key)
NUMEL = 300_000


def live_state() -> dict[str, Any]:
    return {
        **{name: torch.full((NUMEL,), float(i + 1)) for i, name in enumerate(TENSORS)},
        "optim": {"param_groups": [{"lr": 0.5, "params": list(TENSORS)}]},
    }


def update(state: dict[str, Any]) -> None:
    for name in TENSORS:
        state[name].add_(10.0)


def load(root: Path) -> dict[str, Any]:
    target = live_state()
    update(target)
    target["optim"]["param_groups"][0]["lr"] = 0.0
    reader = ShardedCheckpointer(root, rank=0, world_size=1, async_save=False)
    assert reader.load_latest(target) is not None
    return target


def assert_saved_as_at_the_save(root: Path) -> None:
    saved = load(root)
    for name, expected in live_state().items():
        if name in TENSORS:
            assert torch.equal(saved[name], expected), name
    assert saved["optim"]["param_groups"][0]["lr"] == 0.5


def in_place_checkpointer(root: Path) -> ShardedCheckpointer:
    return ShardedCheckpointer(root, rank=0, world_size=1, async_save=True, async_staging=True)


class Hold:
    """`original` held at its `call`-th call: `reached` is set there, and the call goes
    on once `release()` is called."""

    def __init__(self, original: Any, call: int) -> None:
        self.original, self.call, self.calls = original, call, 0
        self.reached, self._gate = threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.call:
            self.reached.set()
            assert self._gate.wait(30)
        return self.original(*args, **kwargs)

    def release(self) -> None:
        self._gate.set()


def returns_while_the_write_is_held(ckpt: ShardedCheckpointer) -> None:
    """`wait_staged()` returns (within 10 s) while the writer is held."""
    updating = threading.Thread(target=ckpt.wait_staged, daemon=True)
    updating.start()
    updating.join(10)
    assert not updating.is_alive(), "the update waited for the held write"


def test_the_update_takes_back_what_is_not_yet_written_as_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer stopped between its first tensor and its second: the update does not
    wait for the rest of the write; the three tensors not yet written are copied and
    written from the copies, the first was written live."""
    hold = Hold(LiveTensors.claim, call=2)
    monkeypatch.setattr(LiveTensors, "claim", lambda self: hold(self))
    ckpt = in_place_checkpointer(tmp_path)
    live = live_state()
    ckpt.save(step=1, attempt=0, state=live, manifest_fields={}, in_place=True)
    assert ckpt._stager is None and ckpt._own_stager is None  # no staging copy
    live["optim"]["param_groups"][0]["lr"] = 9.0  # the next step's schedule: not saved
    assert hold.reached.wait(30)
    returns_while_the_write_is_held(ckpt)  # it no longer reads the live tensors
    assert ckpt._inflight is not None and not ckpt._inflight.done()
    assert ckpt.last_taken_back_bytes == 3 * NUMEL * 4
    update(live)
    hold.release()
    assert [c.step for c in ckpt.close()] == [1]
    assert_saved_as_at_the_save(tmp_path)


def test_the_update_waits_for_the_tensor_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import elastrain.checkpoints.dcp.writer as writer

    hold = Hold(writer.record_parts, call=2)  # the second tensor, claimed: being written
    monkeypatch.setattr(writer, "record_parts", hold)
    ckpt = in_place_checkpointer(tmp_path)
    live = live_state()
    ckpt.save(step=1, attempt=0, state=live, manifest_fields={}, in_place=True)
    waited: list[float] = []
    updating = threading.Thread(target=lambda: waited.append(ckpt.wait_staged()))
    assert hold.reached.wait(30)
    updating.start()
    updating.join(0.3)
    assert updating.is_alive()  # the second tensor is read live: not yet
    hold.release()
    updating.join(30)
    assert waited and waited[0] >= 0.25  # held 0.3 s from just after its start
    update(live)
    assert [c.step for c in ckpt.close()] == [1]
    assert ckpt.last_taken_back_bytes <= 2 * NUMEL * 4  # the third and fourth at most
    assert_saved_as_at_the_save(tmp_path)


def test_a_writer_going_from_tensor_to_tensor_lets_the_update_take_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow disk, every tensor's write 0.1 s: the update asks while one is written and
    gets the rest as copies, though the writer is never between two tensors for long
    (without the writer giving way, it would take every next tensor first)."""
    import elastrain.checkpoints.dcp.writer as writer

    started = threading.Event()
    original = writer.record_parts

    def slow_parts(*args: Any, **kwargs: Any) -> Any:
        started.set()
        time.sleep(0.1)
        return original(*args, **kwargs)

    monkeypatch.setattr(writer, "record_parts", slow_parts)
    names = [f"t{i:02d}" for i in range(16)]
    live = {name: torch.full((NUMEL,), float(i)) for i, name in enumerate(names)}
    ckpt = in_place_checkpointer(tmp_path)
    ckpt.save(step=1, attempt=0, state=live, manifest_fields={}, in_place=True)
    assert started.wait(30)
    ckpt.wait_staged()
    assert ckpt.last_taken_back_bytes >= 4 * NUMEL * 4  # of the 16 tensors, 15 usually
    for value in live.values():
        value.add_(10.0)
    assert [c.step for c in ckpt.close()] == [1]
    target = {name: torch.zeros(NUMEL) for name in names}
    reader = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
    assert reader.load_latest(target) is not None
    for i, name in enumerate(names):
        assert torch.equal(target[name], torch.full((NUMEL,), float(i))), name


def test_an_update_before_the_write_started_copies_every_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update asks while DCP plans: it waits for the writer to say which tensors it
    writes, then, the writer held before its first one, copies all four."""
    planning = Hold(state_dict_saver.save, call=1)
    monkeypatch.setattr(state_dict_saver, "save", planning)
    # Held too: else a writer quicker than the waking update (9 ms for these four on a
    # loaded machine) is done before it, and nothing is left to copy.
    first_tensor = Hold(LiveTensors.claim, call=1)
    monkeypatch.setattr(LiveTensors, "claim", lambda self: first_tensor(self))
    ckpt = in_place_checkpointer(tmp_path)
    live = live_state()
    assert ckpt.last_tensor_write_s is None
    ckpt.save(step=1, attempt=0, state=live, manifest_fields={}, in_place=True)

    waited: list[float] = []
    updating = threading.Thread(target=lambda: waited.append(ckpt.wait_staged()))
    updating.start()
    assert planning.reached.wait(30)
    updating.join(0.3)
    assert updating.is_alive()  # DCP is planning: which tensors it writes is not known yet
    planning.release()
    updating.join(30)
    assert not updating.is_alive(), "the update waited for the held writer"
    assert waited and waited[0] >= 0.25  # held 0.3 s from just after its start
    assert ckpt.last_taken_back_bytes == 4 * NUMEL * 4
    update(live)  # the update, once allowed
    first_tensor.release()

    assert [c.step for c in ckpt.close()] == [1]
    assert ckpt.last_tensor_write_s is not None and ckpt.last_tensor_write_s >= 0.3
    assert_saved_as_at_the_save(tmp_path)


def test_a_writer_without_claims_holds_the_update_for_the_whole_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's own write loop (no tensor records from templates) reads the live tensors
    where it likes: the update waits until the data is written."""
    gate, closing = threading.Event(), threading.Event()
    original = DigestingStream.close

    def held_close(self: DigestingStream) -> None:
        closing.set()
        assert gate.wait(30)
        original(self)

    monkeypatch.setattr(DigestingStream, "close", held_close)
    ckpt = in_place_checkpointer(tmp_path)
    ckpt.template_records = False
    live = live_state()
    ckpt.save(step=1, attempt=0, state=live, manifest_fields={}, in_place=True)
    updating = threading.Thread(target=ckpt.wait_staged)
    updating.start()
    assert closing.wait(30)
    updating.join(0.3)
    assert updating.is_alive()
    gate.set()
    updating.join(30)
    assert ckpt.last_taken_back_bytes == 0
    update(live)
    assert [c.step for c in ckpt.close()] == [1]
    assert_saved_as_at_the_save(tmp_path)


def test_a_failed_in_place_write_raises_before_the_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_save(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(state_dict_saver, "save", failing_save)
    ckpt = in_place_checkpointer(tmp_path)
    ckpt.save(step=1, attempt=0, state=live_state(), manifest_fields={}, in_place=True)
    with pytest.raises(CheckpointSaveError, match="disk full"):
        ckpt.wait_staged()
    with pytest.raises(CheckpointSaveError):
        ckpt.close()
    assert not list(tmp_path.glob("step_*/manifest.json"))


def test_a_write_failing_after_the_update_took_the_tensors_back_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = Hold(LiveTensors.claim, call=2)
    original_write = DigestingStream.write

    def failing_write(self: DigestingStream, data: Any) -> int:
        if self.tell() > NUMEL * 4:  # into the second tensor
            raise OSError("disk full")
        return original_write(self, data)

    monkeypatch.setattr(LiveTensors, "claim", lambda self: hold(self))
    monkeypatch.setattr(DigestingStream, "write", failing_write)
    ckpt = in_place_checkpointer(tmp_path)
    ckpt.save(step=1, attempt=0, state=live_state(), manifest_fields={}, in_place=True)
    returns_while_the_write_is_held(ckpt)  # the write goes on from the copies
    hold.release()
    with pytest.raises(CheckpointSaveError, match="disk full"):
        ckpt.close()
    assert not list(tmp_path.glob("step_*/manifest.json"))


def test_in_place_needs_a_caller_that_waits(tmp_path: Path) -> None:
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    with pytest.raises(ValueError, match="in_place needs async_staging"):
        ckpt.save(step=1, attempt=0, state=live_state(), manifest_fields={}, in_place=True)
    ckpt.close()


class BatchNormNet(Strategy):
    """The state_dict part of a strategy, on a model whose forward changes buffers."""

    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)

    def setup(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def test_a_state_for_an_in_place_save_copies_the_buffers_alone() -> None:
    net = BatchNormNet()
    net.model(torch.randn(8, 4)).sum().backward()
    net.optimizer.step()
    live = net.state_dict_for_checkpoint()["model"]
    frozen = net.state_dict_for_checkpoint(copy_buffers=True)["model"]
    assert frozen.keys() == live.keys()
    buffers = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for key in live:
        same = frozen[key].data_ptr() == live[key].data_ptr()
        assert same == (key not in buffers), key  # weights live, buffers copied
        assert torch.equal(frozen[key], live[key])
    net.model(torch.randn(8, 4) + 5)  # a forward moves the statistics, not the copies
    assert not torch.equal(frozen["1.running_mean"], live["1.running_mean"])


@pytest.mark.parametrize(
    ("async_save", "on_host", "tensor_write_s", "step_s", "expected"),
    [
        (True, True, 0.2, 1.0, True),
        (True, True, 0.5, 1.0, True),  # hidden behind the next forward and backward
        (True, True, 1.0, 1.0, True),  # a step: at most a few tensors left to copy
        (True, True, 1.01, 1.0, False),  # a slow disk: stage, beside forward and backward
        (True, True, None, 1.0, True),  # no write timed yet: at worst the update copies
        (True, False, 0.01, 1.0, False),  # a device's state is copied to the host anyway
        (False, True, 0.01, 1.0, False),  # sync saves block anyway
        (True, True, 0.01, 0.0, False),
    ],
)
def test_writes_in_place(
    async_save: bool, on_host: bool, tensor_write_s: float | None, step_s: float, expected: bool
) -> None:
    assert (
        writes_in_place(
            async_save=async_save, on_host=on_host, tensor_write_s=tensor_write_s, step_s=step_s
        )
        is expected
    )


def test_the_tensor_write_time_leaves_out_the_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `writes_in_place` compares with a step: how long the tensors are read, not
    the fsync after them (an in-place save's update never waits for that)."""
    import elastrain.checkpoints.dcp.writer as writer

    original = writer.os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(2.0)
        original(fd)

    monkeypatch.setattr(writer.os, "fsync", slow_fsync)
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=False)
    started = time.perf_counter()
    ckpt.save(step=1, attempt=0, state=live_state(), manifest_fields={})
    assert time.perf_counter() - started >= 2.0
    assert ckpt.last_tensor_write_s is not None and ckpt.last_tensor_write_s < 2.0
    ckpt.close()
