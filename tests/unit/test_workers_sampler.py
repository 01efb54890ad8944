"""The elastic sampler: a step's sample ids depend only on (seed, N, G, step)."""

from __future__ import annotations

import struct
import zlib

import pytest

from elastrain.workers.sampler import ElasticSampler, batch_crc, split_sizes


@pytest.mark.parametrize(("n", "g"), [(100, 32), (37, 10), (10, 7), (5, 12)])
def test_global_batch_is_the_epoch_stream(n: int, g: int) -> None:
    sampler = ElasticSampler(num_samples=n, global_batch_size=g, seed=3)
    stream = [i for step in range(6) for i in sampler.global_batch(step)]
    epochs = [sampler.epoch_permutation(e).tolist() for e in range(len(stream) // n + 1)]
    assert stream == [i for perm in epochs for i in perm][: len(stream)]
    for perm in epochs:  # every epoch is a permutation of the whole dataset
        assert sorted(perm) == list(range(n))


def test_deterministic_across_instances_and_seeds() -> None:
    a = ElasticSampler(num_samples=50, global_batch_size=16, seed=7)
    b = ElasticSampler(num_samples=50, global_batch_size=16, seed=7)
    # b is asked out of order: no hidden state (cache) may change the answer.
    assert [a.global_batch(s) for s in range(8)] == [b.global_batch(s) for s in reversed(range(8))][
        ::-1
    ]
    c = ElasticSampler(num_samples=50, global_batch_size=16, seed=8)
    assert a.global_batch(0) != c.global_batch(0)


@pytest.mark.parametrize("g", [1, 5, 12, 13, 32])
@pytest.mark.parametrize("micro", [1, 3, 8])
def test_any_dp_sees_the_same_ids_in_contiguous_shares(g: int, micro: int) -> None:
    sampler = ElasticSampler(num_samples=40, global_batch_size=g, seed=0)
    for step in range(4):
        batch = sampler.global_batch(step)
        for dp in range(1, 5):
            shares = [sampler.replica_share(step, r, dp) for r in range(dp)]
            # Contiguous, disjoint shares that concatenate to the global batch, in order.
            assert [i for share in shares for i in share] == batch
            sizes = [len(s) for s in shares]
            assert max(sizes) - min(sizes) <= 1
            per_replica = [sampler.microbatches(step, r, dp, micro) for r in range(dp)]
            # Same micro-batch count everywhere so collectives stay in lockstep.
            counts = {len(mbs) for mbs in per_replica}
            assert counts == {sampler.num_microbatches(dp, micro)}
            for share, mbs in zip(shares, per_replica, strict=True):
                assert [i for mb in mbs for i in mb] == share
                assert all(len(mb) <= micro for mb in mbs)
                assert max(map(len, mbs)) - min(map(len, mbs)) <= 1


def test_small_shares_get_empty_microbatches() -> None:
    # G=5 over dp=4: shares 2,1,1,1; A = ceil(2/1) = 2, so replicas 1..3 get one empty.
    sampler = ElasticSampler(num_samples=20, global_batch_size=5, seed=0)
    mbs = [sampler.microbatches(0, r, 4, 1) for r in range(4)]
    assert [list(map(len, m)) for m in mbs] == [[1, 1], [1, 0], [1, 0], [1, 0]]


def test_split_sizes_and_crc() -> None:
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(2, 4) == [1, 1, 0, 0]
    # A fingerprint of the ids alone (CRC-32 of them as little-endian int64s): the same in
    # every process and every release, so a run compares with one stored earlier.
    assert batch_crc([1, 2, 3]) == zlib.crc32(struct.pack("<3q", 1, 2, 3)) == 734760327
    assert batch_crc([1, 3, 2]) != batch_crc([1, 2, 3])  # the order counts


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="empty"):
        ElasticSampler(num_samples=0, global_batch_size=4, seed=0)
    sampler = ElasticSampler(num_samples=4, global_batch_size=4, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        sampler.replica_share(0, 2, 2)
