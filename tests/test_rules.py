"""Each update rule of DESIGN §2 against the float64 reference in tests/reference.py.

Two levels: the pure functions of dion3.rules on stacked tensors, and whole optimizer steps
(several steps, several shapes) where both sides use the exact float64 polar factor, so any
difference is a rule difference and the tolerance can be tight.
"""

import math

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon, rules
from reference import ReferenceOptimizer, exact_polar, normuon_normalize, selected_count

# ---------------------------------------------------------------- pure rule functions


@pytest.mark.parametrize(
    "adjust_lr, rows, cols, expected",
    [
        ("spectral_norm", 64, 16, 2.0),
        ("spectral_norm", 16, 64, 0.5),
        ("rms_norm", 64, 16, 1.6),
        ("rms_norm", 25, 100, 2.0),
        (None, 64, 16, 1.0),
    ],
)
def test_lr_scale_hand_computed(adjust_lr, rows, cols, expected):
    assert rules.lr_scale(adjust_lr, rows, cols) == pytest.approx(expected, rel=1e-12)


def test_lr_scale_rejects_unknown_name():
    with pytest.raises(ValueError, match="adjust_lr"):
        rules.lr_scale("spectral", 4, 4)


@pytest.mark.parametrize("rows", [1, 3, 10, 17, 64, 100])
@pytest.mark.parametrize("fraction", [1e-3, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0])
def test_selected_row_count(rows, fraction):
    assert rules.selected_row_count(rows, fraction) == selected_count(rows, fraction)


def test_selected_row_count_hand_cases():
    assert rules.selected_row_count(10, 0.3) == 3  # 0.3·10 is 3.0000000000000004 in floats
    assert rules.selected_row_count(10, 0.25) == 3
    assert rules.selected_row_count(8, 0.25) == 2
    assert rules.selected_row_count(5, 0.01) == 1


@pytest.mark.parametrize("nesterov", [False, True])
def test_pre_step_muon_momentum(nesterov):
    mu = 0.9
    momentum = torch.randn(3, 5, 7, dtype=torch.float64)
    grads = torch.randn(3, 5, 7, dtype=torch.float64)
    expected_m = mu * momentum + grads
    expected_u = mu * expected_m + grads if nesterov else expected_m
    cfg = rules.RuleConfig(fraction=None, mu=mu, nesterov=nesterov)
    # grads given as per-parameter pieces, the way the optimizer passes them
    update, rows, norm, _ = rules.pre_step(momentum, [grads[:1], grads[1:]], cfg, want_norm=True)
    assert rows is None
    torch.testing.assert_close(momentum, expected_m, rtol=1e-14, atol=0)
    torch.testing.assert_close(update, expected_u, rtol=1e-14, atol=0)
    if nesterov:  # U = μM + G is never seen by the momentum pass: no norm
        assert norm is None
    else:  # the Frobenius norm of each matrix of U, from the pass's row squares
        torch.testing.assert_close(norm, expected_u.square().sum(dim=(1, 2), keepdim=True).sqrt(), rtol=1e-13, atol=0)


@pytest.mark.parametrize("scores, k, expected", [
    ([1.0, 3.0, 3.0, 0.0, 3.0], 2, [1, 2]),  # three rows tie for the top: the two lowest
    ([1.0, 3.0, 3.0, 0.0, 3.0], 4, [0, 1, 2, 4]),
    ([0.0] * 6, 3, [0, 1, 2]),  # all-zero rows (no gradient yet): the first k
    ([2.0, 0.5, 2.0, 2.0, 7.0, 0.5], 3, [0, 2, 4]),
    ([5.0, 4.0, 3.0], 3, [0, 1, 2]),
    ([1.0, float("inf"), float("nan"), -0.0, 0.0], 2, [1, 2]),  # NaN counts as +inf
    ([1.0, float("inf"), float("nan"), -0.0, 0.0], 4, [0, 1, 2, 3]),  # −0 ties with +0
])
def test_top_rows_breaks_ties_toward_the_lower_row(scores, k, expected):
    """Hand-picked ties: the rule every path shares (the CUDA kernel, the stable-sort reference,
    each distributed layout), so tied rows never make two layouts pick differently."""
    for dtype in (torch.float32, torch.float64):  # one topk over keys, or a stable sort
        rows = rules.top_rows(torch.tensor([scores, scores[::-1]], dtype=dtype), k)
        assert rows.dtype == torch.int64 and rows[0].tolist() == expected
        # reversed scores: the same rule from the other end (ties again to the lower row)
        key = [math.inf if math.isnan(v) else abs(v) for v in scores[::-1]]
        assert rows[1].tolist() == sorted(sorted(range(len(key)), key=lambda i: (-key[i], i))[:k])


