"""The learning rate of each optimizer step: a pure function of the step, so a resumed job
(at any world size, from a checkpoint or a peer's memory) continues the same curve.

- `constant`: `lr` after a linear warm-up of `warmup_steps` (none by default).
- `cosine`: the same warm-up, then half a cosine from `lr` down to `min_lr` at `max_steps`
  (nanoGPT's and torchtitan's shape).

Warm-up step s (0-based, the step about to be taken) uses lr * (s + 1) / warmup_steps, so
the first step is not taken at lr 0.
"""

from __future__ import annotations

import math

from elastrain.contracts.spec import LrSchedule, TrainingSpec


def lr_at(step: int, training: TrainingSpec) -> float:
    """The learning rate for the optimizer step taken from `step` completed steps."""
    peak, warmup = training.learning_rate, training.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if training.lr_schedule == LrSchedule.constant:
        return peak
    decay_steps = max(1, training.max_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return training.min_lr + 0.5 * (peak - training.min_lr) * (1 + math.cos(math.pi * progress))
