"""The guard costs nothing when nothing is skipped: on the CPU (where reading a tensor's values on the
host is free) a step whose gradients are all finite runs no restoration and no per-block masking,
so its count of masking ops does not grow with the number of row blocks the masked path works
through (the masked path runs several per block); only a step that skips a matrix pays for its
restoration. Counted with a TorchDispatchMode."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dion3 import Dion3, Muon, NorMuon
from dion3.kernels import reference

GUARD_OPS = {"where", "masked_fill", "masked_fill_", "isfinite", "logical_not"}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))


def step_ops(cls, rows, nan=False, **options):
    """The ops of the second step of `cls` on four rows × 64 matrices (one bucket)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows, 64)) for _ in range(4)]
    optimizer = cls(params, lr=0.01, **options)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    if nan:
        params[1].grad[rows // 2, 3] = float("nan")
    with Ops() as ops:
        optimizer.step()
    return ops.count, int(optimizer.nonfinite_updates)


CASES = [(Dion3, dict(fraction=0.25)), (Muon, {}), (NorMuon, {})]


@pytest.mark.parametrize("cls, options", CASES, ids=["dion3", "muon", "normuon"])
def test_a_clean_step_does_no_guard_work_per_row_block(cls, options):
    short, _ = step_ops(cls, reference.BLOCK_ROWS, **options)  # one row block per matrix
    tall, _ = step_ops(cls, 8 * reference.BLOCK_ROWS, **options)  # eight
    guard = {op: (short[op], tall[op]) for op in GUARD_OPS}
    assert all(a == b for a, b in guard.values()), guard  # nothing per row block
    assert sum(short[op] for op in GUARD_OPS) <= 8, guard  # the verdict and the variance it keeps, per bucket


@pytest.mark.parametrize("cls, options", CASES, ids=["dion3", "muon", "normuon"])
def test_only_a_step_that_skips_pays_for_the_restoration(cls, options):
    clean, skipped_clean = step_ops(cls, 2 * reference.BLOCK_ROWS, **options)
    faulty, skipped = step_ops(cls, 2 * reference.BLOCK_ROWS, nan=True, **options)
    assert (skipped_clean, skipped) == (0, 1)
    assert sum(faulty[op] for op in GUARD_OPS) > sum(clean[op] for op in GUARD_OPS) + 4


def test_restoring_nothing_writes_nothing():
    momentum = torch.randn(3, 2 * reference.BLOCK_ROWS, 8)
    before = momentum.clone()
    with Ops() as ops:
        reference.restore_momentum_reference(momentum, [momentum.clone()], torch.ones(3, dtype=torch.bool), 0.9)
    assert torch.equal(momentum, before)
    assert not {"copy_", "where", "div", "sub"} & set(ops.count), ops.count
