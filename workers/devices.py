"""Which device a worker process trains on, and the GPU it owns for its lifetime.

A GPU node's pool holds one process per GPU (`elastrain.workers.runtime.pool`). Each is started
with the node-local index of its GPU and, before anything initialises CUDA, narrows
`CUDA_VISIBLE_DEVICES` to that one GPU: from then on `cuda:0` in that process is its GPU,
whichever attempt of whichever job it serves. It makes its CUDA context when it starts
(`warm_cuda`), so no attempt pays for that. A CPU process hides every GPU, so a CPU job's
code never lands on a GPU a GPU rank owns.

The processes ask Ray for no GPU themselves (num_gpus=0, as they ask for no CPU): the
attempt that borrows one reserves the GPU in its placement group, so Ray's view of free
GPUs and the service's capacity arithmetic agree (docs/bench-gpu.md says why not
num_gpus=1 per process).

Test-only switch: with `ELASTRAIN_TEST_GPU_ON_CPU=1` in the environment of the Ray
nodes, a rank of a GPU job trains on the CPU with gloo. Scheduling and accounting of
GPU jobs are then tested on machines without a GPU, on Ray nodes that declare GPU
resources (`ray.cluster_utils.Cluster` nodes with `num_gpus=2`). Never set it in
production: a GPU job would silently run on CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Set to 1 on the Ray nodes of a test: GPU ranks train on the CPU with gloo.
TEST_GPU_ON_CPU = "ELASTRAIN_TEST_GPU_ON_CPU"
VISIBLE = "CUDA_VISIBLE_DEVICES"


def gpu_on_cpu(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the test-only switch is on."""
    return env.get(TEST_GPU_ON_CPU, "") not in ("", "0", "false", "False")


def visible_devices_for(gpu: int | None, inherited: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` a process owning node-local GPU `gpu` (None: a CPU
    process) sets for itself. `inherited` is what its raylet was started with: when that
    names devices, index `gpu` counts within them (as Ray numbers the node's GPUs)."""
    if gpu is None:
        return ""
    names = [d.strip() for d in inherited.split(",") if d.strip()] if inherited else []
    if not names:
        return str(gpu)
    if gpu >= len(names):
        raise ValueError(f"GPU index {gpu} but the node shows only {VISIBLE}={inherited}")
    return names[gpu]


def pin_visible_gpu(gpu: int | None) -> str:
    """Narrow this process to its GPU (or to none); call before CUDA is initialised."""
    os.environ[VISIBLE] = visible_devices_for(gpu, os.environ.get(VISIBLE))
    return os.environ[VISIBLE]


def rank_device(use_gpu: bool, *, env: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(torch device, torch.distributed backend) of a rank of a job that does or does not
    `use_gpu`: its process's own GPU and NCCL, else the CPU and gloo (also for a GPU job
    under the test-only switch)."""
    if use_gpu and not gpu_on_cpu(env):
        return "cuda:0", "nccl"
    return "cpu", "gloo"


def warm_cuda(gpu: int | None) -> str:
    """Make this process's CUDA context now (the first attempt would pay for it
    otherwise: hundreds of milliseconds to seconds) and say what the process trains on."""
    import torch

    if gpu is None:
        return "cpu"
    if not torch.cuda.is_available():
        if gpu_on_cpu():
            return f"cpu (GPU {gpu} declared; {TEST_GPU_ON_CPU})"
        # Started for a GPU Ray declares but CUDA cannot see: a GPU rank would fail here
        # with a clear message rather than at its first tensor.
        return f"no CUDA for GPU {gpu} ({VISIBLE}={os.environ.get(VISIBLE)!r})"
    try:
        torch.cuda.init()
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda").add_(1)  # a real allocation: the context, the allocator
        torch.cuda.synchronize()
    except Exception as exc:  # the process still starts (the pool would restart it forever);
        # a GPU rank sent here fails at its first CUDA call and says why
        return f"CUDA failed on GPU {gpu}: {type(exc).__name__}: {str(exc)[:200]}"
    return f"cuda:0 = GPU {gpu} ({torch.cuda.get_device_name(0)})"


def to_host(state: Any) -> Any:
    """A copy of a (nested) state dict with every tensor in host memory: what a process
    keeps of a GPU rank's state beyond its device (a buddy's copy, a hand-over)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True) if state.device.type != "cpu" else state
    if isinstance(state, dict):
        return {k: to_host(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(to_host(v) for v in state)
    return state


def to_device(state: Any, device: torch.device | str) -> Any:
    """The inverse of `to_host`, for loaders that do not copy into existing parameters
    themselves (`set_state_dict` does: it takes host tensors as they are)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.to(device, non_blocking=True)
    if isinstance(state, dict):
        return {k: to_device(v, device) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(to_device(v, device) for v in state)
    return state
