"""The guard against bad updates: a matrix whose orthogonalized update is not finite, or larger
than any orthogonalization can be (rules.update_bound), is skipped (its parameter only decays,
its per-row variance stays) and counted in `optimizer.nonfinite_updates`, without a host sync;
the other matrices of its bucket step as if nothing happened. Faults are forced two ways: an
orthogonalization that returns inf/NaN or a huge finite entry for one matrix (what a
half-precision overflow or a corrupted product would do) and a gradient with a NaN entry."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon, orthogonalize, rules

sys.path.insert(0, str(Path(__file__).parent))
from graph_standin import CPUCapturedStep  # noqa: E402
from reference import altered_orthogonalizer  # noqa: E402

LR, DECAY = 0.05, 0.1
# dion3-decay: Dion3 with unselected_decay, whose decay of the unselected rows a skip undoes too
KINDS = {"muon": Muon, "normuon": NorMuon, "dion3": Dion3, "dion3-decay": Dion3}


def _params(seed=0, count=3, shape=(12, 8)):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for _ in range(count)]


def _grads(step, count=3, shape=(12, 8)):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*shape, generator=generator) for _ in range(count)]


def _optimizer(kind, params):
    options = dict(lr=LR, weight_decay=DECAY)
    if kind.startswith("dion3"):
        options["fraction"] = 0.5
    if kind == "dion3-decay":
        options["unselected_decay"] = 0.8
    return KINDS[kind](params, **options)


@pytest.fixture
def broken_matrix(monkeypatch):
    """Make every orthogonalization return `value` in one entry of matrix `index` of its batch."""
    fault = {}

    def change(out):
        if fault:
            out[fault["index"], 0, 0] = fault["value"]
        return out

    monkeypatch.setattr(rules, "orthogonalize_padded", altered_orthogonalizer(change))
    return fault


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e3])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bad_update_is_skipped_and_counted(kind, value, broken_matrix):
    clean, faulty = _params(), _params()
    reference, guarded = _optimizer(kind, clean), _optimizer(kind, faulty)
    for step in range(3):  # two clean steps build up momentum and variance first
        before = [p.detach().clone() for p in faulty]
        variance = [guarded.state[p].get("variance", torch.zeros(1)).clone() for p in faulty]
        momentum = [guarded.state[p]["momentum"].clone() for p in faulty]
        for p, q, g in zip(clean, faulty, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        reference.step()
        if step == 2:
            broken_matrix.update(index=1, value=value)
        guarded.step()
    # matrix 1: only decayed, by hand; variance as before; the others exactly as without the fault
    torch.testing.assert_close(faulty[1].detach(), before[1] * (1 - LR * DECAY), rtol=0, atol=1e-7)
    if kind != "muon":
        assert torch.equal(guarded.state[faulty[1]]["variance"], variance[1])
    # its momentum put back (the step's accumulation and error feedback, the unselected rows' decay included)
    torch.testing.assert_close(guarded.state[faulty[1]]["momentum"], momentum[1], rtol=1e-6, atol=1e-6)
    for i in (0, 2):
        assert torch.equal(faulty[i].detach(), clean[i].detach())
    assert int(guarded.nonfinite_updates) == 1 and int(reference.nonfinite_updates) == 0
    assert all(torch.isfinite(p).all() for p in faulty)


def _state(optimizer, p) -> dict:
    return {key: value.clone() for key, value in optimizer.state[p].items()}


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_nan_gradient_costs_one_step_of_its_matrix(kind, captured):
    """A NaN in one entry of one matrix's gradient at step 2 of 4: that matrix skips that step as a
    whole (its weights only decay; its momentum, error feedback and variance come back as before
    the step), counted once with its step number, and trains again at the next step; the other
    matrices step as in a run without the NaN, and nothing holds a NaN afterwards. Captured: the
    same through CPUCapturedStep, where host syncs raise."""
    clean, faulty = _params(), _params()
    reference, guarded = _optimizer(kind, clean), _optimizer(kind, faulty)
    step_fn = CPUCapturedStep(guarded, warmup_steps=1) if captured else guarded.step
    for step in range(4):
        grads = _grads(step)
        before, state_before = faulty[2].detach().clone(), _state(guarded, faulty[2])
        for p, q, g in zip(clean, faulty, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 1:
            faulty[2].grad[3, 4] = float("nan")
            clean[2].grad = None  # the clean run leaves that matrix out of this step
        reference.step()
        step_fn()
        if step == 1:
            torch.testing.assert_close(faulty[2].detach(), before * (1 - LR * DECAY), rtol=0, atol=1e-7)
            after = _state(guarded, faulty[2])
            for key, value in state_before.items():
                torch.testing.assert_close(after[key], value, rtol=1e-6, atol=1e-7)
        if step == 2:  # trained again: moved beyond its decay
            assert float((faulty[2].detach() - before * (1 - LR * DECAY)).abs().max()) > 1e-3
    assert int(guarded.nonfinite_updates) == 1 and int(guarded.last_nonfinite_step) == 2
    assert int(reference.nonfinite_updates) == 0
    tolerance = dict(rtol=1e-6, atol=1e-7) if captured else dict(rtol=0, atol=0)  # lr as a device scalar
    for i in (0, 1):
        torch.testing.assert_close(faulty[i].detach(), clean[i].detach(), **tolerance)
    # matrix 2 differs from the clean run only by the decay it took at step 2
    assert all(torch.isfinite(p).all() for p in faulty)
    assert all(torch.isfinite(t).all() for p in faulty for t in guarded.state[p].values())


def test_the_guard_runs_inside_a_captured_step(broken_matrix):
    """CPUCapturedStep replays the step where host syncs raise: the guard needs none, and its
    counter is a tensor updated in place (what a CUDA graph replays)."""
    clean, faulty = _params(), _params()
    reference, guarded = _optimizer("dion3", clean), _optimizer("dion3", faulty)
    captured = CPUCapturedStep(guarded, warmup_steps=1)
    counter = guarded.nonfinite_updates
    for step in range(4):
        before = faulty[0].detach().clone()
        for p, q, g in zip(clean, faulty, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        reference.step()
        if step == 3:
            broken_matrix.update(index=0, value=float("nan"))
        captured()
    assert [kind for kind, _ in captured.log] == ["eager", "capture", "replay", "replay", "replay"]
    torch.testing.assert_close(faulty[0].detach(), before * (1 - LR * DECAY), rtol=0, atol=1e-7)
    for i in (1, 2):  # lr as a device scalar rounds lr·scale apart from the float lr: not bitwise
        torch.testing.assert_close(faulty[i].detach(), clean[i].detach(), rtol=1e-6, atol=1e-7)
    assert guarded.nonfinite_updates is counter and int(counter) == 1


@pytest.mark.parametrize("coefficients", ["polar_express", "jordan", "you"])
@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
def test_no_orthogonalization_is_above_the_bound(coefficients, method):
    """The bound never skips a real update: orthogonalizations of orthogonal, rank-one,
    low-rank, ill-conditioned and random inputs, wide and tall, in float32, bfloat16 (standard NS
    on CPU may compute in bf16) and float16 (Gram NS on a GPU) all stay within it, with room to
    spare. 1024 × 384 is the gate/up shape of the study's llama-384, with the spectrum of its early
    momentum where the skipped updates were recorded (about 290 of 384 singular values below 1e-3
    of the largest). At that shape half precision runs in the dtype the method computes in on a GPU
    (bf16 standard NS, fp16 Gram NS) for the early, the ill-conditioned and the random inputs: a
    CPU without native half products takes seconds for each, and the small shapes cover every
    spectrum in both half dtypes."""
    generator = torch.Generator().manual_seed(3)
    bound = rules.update_bound(coefficients)
    gpu_half = torch.bfloat16 if method == "newton_schulz" else torch.float16
    worst = 0.0
    for rows, cols in ((16, 48), (48, 16), (32, 32), (7, 90), (1024, 384)):
        n = min(rows, cols)
        u = torch.linalg.qr(torch.randn(rows, rows, generator=generator))[0][:, :n]
        v = torch.linalg.qr(torch.randn(cols, cols, generator=generator))[0][:, :n]
        early = torch.cat([torch.logspace(0, -2, n // 4), torch.full((n - n // 4,), 1e-4)])
        spectra = [torch.ones(n), torch.eye(1, n)[0], (torch.arange(n) < 3).double().float(),
                   torch.logspace(0, -7, n), early, torch.rand(n, generator=generator)]
        inputs = [(u * s) @ v.T for s in spectra] + [torch.randn(rows, cols, generator=generator)]
        large = rows * cols > 100_000
        for index, x in enumerate(inputs):
            half_too = not large or index in (3, 4, 6)  # ill-conditioned, early momentum, random
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                if dtype != torch.float32 and not half_too or large and dtype not in (torch.float32, gpu_half):
                    continue
                out = orthogonalize(x.unsqueeze(0), method, coefficients, dtype=dtype, out_dtype=torch.float32)
                norm = float(torch.linalg.vector_norm(out))
                worst = max(worst, norm / n ** 0.5)
                assert bool(rules.matrices_within(torch.tensor([norm]), out.shape, bound))
    assert worst <= 0.9 * bound  # the margin is real, not a near miss


def test_owner_functions_mark_a_matrix_above_the_bound():
    """Where a distributed owner holds whole matrices: Muon's poison and NorMuon/Dion3's
    normalization turn a matrix above the bound (finite) into NaN rows, keep its variance, and
    leave the others untouched; without a bound only finiteness counts."""
    generator = torch.Generator().manual_seed(4)
    ortho = orthogonalize(torch.randn(3, 6, 10, generator=generator), "newton_schulz", dtype=torch.float32)
    ortho[1] *= 4.0  # ‖O‖_F = 4·√6 > 1.5·√6
    bound = rules.update_bound("polar_express")
    poisoned = rules.poison_nonfinite(ortho.clone(), bound)
    assert torch.isnan(poisoned[1]).all() and torch.equal(poisoned[[0, 2]], ortho[[0, 2]])
    assert torch.equal(rules.poison_nonfinite(ortho.clone()), ortho)  # no bound: finite is enough
    variance = torch.rand(3, 6, 1, generator=generator)
    scaled, new = rules.normalize_rows(ortho, variance, 0.95, 1e-8, bound)
    assert torch.isnan(scaled[1]).all() and torch.isfinite(scaled[[0, 2]]).all()
    assert torch.equal(new[1], variance[1]) and not torch.equal(new[0], variance[0])


def test_fused_normalization_path_gets_the_bound_as_a_limit(monkeypatch):
    """The CUDA kernel path of row_normalization_in_place hands the kernel the limit
    bound·√min(k, C) on ‖O‖_F (the kernel's verdict itself: tests/test_selection_kernels.py); a
    stand-in applying that limit with the PyTorch formulas gives the PyTorch path's verdict, factors
    and variance."""
    generator = torch.Generator().manual_seed(5)
    ortho = orthogonalize(torch.randn(3, 6, 10, generator=generator), "newton_schulz", dtype=torch.float32)
    ortho[2] *= 4.0
    variance = torch.rand(3, 6, 1, generator=generator)
    bound = rules.update_bound("polar_express")
    expected_scale, expected_variance = rules.row_normalization(ortho, variance, 0.95, 1e-8, bound)
    limits = []

    def kernel_stand_in(o, v, rows, beta2, epsilon, limit):
        limits.append(limit)
        ok = torch.linalg.vector_norm(o, dim=(-2, -1)) <= limit
        scale, new = rules.row_normalization(o, v, beta2, epsilon)
        v.copy_(torch.where(ok.view(-1, 1, 1), new, v))
        return torch.where(ok.view(-1, 1), scale.squeeze(-1), float("nan")), ok

    monkeypatch.setattr(rules, "fused_row_normalization", kernel_stand_in)
    buffer = variance.clone()
    scale, ok = rules.row_normalization_in_place(ortho, buffer, None, 0.95, 1e-8, bound)
    assert limits == [bound * math.sqrt(6)]
    assert ok.tolist() == [True, True, False]
    torch.testing.assert_close(scale, expected_scale.squeeze(-1), equal_nan=True)
    assert torch.isnan(scale[2]).all() and torch.equal(buffer[2], variance[2])
    torch.testing.assert_close(buffer, torch.where(torch.isnan(expected_scale[:, :1]), variance, expected_variance))


def test_poison_spreads_a_bad_entry_over_its_matrix_only():
    ortho = torch.ones(3, 2, 4, dtype=torch.bfloat16)
    ortho[1, 1, 2] = float("inf")
    rules.poison_nonfinite(ortho)
    assert torch.isnan(ortho[1]).all() and torch.equal(ortho[[0, 2]], torch.ones(2, 2, 4, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    import json

    import gloo
    import nonfinite_worker

    folder = tmp_path_factory.mktemp("nonfinite")
    out = folder / "results.json"
    gloo.spawn(nonfinite_worker.worker, (2, str(folder / "store"), str(out)), world=2, store=str(folder / "store"))
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["muon", "normuon", "dion3-local", "dion3-global"])
def test_fsdp_ranks_skip_a_matrix_whose_nan_lives_on_one_rank(fsdp_results, kind):
    """The NaN gradient sits in rows of rank 1 only; rank 0's rows of that matrix must be
    skipped too (the owner spreads the bad matrix over all its rows), the other matrices match
    one process, and each rank counts the skipped piece it holds."""
    got = fsdp_results[kind]
    assert got["finite"]
    if kind != "dion3-local":  # local selection picks rows per shard: not one process's rows
        assert got["error"] <= 1e-5
    assert got["bad_decayed_error"] <= 1e-6 and got["plain_bad_decayed_error"] <= 1e-6
    assert got["skipped_plain"] == 1 and got["skipped_by_rank"] == [1, 1]


@pytest.mark.parametrize("ratio", [1.53, 133.5, float("nan")])
def test_a_wrong_final_product_of_gram_newton_schulz_is_skipped(monkeypatch, ratio):
    """The fault seen on a time-sliced H200 (benchmarks/results/nonfinite-h200-2026-12-02.md):
    Gram NS's last product Xᵀ·Q came out wrong for a few matrices of a batch. The sizes here are
    the ones recorded there (‖O‖_F/√n of 1.53 and 133.5, and NaN); 1.53 is finite and above
    polar_express's bound of 1.5, so before the bound (8898f56) it was applied."""
    armed = {}
    plain_bmm = torch.bmm

    def bmm(a, b, **kwargs):
        out = plain_bmm(a, b, **kwargs)
        # the final product of a tall result: Xᵀ [B, m, n] times the symmetric Q [B, n, n]
        if armed and a.shape[-2] > a.shape[-1] and b.shape[-1] == b.shape[-2] == a.shape[-1]:
            wrong = out.clone()
            n = min(out.shape[-2:])
            size = torch.linalg.vector_norm(out[1].double()) / n ** 0.5
            wrong[1] = out[1] * (ratio / size) if ratio == ratio else float("nan")
            armed.clear()  # one call only
            return wrong
        return out

    monkeypatch.setattr(torch, "bmm", bmm)
    shape = (24, 8)  # f = ½: k = 12 rows of 8 columns, tall, through Gram NS
    clean, faulty = _params(shape=shape), _params(shape=shape)
    options = dict(lr=LR, weight_decay=DECAY, fraction=0.5, orthogonalizer="gram")
    reference, guarded = Dion3(clean, **options), Dion3(faulty, **options)
    for step in range(3):
        before = faulty[1].detach().clone()
        for p, q, g in zip(clean, faulty, _grads(step, shape=shape)):
            p.grad, q.grad = g.clone(), g.clone()
        reference.step()
        if step == 2:
            armed["on"] = True
        guarded.step()
        assert not armed, "the final product of Gram NS was never called"
    torch.testing.assert_close(faulty[1].detach(), before * (1 - LR * DECAY), rtol=0, atol=1e-7)
    for i in (0, 2):
        assert torch.equal(faulty[i].detach(), clean[i].detach())
    assert int(guarded.nonfinite_updates) == 1 and int(reference.nonfinite_updates) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gpu_captured_step_skips_one_nan_gradient_and_trains_on(kind):
    """A real CUDA graph: CapturedStep replays the step whose gradient buffer holds a NaN at one
    replay. That matrix skips that step as a whole (weights only decayed, momentum and variance
    restored by the guard's kernels), counted once with its step, and trains again; the others
    match the eager step with the same gradients."""
    from dion3.optim.graph import CapturedStep

    shape = (1024, 512)  # kernel-sized: the fused CUDA paths run (momentum, selection, restore)
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for _ in range(3)]
    eager_params = [torch.nn.Parameter(x.clone().cuda()) for x in start]
    graph_params = [torch.nn.Parameter(x.clone().cuda()) for x in start]
    eager, graphed = _optimizer(kind, eager_params), _optimizer(kind, graph_params)
    step = CapturedStep(graphed, warmup_steps=2)
    for t in range(7):
        grads = [torch.randn(shape, generator=torch.Generator().manual_seed(100 + t * 3 + i)).cuda() for i in range(3)]
        if t == 5:
            grads[1][7, 9] = float("nan")
        before, state = graph_params[1].detach().clone(), _state(graphed, graph_params[1])
        for p, q, g in zip(eager_params, graph_params, grads):
            p.grad = g.clone()
            if q.grad is None:
                q.grad = g.clone()
            else:
                q.grad.copy_(g)  # the buffer the graph reads
        eager.step()
        step()
        if t == 5:
            assert step.graph is not None  # this step was a replay
            torch.testing.assert_close(graph_params[1].detach(), before * (1 - LR * DECAY), rtol=0, atol=1e-6)
            for key, value in state.items():
                torch.testing.assert_close(_state(graphed, graph_params[1])[key], value, rtol=1e-5, atol=1e-6)
    assert int(graphed.nonfinite_updates) == 1 and int(graphed.last_nonfinite_step) == 6
    assert int(eager.nonfinite_updates) == 1
    for p, q in zip(eager_params, graph_params):
        assert bool(torch.isfinite(q).all())
        torch.testing.assert_close(q.detach(), p.detach(), rtol=2e-3, atol=2e-4)