def test_pre_step_dion3_selection_and_error_feedback():
    mu, fraction = 0.8, 0.25
    momentum = torch.randn(4, 12, 6, dtype=torch.float64)
    grads = torch.randn(4, 12, 6, dtype=torch.float64)
    summed = momentum + grads
    k = selected_count(12, fraction)
    cfg = rules.RuleConfig(fraction=fraction, mu=mu)
    update, rows, norm, _ = rules.pre_step(momentum, grads, cfg, want_norm=True)
    assert rows.shape == (4, k)
    for b in range(4):
        scores = summed[b].abs().sum(dim=1)
        expected_rows = torch.argsort(scores, descending=True)[:k].sort().values
        assert torch.equal(rows[b].sort().values, expected_rows)
        # U is the snapshot M[S] before error feedback, in the order of `rows`
        torch.testing.assert_close(update[b], summed[b][rows[b]], rtol=1e-14, atol=0)
        # ‖U‖_F of the selected rows only, before their decay
        torch.testing.assert_close(norm[b, 0, 0], summed[b][expected_rows].norm(), rtol=1e-13, atol=0)
        unselected = torch.ones(12, dtype=torch.bool)
        unselected[expected_rows] = False
        torch.testing.assert_close(momentum[b][expected_rows], mu * summed[b][expected_rows], rtol=1e-14, atol=0)
        torch.testing.assert_close(momentum[b][unselected], summed[b][unselected], rtol=1e-14, atol=0)


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
def test_pre_step_scaled_snapshot_is_newton_schulz_input(method):
    """With scaling, Dion3's snapshot writes U / (norm_scale·‖U‖_F + ε) (what orthogonalize
    would make of U) and marks it normalized; the momentum changes exactly as without it, and
    orthogonalizing the normalized snapshot gives the same O as orthogonalizing U."""
    from dion3.ortho import input_scaling

    mu, fraction = 0.8, 0.25
    momentum = torch.randn(3, 16, 10, dtype=torch.float64)
    grads = torch.randn(3, 16, 10, dtype=torch.float64)
    plain_m = momentum.clone()
    cfg = rules.RuleConfig(fraction=fraction, mu=mu)
    u, rows, _, normalized = rules.pre_step(plain_m, grads, cfg)
    assert not normalized
    scaling = input_scaling(4, 10, "cpu", method, "polar_express", torch.float64)
    assert scaling.norm_scale == 1.02 and scaling.dtype == torch.float64
    x, rows_scaled, norm, normalized = rules.pre_step(momentum, grads, cfg, scaling=scaling)
    assert normalized and torch.equal(rows_scaled, rows)
    torch.testing.assert_close(momentum, plain_m, rtol=0, atol=0)
    expected = u / (1.02 * u.square().sum(dim=(1, 2), keepdim=True).sqrt() + 1e-7)
    torch.testing.assert_close(x, expected, rtol=1e-13, atol=0)
    from_snapshot = rules.orthogonalize_rows(x, method, "polar_express", normalized=True)
    from_u = rules.orthogonalize_rows(u, method, "polar_express")
    torch.testing.assert_close(from_snapshot, from_u, rtol=1e-12, atol=1e-12)


