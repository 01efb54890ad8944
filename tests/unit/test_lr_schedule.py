"""The learning-rate schedule: a pure function of the step (so resumes continue it)."""

from __future__ import annotations

import itertools
import math

import pytest
from pydantic import ValidationError

from elastrain.contracts.spec import TrainingSpec
from elastrain.workers.lr_schedule import lr_at


def training(**kw: object) -> TrainingSpec:
    return TrainingSpec.model_validate({"learning_rate": 1.0, "max_steps": 110, **kw})


@pytest.mark.parametrize(
    ("spec", "step", "lr"),
    [
        pytest.param({}, 0, 1.0, id="constant"),
        pytest.param({}, 109, 1.0, id="constant-last"),
        pytest.param({"warmup_steps": 10}, 0, 0.1, id="warmup-first-step-not-zero"),
        pytest.param({"warmup_steps": 10}, 9, 1.0, id="warmup-last"),
        pytest.param({"warmup_steps": 10}, 50, 1.0, id="constant-after-warmup"),
        pytest.param({"lr_schedule": "cosine", "warmup_steps": 10}, 10, 1.0, id="cosine-peak"),
        pytest.param(
            {"lr_schedule": "cosine", "warmup_steps": 10, "min_lr": 0.1},
            60,
            0.55,
            id="cosine-halfway",
        ),
        pytest.param(
            {"lr_schedule": "cosine", "warmup_steps": 10, "min_lr": 0.1},
            110,
            0.1,
            id="cosine-end-is-min-lr",
        ),
        pytest.param({"lr_schedule": "cosine"}, 0, 1.0, id="cosine-no-warmup"),
    ],
)
def test_lr_at(spec: dict, step: int, lr: float) -> None:  # type: ignore[type-arg]
    assert math.isclose(lr_at(step, training(**spec)), lr, rel_tol=1e-12)


def test_cosine_falls_monotonically_after_warmup() -> None:
    t = training(lr_schedule="cosine", warmup_steps=5, min_lr=0.01)
    lrs = [lr_at(s, t) for s in range(5, 110)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert lrs[0] == 1.0 and lrs[-1] > 0.01


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"warmup_steps": 110}, "training.warmup_steps (110) must be < training.max_steps"),
        ({"lr_schedule": "cosine", "min_lr": 2.0}, "training.min_lr (2.0) must be <="),
        ({"min_lr": 0.1}, "only used by lr_schedule 'cosine'"),
        ({"lr_schedule": "linear"}, "'constant' or 'cosine'"),
        ({"grad_clip": 0}, "greater than 0"),
    ],
)
def test_impossible_training_specs_name_the_field(spec: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError, match=words.replace("(", r"\(").replace(")", r"\)")):
        training(**spec)
