"""The guard for the AdamW and Lion groups: a NaN or inf in the gradient of a bias, a norm gain, an
embedding or an LM head costs that parameter one step (its weights only decay; its moments and
step count stay as they were), counts once in `nonfinite_updates` with its step number, and the
next finite gradient trains it again; the group's other parameters step as torch.optim.AdamW
steps them. On one device: the host-checked path (CPU), the sync-free masked path a GPU takes, and
captured steps (CPUCapturedStep, where host syncs raise). Distributed layouts:
tests/test_scalar_guard_layouts.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon
from dion3.kernels import reference as reference_kernels

sys.path.insert(0, str(Path(__file__).parent))
from graph_standin import CPUCapturedStep  # noqa: E402

LR, DECAY, SCALAR_LR = 0.02, 0.1, 0.01
KINDS = {"dion3": (Dion3, dict(fraction=0.5)), "muon": (Muon, {}), "normuon": (NorMuon, {})}
BAD_STEP = 1


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)  # its weight is the matrix, its bias an AdamW parameter
        self.norm = torch.nn.Parameter(torch.ones(8) + 0.1 * torch.randn(8))
        self.head = torch.nn.Linear(8, 16, bias=False)


SCALARS = ("embedding.weight", "proj.bias", "norm", "head.weight")


def groups(model, algorithm="adamw"):
    named = dict(model.named_parameters())
    return [{"params": [("proj.weight", named["proj.weight"])]},
            {"params": [(name, named[name]) for name in SCALARS], "algorithm": algorithm, "lr": SCALAR_LR}]


def grads(model, step):
    generator = torch.Generator().manual_seed(10 + step)
    return {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}


def run(kind, bad, value, algorithm="adamw", masked=False, captured=False, steps=3):
    """A guarded run with a non-finite entry in `bad`'s gradient at BAD_STEP; returns what the
    tests read at that step and after."""
    cls, options = KINDS[kind]
    model = Tiny()
    optimizer = cls(groups(model, algorithm), lr=LR, weight_decay=DECAY, **options)
    step = CPUCapturedStep(optimizer, warmup_steps=1) if captured else optimizer.step
    named = dict(model.named_parameters())
    seen = {}
    saved = reference_kernels.HOST_CHECKS
    reference_kernels.HOST_CHECKS = not masked  # masked: the path a GPU takes
    try:
        for number in range(steps):
            for name, g in grads(model, number).items():
                named[name].grad = g
            if number == BAD_STEP:
                named[bad].grad.view(-1)[3] = value
                seen["weight"] = named[bad].detach().clone()
                seen["state"] = {k: v.clone() for k, v in optimizer.state[named[bad]].items()}
            step()
            if number == BAD_STEP:
                seen["weight_after"] = named[bad].detach().clone()
                seen["state_after"] = {k: v.clone() for k, v in optimizer.state[named[bad]].items()}
    finally:
        reference_kernels.HOST_CHECKS = saved
    seen["final"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    seen["states_finite"] = all(torch.isfinite(t).all() for p in model.parameters() for t in optimizer.state[p].values())
    seen["skipped"], seen["last"] = int(optimizer.nonfinite_updates), int(optimizer.last_nonfinite_step)
    return seen


def reference_adamw(bad, steps=3):
    """torch.optim.AdamW on the scalar parameters, the bad one left out of BAD_STEP (its weights
    decayed by hand, as decoupled weight decay does without a gradient)."""
    model = Tiny()
    named = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([named[n] for n in SCALARS], lr=SCALAR_LR, betas=(0.9, 0.95), weight_decay=DECAY)
    for number in range(steps):
        for name, g in grads(model, number).items():
            named[name].grad = g
        if number == BAD_STEP:
            named[bad].grad = None
            with torch.no_grad():
                named[bad].mul_(1 - SCALAR_LR * DECAY)
        optimizer.step()
    return {name: named[name].detach().clone() for name in SCALARS}


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("bad", SCALARS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bad_scalar_gradient_costs_one_step_of_that_parameter(kind, bad, value):
    got = run(kind, bad, value)
    torch.testing.assert_close(got["weight_after"], got["weight"] * (1 - SCALAR_LR * DECAY), rtol=0, atol=1e-7)
    for key, before in got["state"].items():  # moments and step count: untouched
        assert torch.equal(got["state_after"][key], before), key
    assert got["skipped"] == 1 and got["last"] == BAD_STEP + 1
    assert got["states_finite"] and all(torch.isfinite(p).all() for p in got["final"].values())
    want = reference_adamw(bad)
    for name in SCALARS:  # every scalar parameter, the bad one trained again afterwards, as AdamW
        torch.testing.assert_close(got["final"][name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("captured", [False, True], ids=["masked", "captured"])
@pytest.mark.parametrize("bad", SCALARS)
def test_the_sync_free_path_skips_the_same_parameter(bad, captured):
    """The masked path (what a GPU runs, and what a captured step runs): the bad parameter's state
    bitwise unchanged, its weights decayed only, and every parameter bitwise as in the host-checked
    run (the same fused kernel, called per parameter with its verdict instead of once for the
    kept ones)."""
    got = run("dion3", bad, float("nan"), masked=True, captured=captured)
    plain = run("dion3", bad, float("nan"))
    for key, before in got["state"].items():
        assert torch.equal(got["state_after"][key], before), key
    torch.testing.assert_close(got["weight_after"], got["weight"] * (1 - SCALAR_LR * DECAY), rtol=0, atol=1e-7)
    assert got["skipped"] == 1 and got["last"] == BAD_STEP + 1 and got["states_finite"]
    for name in SCALARS:
        assert torch.equal(got["final"][name], plain["final"][name]), name


@pytest.mark.parametrize("masked", [False, True], ids=["host", "masked"])
def test_lion_groups_are_guarded_too(masked):
    got = run("muon", "embedding.weight", float("nan"), algorithm="lion", masked=masked)
    assert torch.equal(got["state_after"]["exp_avg"], got["state"]["exp_avg"])
    torch.testing.assert_close(got["weight_after"], got["weight"] * (1 - SCALAR_LR * DECAY), rtol=0, atol=1e-7)
    assert got["skipped"] == 1 and got["states_finite"]


def test_check_finite_still_raises_on_a_scalar_gradient():
    model = Tiny()
    optimizer = Dion3(groups(model), lr=LR, check_finite=True)
    for name, g in grads(model, 0).items():
        dict(model.named_parameters())[name].grad = g
    model.norm.grad[2] = float("nan")
    with pytest.raises(FloatingPointError, match="norm"):
        optimizer.step()


def test_a_matrix_and_a_scalar_skipped_in_one_step_count_twice():
    model = Tiny()
    optimizer = Dion3(groups(model), lr=LR, fraction=0.5)
    named = dict(model.named_parameters())
    for name, g in grads(model, 0).items():
        named[name].grad = g
    named["proj.weight"].grad[0, 0] = float("nan")
    named["head.weight"].grad[1, 1] = float("inf")
    optimizer.step()
    assert int(optimizer.nonfinite_updates) == 2 and int(optimizer.last_nonfinite_step) == 1