def test_tall_normalized_snapshot_matches_orthogonalizing_u():
    """A tall selection (k > cols): the normalized snapshot is transposed inside orthogonalize."""
    from dion3.ortho import input_scaling

    momentum = torch.randn(2, 40, 8, dtype=torch.float64)
    grads = torch.randn(2, 40, 8, dtype=torch.float64)
    cfg = rules.RuleConfig(fraction=0.5, mu=0.9)
    u, rows, _, _ = rules.pre_step(momentum.clone(), grads, cfg)
    scaling = input_scaling(20, 8, "cpu", "newton_schulz", "polar_express", torch.float64)
    x, _, _, normalized = rules.pre_step(momentum, grads, cfg, scaling=scaling)
    assert normalized and x.shape == (2, 20, 8)
    got = rules.orthogonalize_rows(x, "newton_schulz", "polar_express", normalized=True)
    assert got.is_contiguous()
    torch.testing.assert_close(got, rules.orthogonalize_rows(u, "newton_schulz", "polar_express"), rtol=1e-12, atol=1e-12)


def test_pre_step_dion3_respects_given_rows():
    momentum = torch.randn(2, 6, 4, dtype=torch.float64)
    grads = torch.randn(2, 6, 4, dtype=torch.float64)
    summed = momentum + grads
    given = torch.tensor([[0, 5], [2, 3]])
    update, rows, norm, _ = rules.pre_step(momentum, grads, rules.RuleConfig(fraction=0.25, mu=0.5), rows=given)
    assert torch.equal(rows, given) and norm is None  # not asked for
    torch.testing.assert_close(update, torch.stack([summed[0][[0, 5]], summed[1][[2, 3]]]), rtol=0, atol=0)


