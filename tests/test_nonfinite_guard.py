"""The guard against non-finite updates: a matrix whose orthogonalized update is not finite is
skipped (its parameter only decays, its per-row variance stays) and counted in
`optimizer.nonfinite_updates`, without a host sync; the other matrices of its bucket step as if
nothing happened. Faults are forced two ways: an orthogonalization that returns inf/NaN for one
matrix (what a half-precision overflow would do) and a gradient with a NaN entry."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon, rules

sys.path.insert(0, str(Path(__file__).parent))
from graph_standin import CPUCapturedStep  # noqa: E402

LR, DECAY = 0.05, 0.1
KINDS = {"muon": Muon, "normuon": NorMuon, "dion3": Dion3}


def _params(seed=0, count=3, shape=(12, 8)):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for _ in range(count)]


def _grads(step, count=3, shape=(12, 8)):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*shape, generator=generator) for _ in range(count)]


def _optimizer(kind, params):
    options = dict(lr=LR, weight_decay=DECAY)
    if kind == "dion3":
        options["fraction"] = 0.5
    return KINDS[kind](params, **options)


@pytest.fixture
def broken_matrix(monkeypatch):
    """Make every orthogonalization return `value` in one entry of matrix `index` of its batch."""
    original = rules.orthogonalize
    fault = {}

    def faulty(x, *args, **kwargs):
        out = original(x, *args, **kwargs)
        if fault:
            out = out.clone()
            out[fault["index"], 0, 0] = fault["value"]
        return out

    monkeypatch.setattr(rules, "orthogonalize", faulty)
    return fault


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_non_finite_update_is_skipped_and_counted(kind, value, broken_matrix):
    clean, faulty = _params(), _params()
    reference, guarded = _optimizer(kind, clean), _optimizer(kind, faulty)
    for step in range(3):  # two clean steps build up momentum and variance first
        before = [p.detach().clone() for p in faulty]
        variance = [guarded.state[p].get("variance", torch.zeros(1)).clone() for p in faulty]
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
    for i in (0, 2):
        assert torch.equal(faulty[i].detach(), clean[i].detach())
    assert int(guarded.nonfinite_updates) == 1 and int(reference.nonfinite_updates) == 0
    assert all(torch.isfinite(p).all() for p in faulty)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_nan_gradient_never_reaches_the_weights(kind):
    params = _params()
    optimizer = _optimizer(kind, params)
    before = [p.detach().clone() for p in params]
    grads = _grads(0)
    grads[2][3, 4] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g
    optimizer.step()
    torch.testing.assert_close(params[2].detach(), before[2] * (1 - LR * DECAY), rtol=0, atol=1e-7)
    assert all(torch.isfinite(p).all() for p in params)
    assert int(optimizer.nonfinite_updates) == 1
    # its momentum holds the NaN: the matrix is skipped again at every step, and counted
    for p, g in zip(params, _grads(1)):
        p.grad = g
    optimizer.step()
    assert int(optimizer.nonfinite_updates) == 2 and all(torch.isfinite(p).all() for p in params)


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
