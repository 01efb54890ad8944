"""Fixtures shared by the unit tests of the checkpoint writer."""

from __future__ import annotations

import pytest


@pytest.fixture
def gathered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the pieces a shard file copied into its bounce buffer: what a write
    did not send to the disk straight from the caller's memory (`shard_file`)."""
    from elastrain.checkpoints.dcp.shard_file import DigestingStream

    sizes: list[int] = []
    original = DigestingStream._gather

    def spy(self: DigestingStream, view: memoryview) -> None:
        sizes.append(len(view))
        original(self, view)

    monkeypatch.setattr(DigestingStream, "_gather", spy)
    return sizes