def test_normalize_rows_against_reference():
    ortho = exact_polar(torch.randn(3, 6, 10, dtype=torch.float64)) * torch.rand(3, 6, 1, dtype=torch.float64)
    variance = torch.rand(3, 6, 1, dtype=torch.float64) * 0.1
    before = (ortho.clone(), variance.clone())
    got, new_v = rules.normalize_rows(ortho, variance, beta2=0.9, epsilon=1e-8)
    for b in range(3):
        exp, exp_v = normuon_normalize(ortho[b], variance[b], 0.9, 1e-8)
        torch.testing.assert_close(got[b].double(), exp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new_v[b].double(), exp_v, rtol=1e-5, atol=1e-9)
        # Frobenius norm is preserved and the rows are no longer equal-norm-scaled copies of O
        assert got[b].norm().item() == pytest.approx(ortho[b].norm().item(), rel=1e-5)
    assert torch.equal(ortho, before[0]) and torch.equal(variance, before[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_normalization_factors_reproduce_reference(dtype):
    ortho = (exact_polar(torch.randn(3, 6, 10, dtype=torch.float64)) * torch.rand(3, 6, 1, dtype=torch.float64)).to(dtype)
    variance = torch.rand(3, 6, 1, dtype=torch.float32) * 0.1
    before = (ortho.clone(), variance.clone())
    row_scale, new_v = rules.row_normalization(ortho, variance, beta2=0.9, epsilon=1e-8)
    assert row_scale.shape == (3, 6, 1) and row_scale.dtype == torch.promote_types(dtype, torch.float32)
    assert new_v.dtype == variance.dtype
    for b in range(3):
        # the reference sees the same (rounded) O, in float64
        exp, exp_v = normuon_normalize(ortho[b].double(), variance[b].double(), 0.9, 1e-8)
        torch.testing.assert_close(row_scale[b].double() * ortho[b].double(), exp, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new_v[b].double(), exp_v, rtol=1e-5, atol=1e-9)
    assert torch.equal(ortho, before[0]) and torch.equal(variance, before[1])


def test_normalize_rows_of_zero_is_zero():
    got, new_v = rules.normalize_rows(torch.zeros(2, 3, 4), torch.zeros(2, 3, 1), 0.95, 1e-8)
    assert torch.equal(got, torch.zeros(2, 3, 4)) and torch.equal(new_v, torch.zeros(2, 3, 1))


@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("lr_as_tensor", [False, True])
@pytest.mark.parametrize("with_row_scale", [False, True])
def test_apply_update_decays_every_entry(with_rows, lr_as_tensor, with_row_scale):
    lr, wd, scale = 0.1, 0.5, 2.0
    params = [torch.randn(1, 6, 4, dtype=torch.float64), torch.randn(2, 6, 4, dtype=torch.float64)]
    before = torch.cat([p.clone() for p in params])
    rows = torch.tensor([[1, 4], [0, 2], [3, 5]]) if with_rows else None
    k = 2 if with_rows else 6
    update = torch.randn(3, k, 4, dtype=torch.float64)
    factors = torch.rand(3, k, 1, dtype=torch.float64) + 0.5 if with_row_scale else None
    lr_arg = torch.tensor(lr, dtype=torch.float64) if lr_as_tensor else lr
    rules.apply_update(params, update, rows, lr_arg, wd, scale, row_scale=factors)
    expected = before * (1 - lr * wd)
    for b in range(3):
        chosen = rows[b] if with_rows else torch.arange(6)
        expected[b][chosen] -= lr * scale * update[b] * (factors[b] if with_row_scale else 1.0)
    torch.testing.assert_close(torch.cat(params), expected, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- whole optimizer steps


@pytest.mark.parametrize("cls", [NorMuon, Dion3])
def test_single_device_step_writes_no_normalized_copy(exact_orthogonalizer, monkeypatch, cls):
    """The normalization reaches the parameters as per-row factors of the fused update: the
    single-device step never materializes the scaled O (one memory pass fewer)."""
    def no_scaled_copy(*args, **kwargs):
        raise AssertionError("the single-device step wrote a normalized copy of O")

    monkeypatch.setattr(rules, "scale_cast", no_scaled_copy)
    p = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    hyper = dict(lr=0.05, mu=0.9, weight_decay=0.1, muon_beta2=0.8, adjust_lr="spectral_norm")
    opt = cls([p], **hyper)
    ref = ReferenceOptimizer([p], "normuon" if cls is NorMuon else "dion3", **hyper)
    grad = torch.randn(12, 8, dtype=torch.float64)
    p.grad = grad.clone()
    opt.step()
    ref.step([grad])
    torch.testing.assert_close(p.detach(), ref.params[0], rtol=2e-6, atol=2e-7)


SHAPES = [(8, 24), (24, 8), (16, 16), (3, 6, 12)]  # wide, tall, square, 3-D batch of matrices
CASES = [
    (Muon, dict(algorithm="muon", nesterov=False)),
    (Muon, dict(algorithm="muon", nesterov=True)),
    (NorMuon, dict(algorithm="normuon", nesterov=False)),
    (NorMuon, dict(algorithm="normuon", nesterov=True)),
    (Dion3, dict(algorithm="dion3", fraction=0.25)),
    (Dion3, dict(algorithm="dion3", fraction=0.5)),
    (Dion3, dict(algorithm="dion3", fraction=1.0)),
]


def _run_against_reference(cls, options, hyper, shapes, steps=4):
    """Same params and grads into the optimizer (float64 params) and the reference."""
    params = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]
    algorithm = options.pop("algorithm")
    opt = cls(params, **options, **hyper, stacked=True)  # 3-D shapes: stacks of matrices
    ref = ReferenceOptimizer(params, algorithm, **options, **hyper)
    for _ in range(steps):
        grads = [torch.randn(*s, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
        for p, expected in zip(params, ref.params):
            torch.testing.assert_close(p.detach(), expected, rtol=2e-6, atol=2e-7)
        for p, m in zip(params, ref.momentum):
            torch.testing.assert_close(opt.state[p]["momentum"], m, rtol=1e-12, atol=1e-12)
        if algorithm in ("normuon", "dion3"):  # the rules with a variance
            for p, v in zip(params, ref.variance):
                torch.testing.assert_close(opt.state[p]["variance"].double(), v, rtol=1e-5, atol=1e-9)
    return params, opt, ref


@pytest.mark.parametrize(
    "cls, options", CASES, ids=["muon", "muon-nesterov", "normuon", "normuon-nesterov", "dion3-f0.25", "dion3-f0.5", "dion3-f1"]
)
def test_optimizer_matches_reference(exact_orthogonalizer, cls, options):
    hyper = dict(lr=0.05, mu=0.9, weight_decay=0.1)
    if options["algorithm"] != "muon":
        hyper["muon_beta2"] = 0.8
    _run_against_reference(cls, dict(options), hyper, SHAPES)


@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", None])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_lr_adjustment_uses_full_shape(exact_orthogonalizer, adjust_lr, fraction):
    # with f < 1 the orthogonalized block is k×cols, but the lr multiplier must use rows×cols
    hyper = dict(lr=0.02, weight_decay=0.0, adjust_lr=adjust_lr)
    _run_against_reference(Dion3, dict(algorithm="dion3", fraction=fraction), hyper, [(32, 8), (8, 32)], steps=2)


# ---------------------------------------------------------------- Dion3's unselected rows' decay (opt-in)


def _dion2(params, **options):
    return Dion3([{"params": params, "algorithm": "dion2"}], **options)


@pytest.mark.parametrize("cls, algorithm, fraction", [
    (Dion3, "dion3", 0.25), (Dion3, "dion3", 0.5), (Dion3, "dion3", 1.0), (_dion2, "dion2", 0.25)])
def test_unselected_decay_matches_reference(exact_orthogonalizer, cls, algorithm, fraction):
    """M[~S] ← d·M[~S] after the selection, on wide, tall, square and stacked matrices, several
    steps (the decayed rows compete in the next selection): weights, momentum and variance as
    the float64 reference. At f = 1 nothing is unselected: NorMuon's steps."""
    hyper = dict(lr=0.05, mu=0.9, weight_decay=0.1, muon_beta2=0.8)
    _run_against_reference(cls, dict(algorithm=algorithm, fraction=fraction, unselected_decay=0.7), hyper, SHAPES)


def test_unselected_decay_per_block_matches_reference(exact_orthogonalizer):
    """Equal heads (folded into the batch) and uneven blocks (stacked from parameter-shaped
    state each step): every block decays its own unselected rows."""
    hyper = dict(lr=0.05, mu=0.9, weight_decay=0.1, muon_beta2=0.8, fraction=0.25, unselected_decay=0.6)
    params = [torch.randn(12, 8, dtype=torch.float64, requires_grad=True),
              torch.randn(10, 6, dtype=torch.float64, requires_grad=True)]
    opt = Dion3([{"params": [params[0]], "num_heads": 3}, {"params": [params[1]], "split_sizes": (6, 4)}], **hyper)
    ref = ReferenceOptimizer(params, "dion3", blocks=[[4, 4, 4], [6, 4]], **hyper)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
    for p, expected, m in zip(params, ref.params, ref.momentum):
        torch.testing.assert_close(p.detach(), expected, rtol=2e-6, atol=2e-7)
        torch.testing.assert_close(opt.state[p]["momentum"], m, rtol=1e-12, atol=1e-12)


def test_unselected_decay_of_one_is_the_rule_exactly(monkeypatch):
    """unselected_decay=1 (the default) takes today's steps bit for bit, and spends no pass on
    the momentum for it."""
    import dion3.matrix_step as matrix_step

    def no_pass(*args, **kwargs):
        raise AssertionError("unselected_decay=1 ran the decay pass")

    monkeypatch.setattr(matrix_step, "decay_unselected", no_pass)
    for dtype, momentum_dtype in ((torch.float64, None), (torch.float32, "bfloat16")):
        shapes = [(12, 8), (8, 12), (3, 6, 10)]
        params = [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]
        twins = [p.detach().clone().requires_grad_() for p in params]
        hyper = dict(lr=0.05, mu=0.8, fraction=0.25, stacked=True, momentum_dtype=momentum_dtype)
        opt, explicit = Dion3(params, **hyper), Dion3(twins, unselected_decay=1.0, **hyper)
        assert opt.param_groups[0]["unselected_decay"] == 1.0
        for _ in range(3):
            for p, q in zip(params, twins):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            opt.step()
            explicit.step()
        for p, q in zip(params, twins):
            assert torch.equal(p, q)
            assert all(torch.equal(opt.state[p][key], explicit.state[q][key]) for key in ("momentum", "variance"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unselected_decay_by_hand(dtype):
    """One 4 × 3 matrix, f = ½ (k = 2), μ = ½, d = ¾, numbers exact in binary. Step 1 from M = 0:
    L1 scores of G₁ are 1, 3, 4, 1, rows 1 and 2 are selected and get μ·G₁; rows 0 and 3 get
    d·G₁. Step 2: M + G₂ scores 4.75, 2.5, 3, 2.75, rows 0 and 2 are selected and get
    μ·(M + G₂), rows 1 and 3 get d·(M + G₂). Only the selected rows move beyond weight decay."""
    w = torch.nn.Parameter(torch.randn(4, 3, dtype=dtype))
    opt = Dion3([w], lr=0.1, mu=0.5, fraction=0.5, weight_decay=0.0, unselected_decay=0.75)
    g1 = [[1, 0, 0], [0, 3, 0], [2, 2, 0], [0, 0, -1]]
    g2 = [[4, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, -2]]
    after = [
        [[0.75, 0, 0], [0, 1.5, 0], [1, 1, 0], [0, 0, -0.75]],
        [[2.375, 0, 0], [0, 1.125, 0.75], [0.5, 1, 0], [0, 0, -2.0625]],
    ]
    moving = [[1, 2], [0, 2]]
    for grad, want, selected in zip((g1, g2), after, moving):
        before = w.detach().clone()
        w.grad = torch.tensor(grad, dtype=dtype)
        opt.step()
        assert torch.equal(opt.state[w]["momentum"], torch.tensor(want, dtype=dtype))
        moved = (w.detach() != before).any(dim=1).nonzero().flatten().tolist()
        assert moved == selected


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
def test_weight_decay_without_gradient_signal(method):
    """A zero gradient (real orthogonalizer): nothing but decoupled weight decay, on every
    entry, for every rule; no NaN in parameters or state."""
    for cls in (Muon, NorMuon, Dion3):
        p = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
        start = p.detach().clone()
        opt = cls([p], lr=0.1, weight_decay=0.3, orthogonalizer=method)
        for _ in range(2):
            p.grad = torch.zeros_like(p)
            opt.step()
        torch.testing.assert_close(p.detach(), start * (1 - 0.1 * 0.3) ** 2, rtol=1e-12, atol=0)
        assert all(torch.isfinite(t).all() for t in opt.state[p].values())


def test_default_orthogonalizer_is_wired_through():
    """With the real Newton–Schulz (no patching) the optimizer applies exactly
    dion3.orthogonalize with the group's method and coefficients (reference math in float64)."""
    from dion3 import orthogonalize

    for method, coefficients in [("newton_schulz", "jordan"), ("gram", "you"), ("auto", "polar_express")]:
        def orth(u, method=method, coefficients=coefficients):
            return orthogonalize(u.float(), method, coefficients).double()

        params = [torch.randn(8, 24, requires_grad=True), torch.randn(2, 24, 8, requires_grad=True)]
        opt = NorMuon(params, lr=0.05, weight_decay=0.1, orthogonalizer=method, ns_coefficients=coefficients,
                      stacked=True)
        ref = ReferenceOptimizer(params, "normuon", lr=0.05, weight_decay=0.1, orthogonalizer=orth)
        for _ in range(3):
            grads = [torch.randn_like(p) for p in params]
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            ref.step(grads)
        for p, expected in zip(params, ref.params):
            torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-5)
