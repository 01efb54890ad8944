"""`StepMetrics` and `SavedTraining`: the typed points and checkpoint extras, and their
flat stored forms (metric rows, manifests) read back without loss."""

from __future__ import annotations

import math

from elastrain.contracts.messages import SavedTraining, StepMetrics


def _point(**overrides: object) -> StepMetrics:
    fields: dict = dict(
        step=7, loss=1.25, wall_time=1000.0, world_size=2, dp=2, pp=1, tp=1, lr=3e-4,
        step_time_s=0.5, checkpoint_stall_s=0.0, samples_per_s=64.0, tokens_per_s=None,
        memory={"param_bytes": 10, "rss_bytes": 20}, batch_crc=99,
    )  # fmt: skip
    fields.update(overrides)
    return StepMetrics(**fields)


def test_flat_form_round_trips() -> None:
    point = _point(eval_loss=1.5, mfu_basis="no peak", custom={"grad_norm": 0.3})
    again = StepMetrics.from_point(point.to_point())
    assert again == point


def test_flat_form_has_plain_names_and_leaves_out_what_is_unset() -> None:
    values = _point().to_values()
    assert values["loss"] == 1.25 and values["memory"] == {"param_bytes": 10, "rss_bytes": 20}
    assert "tokens_per_s" not in values and "eval_loss" not in values and "step" not in values
    assert StepMetrics(step=1, loss=None).to_values()["loss"] is None  # a gap, kept as one


def test_unknown_names_are_custom_and_never_shadow_built_in_ones() -> None:
    point = StepMetrics.from_point({"step": 3, "loss": 2.0, "grad_norm": 0.5})
    assert point.custom == {"grad_norm": 0.5} and point.loss == 2.0
    clash = StepMetrics(step=3, loss=2.0, custom={"loss": 9.0, "acc": 0.1})
    assert clash.to_values()["loss"] == 2.0 and clash.to_values()["acc"] == 0.1


def test_finite_nulls_every_non_finite_float() -> None:
    point = _point(loss=math.nan, step_time_s=math.inf, custom={"gn": -math.inf, "ok": 1.0})
    stored = point.finite()
    assert stored.loss is None and stored.step_time_s is None
    assert stored.custom == {"gn": None, "ok": 1.0}
    assert stored.lr == point.lr and stored.memory == point.memory
    assert _point().finite() == _point()


def test_saved_training_round_trips_through_a_manifest_extra() -> None:
    saved = SavedTraining(seed=1, global_batch_size=8, micro_batch_size=4,
                          save_started_at=123.5, metrics=(_point(), _point(step=8)))  # fmt: skip
    assert SavedTraining.from_extra(saved.to_extra()) == saved


def test_saved_training_reads_an_older_or_foreign_extra() -> None:
    assert SavedTraining.from_extra(None) == SavedTraining()
    older = SavedTraining.from_extra({"seed": 3, "metrics": [{"step": 2, "loss": 1.0}]})
    assert older.seed == 3 and older.save_started_at is None
    assert [m.step for m in older.metrics] == [2]


def test_catalogued_manifest_leaves_the_points_out() -> None:
    manifest = {"step": 8, "extra": SavedTraining(seed=1, metrics=(_point(),)).to_extra()}
    catalogued = SavedTraining.without_points(manifest)
    assert catalogued is not None and "metrics" not in catalogued["extra"]
    assert catalogued["extra"]["seed"] == 1 and "metrics" in manifest["extra"]
    assert SavedTraining.without_points(None) is None
