"""Optimizer-level properties: Dion3 ⇔ NorMuon at f=1, row selection at f<1, checkpoints,
AdamW/Lion groups, errors, non-finite gradients, groups and skipped parameters."""
import copy
import io

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon
from reference import ReferenceOptimizer, selected_count

SHAPES = [(8, 24), (24, 8), (16, 16), (3, 6, 12), (6, 12)]  # (3,6,12) and (6,12) share a bucket


def make_params(shapes, dtype=torch.float32):
    return [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


# ---------------------------------------------------------------- Dion3 rules at optimizer level


def test_dion3_full_fraction_equals_normuon_without_nesterov():
    dion_params = make_params(SHAPES)
    nor_params = [p.detach().clone().requires_grad_() for p in dion_params]
    hyper = dict(lr=0.03, mu=0.9, muon_beta2=0.9, weight_decay=0.05)
    dion = Dion3(dion_params, fraction=1.0, stacked=True, **hyper)
    nor = NorMuon(nor_params, nesterov=False, stacked=True, **hyper)
    for _ in range(5):
        grads = [torch.randn(*s) for s in SHAPES]
        set_grads(dion_params, grads)
        set_grads(nor_params, grads)
        dion.step()
        nor.step()
        for a, b in zip(dion_params, nor_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            # Dion3 stores the error-fed-back momentum μ·U; NorMuon stores U itself
            torch.testing.assert_close(dion.state[a]["momentum"], 0.9 * nor.state[b]["momentum"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(dion.state[a]["variance"], nor.state[b]["variance"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_dion3_quarter_fraction_moves_only_top_rows(weight_decay):
    shapes, lr, mu, fraction = [(16, 12), (2, 12, 10)], 0.05, 0.8, 0.25
    params = make_params(shapes)
    opt = Dion3(params, lr=lr, mu=mu, fraction=fraction, weight_decay=weight_decay, stacked=True)
    momentum = [torch.zeros(*s, dtype=torch.float64) for s in shapes]  # independent float64 track
    decay = 1.0 - lr * weight_decay
    for _ in range(4):
        grads = [torch.randn(*s) for s in shapes]
        set_grads(params, grads)
        before = [p.detach().clone() for p in params]
        opt.step()
        for p, x0, m, g in zip(params, before, momentum, grads):
            m += g.double()
            matrices = zip(p.detach().reshape(-1, *p.shape[-2:]), x0.reshape(-1, *p.shape[-2:]), m.view(-1, *p.shape[-2:]))
            for x_new, x_old, m_mat in matrices:
                rows = x_new.shape[0]
                top = torch.argsort(m_mat.abs().sum(dim=1), descending=True)[: selected_count(rows, fraction)]
                rest = torch.ones(rows, dtype=torch.bool)
                rest[top] = False
                assert torch.equal(x_new[rest], x_old[rest] * decay)  # only weight decay
                moved = (x_new[top] - x_old[top] * decay).abs().amax(dim=1)
                assert (moved > 1e-4).all()  # every selected row got an update
                m_mat[top] *= mu  # error feedback on selected rows only
            torch.testing.assert_close(opt.state[p]["momentum"].double(), m, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- checkpoints and lr


def build_mixed(cls, options, seed=1):
    """A small 'model': matrices in the class's group, a bias in AdamW and an embedding in Lion."""
    g = torch.Generator().manual_seed(seed)
    matrices = [torch.randn(*s, generator=g).requires_grad_() for s in [(8, 24), (8, 24), (2, 24, 8)]]
    bias = torch.randn(8, generator=g).requires_grad_()
    embedding = torch.randn(10, 4, generator=g).requires_grad_()
    groups = [
        dict(params=matrices, stacked=True),
        dict(params=[bias], algorithm="adamw", lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
        dict(params=[embedding], algorithm="lion", lr=0.003, betas=(0.9, 0.99), weight_decay=0.1),
    ]
    params = [*matrices, bias, embedding]
    return params, cls(groups, **options)


def run_steps(params, opt, grads, scheduler=None):
    for step_grads in grads:
        set_grads(params, step_grads)
        opt.step()
        if scheduler is not None:
            scheduler.step()


CHECKPOINT_CASES = [
    (Dion3, dict(fraction=0.25)),
    (Dion3, dict(fraction=0.5, orthogonalizer="gram")),
    (Muon, dict(nesterov=True)),
    (NorMuon, dict()),
]


@pytest.mark.parametrize("cls, options", CHECKPOINT_CASES)
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_checkpoint_round_trip_is_exact(cls, options, tensor_lr):
    if tensor_lr:
        options = dict(options, lr=torch.tensor(0.02))
    schedule = lambda step: 0.5 ** (step // 2)  # noqa: E731
    params, _ = build_mixed(cls, options)
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]

    straight_params, straight = build_mixed(cls, copy.deepcopy(options))
    straight_sched = torch.optim.lr_scheduler.LambdaLR(straight, schedule)
    run_steps(straight_params, straight, grads, straight_sched)

    first_params, first = build_mixed(cls, copy.deepcopy(options))
    first_sched = torch.optim.lr_scheduler.LambdaLR(first, schedule)
    run_steps(first_params, first, grads[:3], first_sched)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first_params], "opt": first.state_dict(), "sched": first_sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    resumed_params, resumed = build_mixed(cls, copy.deepcopy(options), seed=2)  # fresh values, fresh state
    with torch.no_grad():
        for p, value in zip(resumed_params, saved["params"]):
            p.copy_(value)
    resumed_sched = torch.optim.lr_scheduler.LambdaLR(resumed, schedule)  # before loading: it resets lr
    resumed.load_state_dict(saved["opt"])
    resumed_sched.load_state_dict(saved["sched"])
    run_steps(resumed_params, resumed, grads[3:], resumed_sched)

    for a, b in zip(straight_params, resumed_params):
        assert torch.equal(a, b)
    for a, b in zip(straight_params, resumed_params):
        for key, value in straight.state[a].items():
            assert torch.equal(value, resumed.state[b][key]), key
    assert float(straight.param_groups[0]["lr"]) == pytest.approx(0.02 * 0.5**3 if tensor_lr else 0.01 * 0.5**3)


def test_scheduler_changes_the_step_size(exact_orthogonalizer):
    """lr as a 0-d tensor, driven by StepLR, gives the same steps as the float64 reference fed
    the same lr sequence (the scheduler's change takes effect)."""
    params = make_params([(8, 24), (12, 6)], dtype=torch.float64)
    opt = NorMuon(params, lr=torch.tensor(0.04), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref = ReferenceOptimizer(params, "normuon", lr=0.04, weight_decay=0.1)
    for step in range(3):
        grads = [torch.randn_like(p) for p in params]
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
        sched.step()
        ref.lr *= 0.5
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
        for p, expected in zip(params, ref.params):
            torch.testing.assert_close(p.detach(), expected, rtol=2e-6, atol=2e-7)


# ---------------------------------------------------------------- AdamW and Lion groups


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_adamw_group_matches_torch_adamw(tensor_lr):
    ours = [torch.randn(7, requires_grad=True), torch.randn(5, 3, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    settings = dict(lr=0.01, betas=(0.85, 0.98), weight_decay=0.2)
    lr = torch.tensor(0.01) if tensor_lr else 0.01
    opt = Muon([dict(params=ours, algorithm="adamw", epsilon=1e-6, **dict(settings, lr=lr))])
    torch_opt = torch.optim.AdamW(theirs, eps=1e-6, foreach=False, **settings)
    for _ in range(6):
        grads = [torch.randn_like(p) for p in ours]
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        torch_opt.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("beta2", [0.95, 0.999])
def test_adamw_bias_corrections_keep_float64_updates_exact(beta2):
    """Float64 parameters: each AdamW update matches torch's (bias corrections in Python floats) to
    1e-6 relative, though the step count is a float32 tensor: the fused kernel takes 1 − β₂ᵗ in the
    parameter's precision. (In float32, 1 − pow(β₂, t) is off by 6.7e-6 relative at β₂ = 0.999, as
    in torch.optim.AdamW(fused=True).)"""
    torch.manual_seed(0)
    ours = [torch.randn(64, dtype=torch.float64, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    settings = dict(lr=0.01, betas=(0.9, beta2), weight_decay=0.0)
    opt = Muon([dict(params=ours, algorithm="adamw", epsilon=1e-12, **settings)])
    torch_opt = torch.optim.AdamW(theirs, eps=1e-12, foreach=False, **settings)
    for _ in range(20):
        before = ours[0].detach().clone()
        grads = [torch.randn_like(p) for p in ours]
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        torch_opt.step()
        torch.testing.assert_close(ours[0].detach() - before, theirs[0].detach() - before, rtol=1e-6, atol=0)
        theirs[0].data.copy_(ours[0].detach())  # compare each step's update, not accumulated drift


def test_lion_group_matches_hand_written_lion():
    lr, (beta1, beta2), wd = 0.01, (0.9, 0.99), 0.3
    p = torch.randn(4, 6, requires_grad=True)
    x, m = p.detach().double().clone(), torch.zeros(4, 6, dtype=torch.float64)
    opt = Dion3([dict(params=[p], algorithm="lion", lr=lr, betas=(beta1, beta2), weight_decay=wd)])
    for _ in range(5):
        g = torch.randn(4, 6)
        p.grad = g.clone()
        opt.step()
        g = g.double()
        x = x * (1 - lr * wd) - lr * torch.sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
        torch.testing.assert_close(p.detach().double(), x, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg"].double(), m, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- errors

MATRIX = torch.zeros(4, 6)


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: Dion3([("norm.weight", torch.zeros(6))]), "norm.weight"),
        (lambda: Muon([("conv.weight", torch.zeros(4, 3, 2, 2))]), "conv.weight"),
        (lambda: NorMuon([torch.zeros(6)]), "1-D"),
        (lambda: Dion3([MATRIX], fraction=0.0), "fraction"),
        (lambda: Dion3([MATRIX], fraction=1.5), "fraction"),
        (lambda: Dion3([dict(params=[MATRIX], algorithm="adam")]), "algorithm"),
        (lambda: Muon([MATRIX], ns_coefficients="keller"), "ns_coefficients"),
        (lambda: Muon([MATRIX], lr=-0.1), "lr"),
        (lambda: NorMuon([MATRIX], mu=-0.5), "mu"),
        (lambda: Dion3([dict(params=[("w", MATRIX)]), dict(params=[("w_again", MATRIX)], algorithm="adamw")]), "w_again"),
    ],
)
def test_bad_input_raises_value_error_naming_it(build, fragment):
    with pytest.raises(ValueError, match=fragment):
        build()


def test_flatten_accepts_conv_weights(exact_orthogonalizer):
    conv = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    opt = Muon([conv], flatten=True, lr=0.1, weight_decay=0.0)
    ref = ReferenceOptimizer([conv.detach().reshape(4, 12)], "muon", lr=0.1)
    grad = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    conv.grad = grad.clone()
    opt.step()
    ref.step([grad.reshape(4, 12)])
    torch.testing.assert_close(conv.detach().reshape(4, 12), ref.params[0], rtol=1e-10, atol=1e-12)


def test_flatten_still_updates_a_contiguous_conv_weight_in_place():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
    before = weight.detach().clone()
    optimizer = Muon([weight], flatten=True, lr=0.1, weight_decay=0.0)
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    assert (weight - before).abs().max() > 1e-3


# ---------------------------------------------------------------- non-finite gradients

ISOLATION = [(Dion3, "auto"), (Dion3, "newton_schulz"), (Muon, "gram"), (NorMuon, "auto")]


@pytest.mark.parametrize("cls, method", ISOLATION)
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_gradient_stays_in_its_matrix(cls, method, bad_value):
    """Same bucket (one batched call): a NaN/Inf gradient in matrix 1 leaves every other
    parameter and its state bit-identical to a run where matrix 1 had a finite gradient."""
    shapes = [(6, 16), (6, 16), (2, 6, 16)]
    start = make_params(shapes)
    grads = [[torch.randn(*s) for s in shapes] for _ in range(3)]
    runs = []
    for poison in (False, True):
        params = [p.detach().clone().requires_grad_() for p in start]
        opt = cls(params, orthogonalizer=method, lr=0.05, stacked=True)
        for step, step_grads in enumerate(grads):
            step_grads = [g.clone() for g in step_grads]
            if poison and step == 1:
                step_grads[1][2, 3] = bad_value
            set_grads(params, step_grads)
            opt.step()
        runs.append((params, opt))
    (clean, clean_opt), (dirty, dirty_opt) = runs
    for i in (0, 2):
        assert torch.equal(clean[i], dirty[i])
        for key, value in clean_opt.state[clean[i]].items():
            assert torch.equal(value, dirty_opt.state[dirty[i]][key]), key


def test_check_finite_raises_naming_the_parameter_and_changes_nothing():
    named = [("layers.0.attn", torch.randn(6, 8, requires_grad=True)), ("layers.1.mlp", torch.randn(6, 8, requires_grad=True))]
    # two groups of two: finding the group of the bad parameter must not compare tensors
    scalars = [("head.bias", torch.randn(6, requires_grad=True)), ("head.scale", torch.randn(6, requires_grad=True))]
    opt = Dion3([dict(params=scalars, algorithm="adamw"), dict(params=named)], check_finite=True)
    params = [p for _, p in scalars + named]
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy({i: opt.state[p] for i, p in enumerate(params)})
    named[1][1].grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="layers.1.mlp"):
        opt.step()
    for i, p in enumerate(params):
        assert torch.equal(p, before[i])
        for key, value in state_before[i].items():
            assert torch.equal(opt.state[p][key], value)


# ---------------------------------------------------------------- groups, alias, skipped params


def test_groups_override_hyperparameters(exact_orthogonalizer):
    specs = [
        (dict(algorithm="dion3", lr=0.1, fraction=0.5), [(8, 24)]),
        (dict(algorithm="nordion2", lr=0.02, fraction=0.25, mu=0.5), [(24, 8)]),
        (dict(algorithm="muon", lr=0.03, nesterov=True, adjust_lr="rms_norm"), [(12, 12)]),
        (dict(algorithm="normuon", lr=0.01, muon_beta2=0.5, adjust_lr=None, weight_decay=0.2), [(2, 6, 10)]),
    ]
    groups, refs, group_params = [], [], []
    for options, shapes in specs:
        params = make_params(shapes, dtype=torch.float64)
        groups.append(dict(params=params, **options))
        ref_options = dict(options)
        algorithm = {"nordion2": "dion3"}.get(ref_options.pop("algorithm"), options["algorithm"])
        ref_options.setdefault("weight_decay", 0.01)  # the optimizer's default
        refs.append(ReferenceOptimizer(params, algorithm, **ref_options))
        group_params.append(params)
    opt = Dion3(groups, stacked=True)
    assert opt.param_groups[1]["algorithm"] == "dion3"  # alias resolved
    for _ in range(3):
        for params, ref in zip(group_params, refs):
            grads = [torch.randn_like(p) for p in params]
            set_grads(params, grads)
            ref.step(grads)
        opt.step()
        for params, ref in zip(group_params, refs):
            for p, expected in zip(params, ref.params):
                torch.testing.assert_close(p.detach(), expected, rtol=2e-6, atol=2e-7)


def test_l2_row_score_selects_by_each_rows_l2_norm(exact_orthogonalizer):
    # rows built so that L1 and L2 disagree: a row of many small entries against one of a few large
    # ones; the step must follow the float64 reference ranking by L2 norms, and differ from L1's
    shapes = [(8, 16), (2, 8, 16)]
    params = make_params(shapes, dtype=torch.float64)
    twin = [p.detach().clone().requires_grad_() for p in params]
    hyper = dict(lr=0.05, mu=0.8, fraction=0.125, weight_decay=0.01)  # one row of 8
    opt, l1 = Dion3(params, row_score="l2", stacked=True, **hyper), Dion3(twin, stacked=True, **hyper)
    ref = ReferenceOptimizer(params, "dion3", row_score="l2", **hyper)
    generator = torch.Generator().manual_seed(3)
    for step in range(3):
        grads = [torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes]
        for g in grads:  # per matrix: row 0 spread (L1 48, L2 12), row 1 peaked (L1 40, L2 28.3)
            m = g.view(-1, *g.shape[-2:])
            m[:, 0] = 3.0
            m[:, 1] = 0.0
            m[:, 1, :2] = 20.0
        set_grads(params, grads)
        set_grads(twin, grads)
        ref.step(grads)
        opt.step()
        l1.step()
        for p, expected in zip(params, ref.params):
            torch.testing.assert_close(p.detach(), expected, rtol=2e-6, atol=2e-7)
        if step == 0:  # the peaked row, on every matrix
            assert all(chosen.tolist() == [1] for per_param in ref.selected for chosen in per_param)
    assert not all(torch.equal(a, b) for a, b in zip(params, twin))  # L1 ranks row 0 first: another trajectory
    assert exact_orthogonalizer["count"] > 0


def newton_schulz_reference(steps, norm_scale):
    """Standard Newton–Schulz written out here from a schedule's constants, in float64, for the
    reference's orthogonalizer ([1, rows, cols] in, same out): X/(norm_scale·‖X‖_F + 1e-7), wide
    orientation, X ← aX + (bA + cA²)X with A = XXᵀ per (a, b, c)."""
    def orthogonalize(u):
        x = u[0].double()
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / (norm_scale * x.norm() + 1e-7)
        for a, b, c in steps:
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return (x.T if tall else x)[None]
    return orthogonalize


@pytest.mark.parametrize("cls, algorithm", [(Dion3, "dion3"), (NorMuon, "normuon"), (Muon, "muon")])
@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
def test_a_four_step_schedule_reaches_the_step_by_name(cls, algorithm, method):
    """ns_coefficients="polar_express_4" through the optimizer: one step on float64 parameters
    (orthogonalized in float64) matches the float64 reference orthogonalizing with 4 NS steps of
    the schedule's constants, and differs from the default 5-step step."""
    from dion3.ortho import SCHEDULES

    schedule = SCHEDULES["polar_express_4"]
    shapes = [(8, 24), (24, 8), (16, 16)]
    params = make_params(shapes, dtype=torch.float64)
    default = [p.detach().clone().requires_grad_() for p in params]
    hyper = dict(lr=0.05, mu=0.9, weight_decay=0.01, **({"fraction": 0.5} if algorithm == "dion3" else {}))
    opt = cls(params, ns_coefficients="polar_express_4", orthogonalizer=method, **hyper)
    five = cls(default, orthogonalizer=method, **hyper)
    ref = ReferenceOptimizer(params, algorithm, orthogonalizer=newton_schulz_reference(schedule.steps, schedule.norm_scale),
                             **hyper)
    grads = [torch.randn(*s, dtype=torch.float64) for s in shapes]
    set_grads(params, grads)
    set_grads(default, grads)
    ref.step(grads)
    opt.step()
    five.step()
    for p, expected, other in zip(params, ref.params, default):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-12)
        assert (p - other).abs().max() > 1e-4  # 4 steps are not the default 5
    assert opt.param_groups[0]["ns_coefficients"] == "polar_express_4"


@pytest.mark.parametrize("cls", [Dion3, Muon, NorMuon])
def test_parameters_without_grad_are_skipped(cls):
    """b has no gradient in a bucket shared with a and c: b and its state stay untouched
    (not even weight decay), and a and c step exactly as in a twin optimizer holding only them."""
    a, b, c = make_params([(6, 16)] * 3)
    opt = cls([a, b, c], lr=0.05)
    set_grads([a, b, c], [torch.randn(6, 16) for _ in range(3)])
    opt.step()  # every parameter now has non-trivial state
    a2, c2 = a.detach().clone().requires_grad_(), c.detach().clone().requires_grad_()
    twin = cls([a2, c2], lr=0.05)
    for src, dst in ((a, a2), (c, c2)):
        for key, value in opt.state[src].items():
            twin.state[dst][key].copy_(value)
    b_before = b.detach().clone()
    b_state = {key: value.clone() for key, value in opt.state[b].items()}
    for _ in range(2):
        ga, gc = torch.randn(6, 16), torch.randn(6, 16)
        set_grads([a, b, c], [ga, None, gc])
        set_grads([a2, c2], [ga, gc])
        opt.step()
        twin.step()
    assert torch.equal(a, a2) and torch.equal(c, c2)
    assert torch.equal(b, b_before)
    for key, value in b_state.items():
        assert torch.equal(opt.state[b][key], value)
