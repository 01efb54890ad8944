"""Model FLOPs utilisation: achieved model FLOPs per second over the device's peak.

The model FLOPs of a step are the workload's `flops_per_sample` (the gpt's: 6·N per token
for the matmuls of forward and backward, plus 12·L·d·T per token for attention, as
nanoGPT and torchtitan count them) times the global batch; each rank is credited an equal
share. Recomputation (activation checkpointing) is not model FLOPs and does not count: MFU
goes down when a job recomputes, which is the point of measuring it.

Peaks are the vendors' dense (no sparsity) tensor-core numbers for the dtype the job
computes in (`strategy.mixed_precision`: bf16/fp16; otherwise fp32, which PyTorch runs
without TF32 by default). A CPU has no such table: set `ELASTRAIN_PEAK_FLOPS` (per worker,
FLOP/s) on the nodes to get MFU there; otherwise it is left empty, with the reason.
"""

from __future__ import annotations

import os

import torch

#: (name fragment, {dtype: dense peak FLOP/s}); the first fragment found in the device's
#: name wins, so more specific names come first.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("T4", {"fp16": 65e12, "fp32": 8.1e12}),
)
PEAK_ENV = "ELASTRAIN_PEAK_FLOPS"


def peak_flops(
    device_name: str, dtype: str, override: str | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device computing in `dtype`, where the number comes from), or
    (None, why there is none)."""
    if override:
        try:
            value = float(override)
        except ValueError:
            return None, f"{PEAK_ENV}={override!r} is not a number"
        if value > 0:
            return value, f"{PEAK_ENV}"
        return None, f"{PEAK_ENV} must be > 0"
    for fragment, peaks in PEAK_FLOPS:
        if fragment.lower() in device_name.lower():
            if dtype in peaks:
                return peaks[dtype], f"{fragment} {dtype} dense peak"
            return None, f"no {dtype} peak listed for {fragment}"
    return None, f"no peak FLOP/s known for {device_name!r}; set {PEAK_ENV} on the workers"


def device_peak(device: torch.device, mixed_precision: str | None) -> tuple[float | None, str]:
    """The peak for this rank's device and the job's compute dtype."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return peak_flops(name, mixed_precision or "fp32", os.environ.get(PEAK_ENV))


def mfu(
    flops_per_sample: float | None,
    global_batch: int,
    step_time_s: float,
    world_size: int,
    peak: float | None,
) -> tuple[float | None, float | None]:
    """(model FLOP/s achieved per rank, MFU), None where unknown."""
    if not flops_per_sample or step_time_s <= 0:
        return None, None
    per_rank = flops_per_sample * global_batch / step_time_s / world_size
    return per_rank, (per_rank / peak if peak else None)
