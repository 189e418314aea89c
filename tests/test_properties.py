"""Property tests (hypothesis) of the DESIGN §2 invariants over shapes, fractions and dtypes.

Shapes run from one row to a few hundred, square, wide and tall, 2-D matrices and 3-D batches;
fractions anywhere in (0, 1]; float32, bfloat16 and float16 parameters. For every example:
no crash and no NaN, and, checked against float64 math written here (not the library's):
  - k = max(1, ⌈f·rows⌉) rows are selected, and they are the top-k rows by L1 norm of M + G;
  - error feedback: selected momentum rows become μ·(M + G), unselected rows keep M + G;
  - only selected rows of X move beyond weight decay: unselected rows are exactly (1 − ηλ)·X;
  - Dion3 with f = 1 takes the same steps as NorMuon without Nesterov.
"""
from __future__ import annotations

import math
from fractions import Fraction

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dion3 import Dion3, Muon, NorMuon
from dion3.rules import selected_row_count

PROPERTY_SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# relative precision used to tell μ·A from A and to compare scores that rounding may reorder
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
MU = 0.8  # far enough from 1 that μ·A and A differ clearly even in bfloat16


@st.composite
def matrix_shapes(draw):
    """(batch or None, rows, cols): square, wide or tall, from a single row to a few hundred."""
    kind = draw(st.sampled_from(["square", "wide", "tall", "any"]))
    rows = draw(st.integers(1, 300))
    if kind == "square":
        cols = min(rows, 160)
        rows = cols
    elif kind == "wide":
        rows = min(rows, 64)
        cols = draw(st.integers(rows, 4 * rows + 8))
    elif kind == "tall":
        cols = draw(st.integers(1, max(1, min(rows, 64))))
    else:
        cols = draw(st.integers(1, 160))
    batch = draw(st.one_of(st.none(), st.integers(1, 3)))
    return batch, rows, cols


fractions = st.one_of(
    st.integers(1, 1000).map(lambda n: n / 1000),
    st.integers(1, 64).map(lambda q: 1 / q),
    st.just(1.0),
)


def reference_k(rows: int, fraction: float) -> int:
    exact = Fraction(fraction).limit_denominator(1000)  # the decimal or 1/q the user wrote
    return max(1, math.ceil(exact * rows))


@given(rows=st.integers(1, 5000), fraction=fractions)
@settings(max_examples=200, deadline=None)
def test_selected_row_count_is_the_ceiling_of_f_rows(rows, fraction):
    assert selected_row_count(rows, fraction) == reference_k(rows, fraction)


