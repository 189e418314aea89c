"""Run a whole optimizer step as one captured CUDA graph (DESIGN §6).

    step = CapturedStep(optimizer, warmup_steps=3)
    for batch in data:
        loss(batch).backward()
        step()                      # eager for the first warm-up calls, then graph replays
        optimizer.zero_grad(set_to_none=False)

What capture needs, and how it is provided here:
- no host syncs in the step: the rules use fixed k (selection changes only indices) and
  never call .item(); `check_finite=True` syncs and is refused;
- fixed shapes: k = max(1, ⌈f·rows⌉) sets the shapes, so a fraction that changes between
  steps (dion3.FractionScheduler, or a group value set by hand) gets one graph per distinct
  set of k, captured after `warmup_steps` eager steps with that k (selection_key);
- lr and weight decay as device scalars: each group's `lr` and `weight_decay` become 0-d
  tensors on the parameters' device, so torch.optim.lr_scheduler updates them in place
  (schedulers call `fill_` on tensor learning rates) and the graph reads the new values;
- fixed .grad buffers: the graph reads the gradient tensors seen at capture. If a later
  backward produced new gradient tensors (zero_grad(set_to_none=True)), they are copied into
  the captured buffers first, so correctness never depends on the caller's zero_grad mode.
"""
from __future__ import annotations

import operator
from collections import OrderedDict

import torch
from torch import Tensor

from .. import rules
from ..distributed import is_dtensor
from .base import OrthogonalOptimizer
from .validation import SELECTING_ALGORITHMS, check_fractions, param_label


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


def _label(optimizer: torch.optim.Optimizer, group_index: int, i: int, with_group: bool = True) -> str:
    group = optimizer.param_groups[group_index]
    return param_label(group.get("param_names"), group_index if with_group else None, i, group["params"][i])


