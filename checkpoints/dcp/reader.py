"""DCP's own reader, over shard files verified first. In `read_data`, each rank

1. opens every shard file its plan reads (regular files, through no link: a link a job
   planted must not make a load or export read elsewhere) and checks size and digest;
2. agrees with every rank of the load (one all-gather of verdicts) before any byte
   reaches the state: a corrupt file anywhere makes every rank raise `CorruptCheckpoint`,
   state untouched, and fall back to an older checkpoint;
3. runs DCP's `read_data` on the files opened in 1: what is decoded is what was hashed
   (not a file renamed over it since), from the page cache the hash filled.

The small files (`.metadata`, rank extras) are checked on rank 0 before the load
(`elastrain.checkpoints.catalog`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, BinaryIO

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from elastrain.checkpoints.integrity import CorruptCheckpoint, digest_mismatch, digest_stream
from elastrain.checkpoints.manifest import FileEntry
from elastrain.contracts.files import ConfinedFileError, open_regular


class VerifyingReader(FileSystemReader):
    """`expected`: the manifest's entries; `process_group`: the load's group (for the
    agreement), None without torch.distributed."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expected: Mapping[str, FileEntry],
        process_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(path)
        self.expected = expected
        self.process_group = process_group
        self.fs = self._verified = _VerifiedFiles()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        with ExitStack() as opened:
            problem = None
            try:
                for name in names:
                    f = opened.enter_context(open_regular(os.path.join(self.path, name)))
                    problem = self._problem(name, f)
                    if problem is not None:
                        break
                    f.seek(0)
                    self._verified.files[str(self.fs.concat_path(self.path, name))] = f
            except Exception as e:  # a problem found, not raised: the peers wait for a verdict
                problem = str(e) if isinstance(e, ConfinedFileError) else f"cannot read {name}: {e}"
            try:
                self._agree(problem)
                return super().read_data(plan, planner)
            finally:
                self._verified.files.clear()

    def _problem(self, name: str, f: BinaryIO) -> str | None:
        """Why one open file is not what the manifest says, or None."""
        entry = self.expected.get(name)
        if entry is None:
            return f"{name} is not in the manifest"
        size = os.fstat(f.fileno()).st_size
        if size != entry["size"]:
            return f"size mismatch: {name} is {size} bytes, manifest says {entry['size']}"
        return digest_mismatch(name, entry, digest_stream(f, entry["algorithm"]))

    def _agree(self, problem: str | None) -> None:
        """Raise CorruptCheckpoint on every rank when any rank found a problem. Errors
        reading a file are problems, not exceptions, so every rank gets here and the
        all-gather always completes."""
        verdicts: list[Any] = [problem]
        me = 0
        if self.process_group is not None:
            verdicts = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(verdicts, problem, group=self.process_group)
            me = dist.get_rank(self.process_group)
        if any(verdict is not None for verdict in verdicts):
            raise CorruptCheckpoint(
                self.path, verdicts[me] or "another rank found one of its shard files corrupt"
            )


class _VerifiedFiles(FileSystem):
    """DCP's file system, reading the files `read_data` verified (`files`: path -> open
    file); other paths (`.metadata`) as DCP does."""

    def __init__(self) -> None:
        self.files: dict[str, BinaryIO] = {}

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        verified = self.files.get(str(path))
        if verified is None or mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        yield verified  # type: ignore[misc]  # closed by read_data
