"""Which digest a checkpoint's files carry, by name. Pure Python.

A checkpoint's digests are for corruption (bit rot, a torn or overwritten shard), not for
tampering: whoever can write a shard can also rewrite the manifest beside it. So the
default is XXH3-128, a non-cryptographic hash that runs at memory speed (~29 GB/s on one
core of the bench machine against sha256's 1.9 GB/s, docs/bench-checkpoint.md), which is
what lets a verified load keep up with a plain read. sha256 stays available
(`checkpoint.digest: sha256` in the job spec) and is what manifests written before this
module (format version 1) carry; both verify.

The manifest names the algorithm of every file, so a reader never guesses, and a name it
does not know is refused with that name rather than read as a mismatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import xxhash

XXH3_128 = "xxh3-128"
SHA256 = "sha256"
DEFAULT_ALGORITHM = XXH3_128


class Hasher(Protocol):
    """What hashlib's and xxhash's objects both offer."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


_CONSTRUCTORS: dict[str, Callable[[], Hasher]] = {
    XXH3_128: xxhash.xxh3_128,
    SHA256: hashlib.sha256,
}
ALGORITHMS = tuple(_CONSTRUCTORS)
"""Every algorithm a manifest may name."""

# The job spec's `checkpoint.digest` values (elastrain.contracts.spec.CheckpointDigest) -> the name
# written into manifests: short for the user, exact (width included) on storage.
_SETTINGS = {"xxh3": XXH3_128, "sha256": SHA256}


class UnknownDigestAlgorithm(ValueError):
    def __init__(self, algorithm: object) -> None:
        super().__init__(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
        self.algorithm = algorithm


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hash object for `algorithm` (one of ALGORITHMS)."""
    try:
        return _CONSTRUCTORS[algorithm]()
    except (KeyError, TypeError):
        raise UnknownDigestAlgorithm(algorithm) from None


def check_algorithm(algorithm: object) -> str:
    """`algorithm` if it is one of ALGORITHMS, else UnknownDigestAlgorithm."""
    if not isinstance(algorithm, str) or algorithm not in _CONSTRUCTORS:
        raise UnknownDigestAlgorithm(algorithm)
    return algorithm


def algorithm_for_setting(setting: str) -> str:
    """The manifest's algorithm name for a `checkpoint.digest` setting ('xxh3', 'sha256');
    a manifest name is accepted as itself."""
    if setting in _SETTINGS:
        return _SETTINGS[setting]
    return check_algorithm(setting)