def require_grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients of every parameter, or a clear error naming one that has none."""
    grads = []
    for group_index, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                raise RuntimeError(
                    f"cannot run a captured optimizer step: parameter {_label(optimizer, group_index, i)} has "
                    "no gradient. A CUDA graph replays a fixed set of gradient buffers; give every parameter a "
                    "gradient (or move parameters that are not trained into no optimizer group)"
                )
            grads.append(p.grad)
    return grads


def _same_layout(a: Tensor, b: Tensor) -> bool:
    if not is_dtensor(a) and not is_dtensor(b):
        return True
    return is_dtensor(a) and is_dtensor(b) and a.device_mesh == b.device_mesh and a.placements == b.placements


def _layout(t: Tensor) -> str:
    return f"{tuple(t.placements)} on {t.device_mesh}" if is_dtensor(t) else "a plain tensor"


def _shard(t: Tensor) -> Tensor:
    # a gradient's local shard without DTensor.to_local(), an autograd function (~50 µs a call:
    # too slow for a replay's host time, ≤ 0.2 ms for the whole step)
    return t._local_tensor if is_dtensor(t) else t


def copy_grads(optimizer: torch.optim.Optimizer, buffers: list[Tensor], grads: list[Tensor]) -> None:
    """Copy each gradient into its buffer (one per parameter, in stepped_params order) where the
    two differ. DTensor gradients (FSDP2 and TP give each backward new ones unless zero_grad keeps
    them) are copied shard to shard, which needs the same mesh and placements."""
    stale = [(n, b, g) for n, (b, g) in enumerate(zip(buffers, grads)) if b is not g]
    if not stale:
        return
    for n, buffer, grad in stale:
        if not _same_layout(buffer, grad):
            where = [(gi, i) for gi, group in enumerate(optimizer.param_groups) for i in range(len(group["params"]))][n]
            raise RuntimeError(
                f"cannot run a captured optimizer step: the gradient of parameter {_label(optimizer, *where)} is laid "
                f"out as {_layout(grad)}, but the captured step reads a gradient buffer laid out as {_layout(buffer)}"
            )
    torch._foreach_copy_([_shard(b) for _, b, _ in stale], [_shard(g) for _, _, g in stale])


def selection_key(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """The k of every Dion3/Dion2 bucket: all a captured step's shapes depend on among the group
    values that may change between steps (lr and weight decay are device scalars). Sharded
    buckets (row-sharded and general layouts, blocks of fused weights too) select from the rows
    each rank holds, at most `chunk` of them, so their k is ⌈f·chunk⌉ (local scope; global scope
    is refused): a k of the whole matrix may stay the same while that one changes."""
    key = []
    for group, buckets in zip(optimizer.param_groups, getattr(optimizer, "_buckets", ())):
        if group.get("algorithm") not in SELECTING_ALGORITHMS:
            continue
        for bucket in buckets:
            rows = getattr(bucket, "chunk", bucket.shape[0])
            key.append(rules.selected_row_count(rows, group["fraction"]))
    return tuple(key)


class CapturedStep:
    """Call to run one optimizer step. Each distinct selection (the k of every Dion3 bucket,
    which a fraction schedule changes) runs `warmup_steps` eager steps, is then captured into
    a CUDA graph once, and is replayed from then on.

    max_graphs: graphs kept at once; capturing another one drops the least recently used (so
    a schedule that passes through many k keeps only the latest graphs). All graphs share one
    memory pool: their workspaces overlap, since only one step runs at a time, so the memory
    is about that of the largest graph, not the sum. A k seen fewer than warmup_steps + 1
    times (a schedule that changes k every step) always runs eagerly.
    """

    def __init__(self, optimizer: OrthogonalOptimizer, warmup_steps: int = 3, max_graphs: int = 4):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"CapturedStep needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be ≥ 1 (kernels are compiled before capture), got {warmup_steps}")
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be an integer ≥ 1, got {max_graphs!r}")
        if getattr(optimizer, "check_finite", False):
            raise ValueError("check_finite=True syncs with the host each step and cannot be captured; disable it")
        distributed = getattr(optimizer, "_is_distributed", lambda: False)()
        for index, group in enumerate(optimizer.param_groups if distributed else ()):
            if group.get("algorithm") in SELECTING_ALGORITHMS and group.get("selection_scope") == "global" \
                    and group["params"]:
                raise ValueError(
                    f"parameter group {index} ({group['algorithm']!r}, parameter {_label(optimizer, index, 0, False)} and "
                    f"{len(group['params']) - 1} more) has selection_scope='global', which exchanges split sizes "
                    "through the host each step and cannot be captured in a CUDA graph; use "
                    "selection_scope='local' for a captured distributed step"
                )
        params = stepped_params(optimizer)
        devices = {p.device for p in params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"CapturedStep needs all parameters on one CUDA device, got {sorted(map(str, devices))}")
        device = next(iter(devices))
        self._start(optimizer, warmup_steps, max_graphs, device)
        self._stream = torch.cuda.Stream(device)
        self._pool = None  # the graphs' shared memory pool, from the first capture
        to_device_scalars(optimizer, device)

    def _start(self, optimizer, warmup_steps: int, max_graphs: int, device: torch.device) -> None:
        """The bookkeeping state (no device work)."""
        self.optimizer = optimizer
        self._params = stepped_params(optimizer)
        self.warmup_steps = warmup_steps
        self.max_graphs = max_graphs
        self.device = device
        self.calls = 0
        self.captures = 0  # graphs captured so far (a dropped k captured again counts again)
        self.graph = None  # the graph the last call replayed; None when it ran eagerly
        self.graphs: OrderedDict[tuple, object] = OrderedDict()  # selection key → graph, least recent first
        self.eager_calls: dict[tuple, int] = {}  # selection key → eager steps run with it
        self._static_grads: list[Tensor] = []
        self._fractions = None  # the Dion3 fractions that _key was computed from
        self._key: tuple = ()

    def _selection_key(self) -> tuple:
        # Recomputed only when a fraction changed: a replay's host time matters (≤ 0.2 ms).
        fractions = [g["fraction"] for g in self.optimizer.param_groups if g.get("algorithm") in SELECTING_ALGORITHMS]
        if fractions != self._fractions:
            check_fractions(self.optimizer.param_groups)
            self._key, self._fractions = selection_key(self.optimizer), fractions
        return self._key

    def _sync_grads(self) -> None:
        """Copy gradients that live in new tensors into the buffers the graphs read."""
        # Host time per replay matters (≤ 0.2 ms): the usual case, every .grad still the
        # captured buffer, is one identity check per parameter (half of require_grads' time).
        if all(map(operator.is_, [p.grad for p in self._params], self._static_grads)):
            return
        # require_grads names a parameter that lost its gradient
        copy_grads(self.optimizer, self._static_grads, require_grads(self.optimizer))

    def __call__(self) -> None:
        key = self._selection_key()
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            self._sync_grads()
        elif self.eager_calls.get(key, 0) < self.warmup_steps:
            require_grads(self.optimizer)
            self._eager_step()  # compiles kernels and fills caches for this k
            self.eager_calls[key] = self.eager_calls.get(key, 0) + 1
            self.graph = None
            self.calls += 1
            return
        else:
            graph = self._capture(key)
        self._replay(graph)  # after a capture, which records only, this replay performs the step
        self.graph = graph
        self.calls += 1

    def _capture(self, key: tuple):
        grads = require_grads(self.optimizer)
        if not self._static_grads:
            self._static_grads = grads
        else:  # every graph reads the same gradient buffers
            self._sync_grads()
            for p, static in zip(self._params, self._static_grads):
                p.grad = static
        graph = self._record()
        self.graphs[key] = graph
        self.captures += 1
        # Dropped only now: a graph alive during the capture keeps the shared pool alive (a
        # pool whose last graph is gone cannot be captured into again).
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)  # the least recently used k
        return graph

    def release(self) -> None:
        """Drop every captured graph and their memory pool; the next calls warm up and capture
        again. Call it before dist.destroy_process_group() when the step captured collectives:
        NCCL's teardown waits while graphs holding its kernels are alive (PyTorch issue
        #115388), so a script that ends with the graphs still referenced hangs there."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay may still be running
        self.graphs.clear()
        self.graph = None
        self._pool = None
        self.eager_calls.clear()

    # ------------------------------------------------------------ device work
    def _eager_step(self) -> None:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.optimizer.step()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _record(self):
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Blocks cached by the eager steps cannot serve the graphs' private pool: hand them
        # back so capture does not need twice the step's workspace.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self.optimizer.step()
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    def _replay(self, graph) -> None:
        graph.replay()