def as_matrices(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def check_dion3_step(before_x, after_x, before_m, after_m, grad, fraction, decay, dtype):
    """Check one Dion3 step, matrix by matrix, against float64 math on the recorded tensors."""
    tol = RELATIVE_TOLERANCE[dtype]
    rows = before_x.shape[-2]
    k = reference_k(rows, fraction)
    accumulated = as_matrices(before_m.double() + grad.double())
    # rounding bound of M + G in the parameter dtype: eps·(|M| + |G|) per entry (cancellation-safe)
    # (plus a few subnormal spacings for float16's tiny values)
    info = torch.finfo(dtype)
    slack = as_matrices(before_m.double().abs() + grad.double().abs()) * 4 * tol + 4 * info.tiny * info.eps
    new_m = as_matrices(after_m.double())
    old_x, new_x = as_matrices(before_x.double()), as_matrices(after_x.double())
    for a, err, m, x0, x1 in zip(accumulated, slack, new_m, old_x, new_x):
        feedback = ((m - MU * a).abs() <= err).all(dim=-1)  # selected: μ·(M+G)
        kept = ((m - a).abs() <= err).all(dim=-1)  # unselected: M+G
        assert bool((feedback | kept).all()), "each momentum row is either μ·(M+G) or M+G"
        sure, ambiguous = feedback & ~kept, feedback & kept  # ambiguous: M+G ≈ 0 within rounding
        assert int(sure.sum()) <= k <= int(sure.sum() + ambiguous.sum()), (int(sure.sum()), int(ambiguous.sum()), k)
        selected, unselected = sure, kept & ~feedback
        scores, score_slack = a.abs().sum(dim=-1), err.sum(dim=-1)
        if selected.any() and unselected.any():  # top-k by L1 norm, up to rounding of M + G
            assert (scores[selected] + score_slack[selected]).min() >= (scores[unselected] - score_slack[unselected]).max()
        selected = ~unselected
        # unselected rows: weight decay only, one rounding to the parameter dtype
        expected = (x0[~selected] * decay).to(dtype).double()
        ulp = torch.finfo(dtype).eps * expected.abs()
        assert bool(((x1[~selected] - expected).abs() <= ulp).all()), "an unselected row moved"


@given(
    shape=matrix_shapes(),
    fraction=fractions,
    dtype=st.sampled_from(DTYPES),
    orthogonalizer=st.sampled_from(["auto", "gram", "newton_schulz"]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    grad_scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
@PROPERTY_SETTINGS
def test_dion3_invariants(shape, fraction, dtype, orthogonalizer, weight_decay, grad_scale, seed):
    batch, rows, cols = shape
    full_shape = (rows, cols) if batch is None else (batch, rows, cols)
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(full_shape, generator=gen).to(dtype))
    lr = 0.05
    opt = Dion3([param], lr=lr, fraction=fraction, mu=MU, weight_decay=weight_decay, orthogonalizer=orthogonalizer,
                stacked=True)  # a batch: a stack of matrices
    for _ in range(3):
        grad = (torch.randn(full_shape, generator=gen) * grad_scale).to(dtype)
        before_x = param.detach().clone()
        before_m = opt.state[param]["momentum"].clone()
        param.grad = grad
        opt.step()
        assert torch.isfinite(param).all()
        for value in opt.state[param].values():
            assert torch.isfinite(value).all()
        assert opt.state[param]["variance"].dtype == torch.float32
        check_dion3_step(before_x, param.detach(), before_m, opt.state[param]["momentum"], grad, fraction,
                         1.0 - lr * weight_decay, dtype)


@given(shape=matrix_shapes(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
@PROPERTY_SETTINGS
def test_dion3_with_fraction_one_is_normuon_without_nesterov(shape, dtype, seed):
    batch, rows, cols = shape
    full_shape = (rows, cols) if batch is None else (batch, rows, cols)
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(full_shape, generator=gen).to(dtype)
    dion3_param, normuon_param = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    options = dict(lr=0.2, mu=0.9, muon_beta2=0.95, weight_decay=0.01)
    dion3 = Dion3([dion3_param], fraction=1.0, stacked=True, **options)
    normuon = NorMuon([normuon_param], nesterov=False, stacked=True, **options)
    decay = 1.0 - options["lr"] * options["weight_decay"]
    for _ in range(3):
        grad = torch.randn(full_shape, generator=gen).to(dtype)
        dion3_param.grad, normuon_param.grad = grad.clone(), grad.clone()
        before = normuon_param.detach().double().clone()
        dion3.step()
        normuon.step()
        # same math, rounded in different places: Dion3 subtracts its selected rows' change once
        # rounded (index_add_), NorMuon's whole-matrix update fuses it into the parameter's rounding;
        # so at most one rounding of the parameter and one of its change apart (lr is large)
        after = normuon_param.detach().double()
        change = (decay * before - after).abs()
        tolerance = torch.finfo(dtype).eps * (after.abs() + change)
        assert bool(((dion3_param.detach().double() - after).abs() <= tolerance).all())
        with torch.no_grad():  # the next step from the same weights: roundings do not add up over steps
            dion3_param.copy_(normuon_param)
        torch.testing.assert_close(dion3.state[dion3_param]["variance"], normuon.state[normuon_param]["variance"])


@given(
    shape=matrix_shapes(),
    algorithm=st.sampled_from(["muon", "normuon", "dion3"]),
    dtype=st.sampled_from(DTYPES),
    gradient=st.sampled_from(["random", "zero", "rank-one", "one-row"]),
    seed=st.integers(0, 2**16),
)
@PROPERTY_SETTINGS
def test_every_algorithm_stays_finite_on_degenerate_gradients(shape, algorithm, dtype, gradient, seed):
    batch, rows, cols = shape
    full_shape = (rows, cols) if batch is None else (batch, rows, cols)
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(full_shape, generator=gen).to(dtype))
    factory = {"muon": Muon, "normuon": NorMuon, "dion3": Dion3}[algorithm]
    opt = factory([param], lr=0.02, weight_decay=0.0, stacked=True)
    grad = torch.randn(full_shape, generator=gen)
    if gradient == "zero":
        grad.zero_()
    elif gradient == "rank-one":
        grad = torch.randn(*full_shape[:-1], 1, generator=gen) * torch.randn(*full_shape[:-2], 1, cols, generator=gen)
    elif gradient == "one-row":
        keep = torch.zeros(rows, 1)
        keep[torch.randint(0, rows, (1,), generator=gen)] = 1.0
        grad = grad * keep
    before = param.detach().clone()
    for _ in range(2):
        param.grad = grad.to(dtype)
        opt.step()
        assert torch.isfinite(param).all()
        assert all(torch.isfinite(v).all() for v in opt.state[param].values())
    if gradient == "zero":  # no weight decay and nothing to follow: nothing moves
        assert torch.equal(param.detach(), before)
