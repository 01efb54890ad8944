"""Elastic, deterministic batching: which sample ids each optimizer step consumes.

The job fixes the global batch size G. The data is an infinite stream made of one
permutation of the dataset per epoch (`randperm(N)` seeded with `seed + epoch`), and
optimizer step s consumes stream positions [s*G, (s+1)*G). The ids of a step are therefore
a pure function of (seed, N, G, s): the world size, the strategy and any restarts change
who computes which sample, never which samples a step sees. The data position to
checkpoint is just the step number (samples consumed = step * G).

Per step, the `dp` data-parallel replicas take disjoint CONTIGUOUS shares of the G ids
(sizes differ by at most one when dp does not divide G). Each share is cut into A
micro-batches, A = ceil(ceil(G / dp) / micro_batch_size), the same on every replica so
that gradient-sync collectives stay in lockstep; the sizes within a share are as equal as
possible. When a share has fewer than A ids (e.g. G=5, dp=4, micro_batch_size=1: shares
2,1,1,1, A=2) the missing micro-batches are EMPTY. Strategies must still run a step for
an empty micro-batch (they forward a dummy sample with a zero loss weight, see
`elastrain.workers.strategies.base.microbatch_loss`), because the other replicas' collectives wait
for it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` split into `parts` contiguous pieces, as equal as possible, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass
class ElasticSampler:
    num_samples: int
    """N, the dataset length."""
    global_batch_size: int
    """G, fixed by the job whatever the world size."""
    seed: int
    _perm_cache: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError("the dataset is empty")
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {self.global_batch_size}")

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_samples, generator=gen)
            # A step spans at most a few epochs; keep only the newest two permutations.
            self._perm_cache = {e: p for e, p in self._perm_cache.items() if e >= epoch - 1}
            self._perm_cache[epoch] = perm
        return perm

    def global_batch(self, step: int) -> list[int]:
        """The G sample ids optimizer step `step` (0-based) consumes, in stream order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        ids: list[int] = []
        pos, end = step * self.global_batch_size, (step + 1) * self.global_batch_size
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            ids.extend(self.epoch_permutation(epoch)[offset : offset + take].tolist())
            pos += take
        return ids

    def replica_share(self, step: int, dp_rank: int, dp: int) -> list[int]:
        """Replica `dp_rank`'s contiguous share of step `step`'s global batch."""
        return replica_share(self.global_batch(step), dp_rank, dp)

    def num_microbatches(self, dp: int, micro_batch_size: int) -> int:
        """A: the micro-batch count every replica uses (set by the largest share)."""
        return num_microbatches(self.global_batch_size, dp, micro_batch_size)

    def microbatches(
        self, step: int, dp_rank: int, dp: int, micro_batch_size: int
    ) -> list[list[int]]:
        """Replica `dp_rank`'s share cut into A contiguous micro-batches (some maybe empty)."""
        return replica_microbatches(self.global_batch(step), dp_rank, dp, micro_batch_size)


def replica_share(ids: list[int], dp_rank: int, dp: int) -> list[int]:
    """Replica `dp_rank`'s contiguous share of `ids` (sizes differ by at most one)."""
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} not in [0, {dp})")
    sizes = split_sizes(len(ids), dp)
    start = sum(sizes[:dp_rank])
    return ids[start : start + sizes[dp_rank]]


def num_microbatches(total: int, dp: int, micro_batch_size: int) -> int:
    """The micro-batch count every replica uses for `total` ids (set by the largest share)."""
    return math.ceil(math.ceil(total / dp) / micro_batch_size)


def replica_microbatches(
    ids: list[int], dp_rank: int, dp: int, micro_batch_size: int
) -> list[list[int]]:
    """Replica `dp_rank`'s share of `ids` cut into the same number of contiguous
    micro-batches on every replica (some maybe empty): collectives stay in lockstep."""
    share = replica_share(ids, dp_rank, dp)
    out: list[list[int]] = []
    start = 0
    for size in split_sizes(len(share), num_microbatches(len(ids), dp, micro_batch_size)):
        out.append(share[start : start + size])
        start += size
    return out


def batch_crc(ids: list[int]) -> int:
    """A fingerprint of a step's sample ids and their order, for comparing runs."""
    return zlib.crc32(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
