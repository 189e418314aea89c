"""Momentum in bf16 (momentum_dtype, per group): the state's dtype, state_dict round trips, a
resume across dtypes in both directions, the captured step, FSDP2 with distributed checkpoints
(tests/momentum_dtype_worker.py), and why plain rounding is enough: with the same selections,
a Dion3 momentum kept in bf16 gives snapshots within half a percent of float32's, an error that
does not grow with the steps."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon, rules

sys.path.insert(0, str(Path(__file__).parent))
from graph_standin import CPUCapturedStep  # noqa: E402

# (2, 6, 10) among the parameters: a stack of two matrices
KINDS = {"dion3": (Dion3, dict(fraction=0.5, stacked=True)), "muon": (Muon, dict(stacked=True)),
         "normuon": (NorMuon, dict(stacked=True))}


def _params(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in ((12, 8), (12, 8), (2, 6, 10))]


def _step(opt, params, step):
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    opt.step()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_momentum_takes_the_group_dtype(kind):
    cls, options = KINDS[kind]
    params = _params()
    opt = cls([{"params": params[:2], "momentum_dtype": "bfloat16"}, {"params": params[2:]}], **options)
    assert [opt.state[p]["momentum"].dtype for p in params] == [torch.bfloat16] * 2 + [torch.float32]
    if kind != "muon":
        assert all(opt.state[p]["variance"].dtype == torch.float32 for p in params)  # one value per row: kept
    for step in range(3):
        _step(opt, params, step)
    assert all(torch.isfinite(opt.state[p]["momentum"]).all() for p in params)
    assert opt.param_groups[0]["momentum_dtype"] == "bfloat16" and opt.param_groups[1]["momentum_dtype"] is None
    # bf16 parameters keep bf16 momentum by default; float32 can be asked for
    bf16 = _params(torch.bfloat16)
    opt = cls([{"params": bf16[:1]}, {"params": bf16[1:], "momentum_dtype": torch.float32}], **options)
    assert [opt.state[p]["momentum"].dtype for p in bf16] == [torch.bfloat16, torch.float32, torch.float32]


def test_bad_momentum_dtypes_are_refused_by_name():
    for bad in ("float16", torch.float16, 16, "half"):
        with pytest.raises(ValueError, match="parameter group 0: momentum_dtype must be"):
            Dion3(_params(), momentum_dtype=bad)


@pytest.mark.parametrize("saved, loaded", [("bfloat16", "bfloat16"), (None, "bfloat16"), ("bfloat16", None)])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_dicts_round_trip_and_load_across_dtypes(kind, saved, loaded):
    cls, options = KINDS[kind]
    params = _params()
    opt = cls(params, momentum_dtype=saved, **options)
    for step in range(2):
        _step(opt, params, step)
    state = opt.state_dict()
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    resumed = cls(params, momentum_dtype=loaded, **options)
    resumed.load_state_dict(state)
    want_dtype = torch.bfloat16 if loaded else torch.float32
    assert resumed.param_groups[0]["momentum_dtype"] == loaded  # the loading optimizer's choice
    for p in params:
        got, old = resumed.state[p], before[id(p)]
        assert got["momentum"].dtype == want_dtype
        assert torch.equal(got["momentum"], old["momentum"].to(want_dtype))  # cast once, nothing else
        if "variance" in old:
            assert got["variance"].dtype == torch.float32 and torch.equal(got["variance"], old["variance"])
    for step in range(2, 4):  # and the resumed run steps on
        _step(resumed, params, step)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_captured_step_with_bf16_momentum_equals_the_eager_one(kind):
    cls, options = KINDS[kind]
    eager_params, captured_params = _params(), _params()
    eager = cls(eager_params, momentum_dtype="bfloat16", **options)
    captured = cls(captured_params, momentum_dtype="bfloat16", **options)
    replay = CPUCapturedStep(captured, warmup_steps=1)
    for step in range(4):
        generator = torch.Generator().manual_seed(100 + step)
        for p, q in zip(eager_params, captured_params):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        eager.step()
        replay()
    for p, q in zip(eager_params, captured_params):  # lr as a device scalar: float32 rounding apart
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)


def test_plain_bf16_rounding_keeps_dion3_snapshots_close_and_does_not_drift():
    """Dion3's unselected rows accumulate gradients in the momentum; in bf16 each addition rounds.
    With the float32 run's selections forced on both (so that only the rounding differs), the
    bf16 snapshots U stay within 1% of float32's (0.37% measured here, about the unit roundoff
    2⁻⁸ times a small factor), and the error at step 300 is no larger than 1.3× that at step 10:
    it does not accumulate. (Stochastic rounding, simulated the same way, gave 0.53%: noisier,
    and nothing to remove.)"""
    generator = torch.Generator().manual_seed(1)
    rows, cols, k, mu, steps = 512, 256, 128, 0.6, 300
    cfg = rules.RuleConfig(fraction=k / rows, mu=mu)
    m32 = torch.zeros(1, rows, cols)
    m16 = torch.zeros(1, rows, cols, dtype=torch.bfloat16)
    errors = []
    for _ in range(steps):
        grad = torch.randn(1, rows, cols, generator=generator) * (1 + 0.5 * torch.randn(1, rows, 1, generator=generator).abs())
        u32, selected, _, _ = rules.pre_step(m32, grad, cfg)
        u16, _, _, _ = rules.pre_step(m16, grad, cfg, rows=selected)
        errors.append(float((u16.float() - u32).norm() / u32.norm()))
    assert max(errors) <= 0.01, max(errors)
    assert errors[-1] <= 1.3 * errors[9], (errors[9], errors[-1])


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    import gloo
    import momentum_dtype_worker

    return gloo.spawn_and_read(momentum_dtype_worker.worker, 2, tmp_path_factory.mktemp("mdtype") / "out.json",
                               str(tmp_path_factory.mktemp("mdtype-ckpt")))


@pytest.mark.parametrize("saved, loaded", [("float32", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")])
def test_fsdp2_checkpoints_move_between_momentum_dtypes(distributed, saved, loaded):
    got = distributed[f"{saved}->{loaded}"]
    assert got["dtypes"] == [f"torch.{loaded}"] * 2  # every rank's momentum shards
    assert got["cast_error"] == 0.0  # the loaded momentum is the saved one cast to the new dtype
    assert got["variance_error"] == 0.0
    assert got["finite"] and got["steps_after"] == 2
