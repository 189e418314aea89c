"""CPU stand-ins for CUDA graph capture, shared by the tests of CapturedStep's bookkeeping (one
process and spawned gloo workers). Not a test module (no test_ prefix).

What a captured region may not do, checked on CPU: read a device value on the host (.item(),
.tolist(), bool(tensor), .cpu(), data-dependent shapes: nonzero, boolean indexing, masked_select,
unique, repeat_interleave without output_size) or copy a host list to the device (torch.tensor);
each raises RuntimeError("host sync: ...") inside `captured_region`, where the reference kernels
also take the sync-free path a GPU takes (their CPU-only host checks are off). And a graph replays the
collectives it recorded: `captured_region` lists every c10d collective the step launches with its
tensor shapes and split sizes, and a RecordedGraph checks that each replay launches the same ones
(data-dependent split sizes would differ between steps).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dion3.kernels import reference as reference_kernels
from dion3.optim.graph import CapturedStep, selection_key, to_device_scalars

_REFUSED_METHODS = ("tolist", "item", "nonzero", "__bool__", "cpu")
_REFUSED_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique",
                "aten._unique2", "aten.unique_consecutive", "aten.unique_dim"}


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"host sync: {what}")
    return refuse


class _Watch(TorchDispatchMode):
    """Refuses the aten ops that sync with the host; records every c10d collective."""

    def __init__(self, launched: list):
        super().__init__()
        self.launched = launched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in _REFUSED_OPS:
            raise RuntimeError(f"host sync: {func}")
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            raise RuntimeError(f"host sync: {func} without output_size")
        if name in ("aten.index", "aten.index_put", "aten.index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise RuntimeError(f"host sync: {func} with a boolean index")
        if name.startswith("c10d."):
            self.launched.append((name, tuple(_signature(a) for a in args)))
        return func(*args, **kwargs)


def _signature(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return type(value).__name__  # process groups, reduce ops: the same objects every step


@contextlib.contextmanager
def captured_region():
    """Run code as inside a CUDA graph capture (on CPU): host syncs raise; yields the list that
    collects the collectives launched."""
    launched: list = []
    saved = {name: getattr(torch.Tensor, name) for name in _REFUSED_METHODS}
    saved_tensor, saved_checks = torch.tensor, reference_kernels.HOST_CHECKS
    for name in _REFUSED_METHODS:
        setattr(torch.Tensor, name, _refuse(f"Tensor.{name}"))
    torch.tensor = _refuse("torch.tensor (a host-to-device copy)")
    reference_kernels.HOST_CHECKS = False  # as on a GPU: the guard's sync-free path
    try:
        with _Watch(launched):
            yield launched
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        torch.tensor, reference_kernels.HOST_CHECKS = saved_tensor, saved_checks


class RecordedGraph:
    """Stands in for a CUDA graph on the CPU: replaying runs the step eagerly inside
    captured_region, after checking that the selection is the one it was captured with (a real
    graph's shapes are fixed), and checks that it launches the collectives of its first replay
    (a real graph replays the ones it recorded, with their split sizes)."""

    def __init__(self, owner, key):
        self.owner, self.key, self.replays = owner, key, 0
        self.collectives = None

    def replay(self):
        assert selection_key(self.owner.optimizer) == self.key, "a graph replayed for another k"
        self.replays += 1
        # a graph reads the gradient buffers it was captured with, whatever .grad is now
        params, current = self.owner._params, [p.grad for p in self.owner._params]
        for p, static in zip(params, self.owner._static_grads):
            p.grad = static
        with captured_region() as launched:
            self.owner.optimizer.step()
        for p, grad in zip(params, current):
            p.grad = grad
        if self.collectives is None:
            self.collectives = launched
        assert launched == self.collectives, (
            f"replay {self.replays} of the graph for k={self.key} launched other collectives than its capture")


class CPUCapturedStep(CapturedStep):
    """CapturedStep's own bookkeeping with the device work replaced (its constructor needs CUDA);
    `log` lists (kind, selection key) of every call: eager, capture, replay."""

    def __init__(self, optimizer, warmup_steps, max_graphs=4):
        to_device_scalars(optimizer, torch.device("cpu"))
        self._start(optimizer, warmup_steps, max_graphs, torch.device("cpu"))
        self.log = []

    def _eager_step(self):
        self.log.append(("eager", self._key))
        self.optimizer.step()

    def _record(self):
        self.log.append(("capture", self._key))
        return RecordedGraph(self, self._key)

    def _replay(self, graph):
        self.log.append(("replay", graph.key))
        graph.replay()
