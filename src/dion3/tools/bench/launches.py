"""Kernel launches per optimizer step, for `dion3 bench`: small models' eager steps are set by
the host's launches, not by the tensor cores, so a step that launches more is slower there
whatever its FLOPs (benchmarks/results/cpu-2026-12-01.md, "Ops dispatched per eager step": at
512-wide matrices step time ≈ ops dispatched × host time per op; steps-small-h200-2026-12-03.md:
kernels per step of the study model's matrices)."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def launches_per_step(step: Callable[[], object], device: torch.device) -> Optional[int]:
    """The GPU kernels, copies and fills one call of `step` runs, counted by torch.profiler on
    CUDA (a graph replay counts the kernels it replays); None elsewhere."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
