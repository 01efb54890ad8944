"""MFU: the peak table, the override, and the arithmetic."""

from __future__ import annotations

import pytest

from elastrain.workers.flops import mfu, peak_flops


@pytest.mark.parametrize(
    ("name", "dtype", "override", "peak", "basis"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", None, 989e12, "H100 bf16 dense peak"),
        ("NVIDIA H100 PCIe", "bf16", None, 756e12, "H100 PCIe bf16 dense peak"),
        ("NVIDIA H200", "fp32", None, 67e12, "H200 fp32 dense peak"),
        ("NVIDIA A100-SXM4-80GB", "fp16", None, 312e12, "A100 fp16 dense peak"),
        ("Tesla T4", "bf16", None, None, "no bf16 peak listed for T4"),
        ("cpu", "fp32", None, None, "set ELASTRAIN_PEAK_FLOPS"),
        ("cpu", "fp32", "2.5e11", 2.5e11, "ELASTRAIN_PEAK_FLOPS"),
        ("NVIDIA H100", "bf16", "1e15", 1e15, "ELASTRAIN_PEAK_FLOPS"),
        ("cpu", "fp32", "fast", None, "is not a number"),
        ("cpu", "fp32", "-1", None, "must be > 0"),
    ],
)
def test_peak_flops(
    name: str, dtype: str, override: str | None, peak: float | None, basis: str
) -> None:
    got, why = peak_flops(name, dtype, override)
    assert got == peak and basis in why


def test_mfu_is_model_flops_per_rank_over_the_peak() -> None:
    # 1e9 FLOPs a sample, 64 samples a step in 0.5 s over 4 ranks: 32 GFLOP/s a rank.
    per_rank, utilisation = mfu(1e9, 64, 0.5, 4, peak=64e9)
    assert per_rank == pytest.approx(32e9) and utilisation == pytest.approx(0.5)
    assert mfu(1e9, 64, 0.5, 4, peak=None) == (pytest.approx(32e9), None)
    assert mfu(None, 64, 0.5, 4, peak=64e9) == (None, None)
