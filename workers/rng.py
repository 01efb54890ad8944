"""Randomness a job can continue: every rank seeded alike before the model is built, and
per-rank streams (dropout) that a resumed attempt picks up where they were, or restarts
from (seed, step, rank) where the world changed."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def reseed(seed: int, step: int, rank: int) -> None:
    """Per-rank RNG streams (dropout) that depend only on (seed, step, rank)."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    seed_everything(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def get_rng_states(world_size: int) -> dict[str, Any]:
    states: dict[str, Any] = {
        "world_size": world_size,
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    random.setstate(_as_tuple(states["python"]))
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["torch_cuda"])


def _as_tuple(value: Any) -> Any:
    # random.setstate wants tuples; a serialiser may have handed back lists.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value
