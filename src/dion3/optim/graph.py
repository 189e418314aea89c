"""Run a whole optimizer step as one captured CUDA graph (DESIGN §6).

    step = CapturedStep(optimizer, warmup_steps=3)
    for batch in data:
        loss(batch).backward()
        step()                      # eager for the first warm-up calls, then graph replays
        optimizer.zero_grad(set_to_none=False)

What capture needs, and how it is provided here:
- no host syncs in the step: the rules use fixed k (selection changes only indices) and
  never call .item(); `check_finite=True` syncs and is refused;
- lr and weight decay as device scalars: each group's `lr` and `weight_decay` become 0-d
  tensors on the parameters' device, so torch.optim.lr_scheduler updates them in place
  (schedulers call `fill_` on tensor learning rates) and the graph reads the new values;
- fixed .grad buffers: the graph reads the gradient tensors seen at capture. If a later
  backward produced new gradient tensors (zero_grad(set_to_none=True)), they are copied into
  the captured buffers first, so correctness never depends on the caller's zero_grad mode.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import Tensor

from .base import OrthogonalOptimizer


def to_device_scalars(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Turn every group's lr (and, for dion3's optimizers, weight_decay) into 0-d float32
    tensors on `device`, in place. torch's own optimizers accept a tensor lr when capturable,
    but not a tensor weight decay."""
    keys = ("lr", "weight_decay") if isinstance(optimizer, OrthogonalOptimizer) else ("lr",)
    for group in optimizer.param_groups:
        for key in keys:
            value = group[key]
            if isinstance(value, Tensor):
                if value.device != device or value.dtype != torch.float32:
                    group[key] = value.detach().to(device=device, dtype=torch.float32)
            else:
                group[key] = torch.tensor(float(value), dtype=torch.float32, device=device)


def stepped_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def require_grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients of every parameter, or a clear error naming one that has none."""
    grads = []
    for group_index, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                label = repr(names[i]) if names else f"{i} of group {group_index} (shape {tuple(p.shape)})"
                raise RuntimeError(
                    f"cannot run a captured optimizer step: parameter {label} has no gradient. A CUDA "
                    "graph replays a fixed set of gradient buffers; give every parameter a gradient "
                    "(or move parameters that are not trained into no optimizer group)"
                )
            grads.append(p.grad)
    return grads


class CapturedStep:
    """Call to run one optimizer step; after `warmup_steps` eager steps the step is captured
    into a CUDA graph once and replayed from then on."""

    def __init__(self, optimizer: OrthogonalOptimizer, warmup_steps: int = 3):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"CapturedStep needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be ≥ 1 (kernels are compiled before capture), got {warmup_steps}")
        if getattr(optimizer, "check_finite", False):
            raise ValueError("check_finite=True syncs with the host each step and cannot be captured; disable it")
        distributed = getattr(optimizer, "_is_distributed", lambda: False)()
        if distributed and any(
            g.get("algorithm") == "dion3" and g.get("selection_scope") == "global" for g in optimizer.param_groups
        ):
            raise ValueError(
                "selection_scope='global' exchanges split sizes through the host each step and cannot "
                "be captured in a CUDA graph; use selection_scope='local' for a captured distributed step"
            )
        params = stepped_params(optimizer)
        self._params = params
        devices = {p.device for p in params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"CapturedStep needs all parameters on one CUDA device, got {sorted(map(str, devices))}")
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.device = next(iter(devices))
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._static_grads: list[Tensor] = []
        to_device_scalars(optimizer, self.device)

    def _sync_grads(self) -> None:
        """Copy gradients that live in new tensors into the buffers the graph reads."""
        # Host time per replay matters (≤ 0.2 ms): the usual case, every .grad still the
        # captured buffer, is one identity check per parameter (half of require_grads' time).
        if all(map(operator.is_, [p.grad for p in self._params], self._static_grads)):
            return
        grads = require_grads(self.optimizer)  # names a parameter that lost its gradient
        stale = [(s, g) for s, g in zip(self._static_grads, grads) if s is not g]
        if stale:
            torch._foreach_copy_([s for s, _ in stale], [g for _, g in stale])

    def __call__(self) -> None:
        if self.graph is not None:
            self._sync_grads()
            self.graph.replay()
            return
        grads = require_grads(self.optimizer)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if self.calls < self.warmup_steps:
                self.optimizer.step()  # eager warm-up: compiles kernels, allocates workspaces
            else:
                self._static_grads = grads
                # Blocks cached by the eager steps cannot serve the graph's private pool:
                # hand them back so capture does not need twice the step's workspace.
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=stream):
                    self.optimizer.step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.graph is not None:
            self.graph.replay()  # capture records only; this replay performs the step
        self.calls += 1
