"""Optimizer memory: state bytes per parameter and peak extra memory during a step (docs/memory.md).

State is counted over the distinct storages behind optimizer.state (the per-parameter entries
are views into stacked bucket buffers, so hidden copies would show up as extra storages).
Peak extra memory is measured with a dispatch mode that sees every ATen op of the step and
counts the bytes of each newly allocated output storage until it is freed (kernel-internal
scratch, e.g. BLAS workspaces, is invisible to it).
"""
from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dion3 import Dion3, Muon, NorMuon

FP32 = 4


class AllocationTracker(TorchDispatchMode):
    """Live and peak bytes of tensors created by the ops run under it."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in inputs:  # in-place ops and views alias an input
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._release, storage.nbytes())
        return out


def state_storage_bytes(opt) -> int:
    storages = {}
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def matrix_state_bytes(shape, dtype, algorithm) -> int:
    """The documented formula: momentum in the parameter dtype + one float32 value per row."""
    element = torch.tensor([], dtype=dtype).element_size()
    rows = math.prod(shape[:-1])  # a 3-D batch has batch·rows rows
    momentum = math.prod(shape) * element
    return momentum if algorithm == "muon" else momentum + rows * FP32


@pytest.mark.parametrize("algorithm, factory", [("dion3", Dion3), ("normuon", NorMuon), ("muon", Muon)])
def test_state_bytes_match_the_formula(algorithm, factory):
    shapes = [((64, 32), torch.float32), ((64, 32), torch.float32), ((3, 16, 48), torch.bfloat16), ((40, 8), torch.float16)]
    params = [torch.nn.Parameter(torch.randn(s).to(d)) for s, d in shapes]
    bias = torch.nn.Parameter(torch.randn(32))
    opt = factory([{"params": params, "stacked": True}, {"params": [bias], "algorithm": "adamw"}])
    expected = sum(matrix_state_bytes(s, d, algorithm) for s, d in shapes)
    expected += 2 * bias.numel() * FP32 + FP32  # AdamW: two moments and a float32 step counter
    assert state_storage_bytes(opt) == expected
    for (shape, dtype), p in zip(shapes, params):  # per parameter: the same formula
        entries = opt.state[p].values()
        assert sum(v.numel() * v.element_size() for v in entries) == matrix_state_bytes(shape, dtype, algorithm)


def peak_step_bytes(factory, shape, count, dtype, **options) -> int:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for _ in range(count)]
    opt = factory(params, stacked=True, **options)  # a 3-D shape is a stack of matrices
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # anything created lazily on the first step is not step memory
    for p in params:
        p.grad = torch.randn_like(p)
    tracker = AllocationTracker()
    with tracker:
        opt.step()
    assert tracker.live == 0, "a step must not keep new allocations alive"
    return tracker.peak


CASES = [((512, 256), 0.25), ((256, 512), 0.25), ((256, 256), 0.5), ((2, 128, 96), 0.25), ((300, 40), 1 / 3), ((64, 64), 1.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, fraction", CASES, ids=[f"{s}-f{f:.2f}" for s, f in CASES])
def test_dion3_peak_step_memory_is_bounded_by_the_selected_rows(shape, fraction, dtype):
    count = 3
    rows, cols = shape[-2], shape[-1]
    matrices = count * math.prod(shape[:-2])
    k = max(1, math.ceil(fraction * rows))
    peak = peak_step_bytes(Dion3, shape, count, dtype, fraction=fraction)
    # documented bound: 7 float32 copies of the selected rows + per-row vectors + small constants
    bound = 7 * matrices * k * cols * FP32 + 16 * matrices * rows * FP32 + 4096
    assert peak <= bound, (peak, bound)


def test_dion3_peak_memory_shrinks_with_the_fraction(monkeypatch):
    """At one compute dtype: float32 Newton–Schulz on both sides (on a CPU whose bf16 products are
    fast, NorMuon's 256-row matrices would run in bf16 and Dion3's 128 selected rows too, but its
    float32 snapshot work would not shrink with them; the bound above runs the default)."""
    from dion3.ortho import precision

    monkeypatch.setattr(precision, "_override", torch.float32)
    shape, count = (512, 256), 3
    full = peak_step_bytes(NorMuon, shape, count, torch.float32)
    quarter = peak_step_bytes(Dion3, shape, count, torch.float32, fraction=0.25)
    assert quarter <= 0.35 * full, (quarter, full)
    # NorMuon itself: a few float32 copies of the whole bucket, no more
    assert full <= 7 * count * math.prod(shape) * FP32
