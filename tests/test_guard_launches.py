"""The guard's restoration on the path a CUDA device takes, replayed on the CPU under
TRITON_INTERPRET=1 (in a subprocess, since the variable must be set before Triton is imported):
the kernel gate accepts CPU tensors and every Triton launch is counted by kernel.

- a step with nothing to skip launches no restoration kernel: the weight update's launch carries
  it (RESTORE in the post-update kernel), for Muon and Dion3;
- a step whose gradient has a NaN in one matrix skips that matrix only, still without a separate
  restoration launch, and leaves its momentum as it was before the step (to within one rounding,
  against the momentum saved before the step), its weights only decayed;
- on the CPU's own path, a clean step calls no restoration and builds no verdict factors."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import collections, importlib, json, torch
    import dion3
    from dion3 import kernels
    # the modules, not the dispatch functions of the same names
    momentum_module = importlib.import_module("dion3.kernels.momentum")
    post_update_module = importlib.import_module("dion3.kernels.post_update")

    kernels._triton_ready = lambda device: kernels.kernels_enabled() and kernels._symmetric_kernel is not None
    kernels._half_dot_ready = lambda device: False  # products through the reference path (no GPU to ask)
    launches = collections.Counter()

    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                launches[self.name] += 1
                if self.name == "post_update" and kwargs.get("RESTORE"):
                    launches["post_update restoring"] += 1
                return launch(*args, **kwargs)
            return run

    momentum_module._restore_kernel = Counted(momentum_module._restore_kernel, "restore")
    post_update_module._post_update_kernel = Counted(post_update_module._post_update_kernel, "post_update")
    out = {}
    for name, make in (("muon", lambda ps: dion3.Muon(ps, lr=0.02, weight_decay=0.1)),
                       ("dion3", lambda ps: dion3.Dion3(ps, lr=0.02, weight_decay=0.1, fraction=0.5))):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16, 32)) for _ in range(3)]
        optimizer = make(params)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        launches.clear()
        optimizer.step()  # nothing to skip
        out[f"{name}_clean"] = dict(launches)
        params[1].grad[3, 5] = float("nan")
        momentum_before = [optimizer.state[p]["momentum"].clone() for p in params]
        weights_before = [p.detach().clone() for p in params]
        launches.clear()
        optimizer.step()
        out[f"{name}_nan"] = dict(launches)
        momentum_after = [optimizer.state[p]["momentum"] for p in params]
        out[f"{name}_restored"] = float((momentum_after[1] - momentum_before[1]).abs().max()
                                        / momentum_before[1].abs().max())
        out[f"{name}_others_moved"] = all(not torch.equal(momentum_after[i], momentum_before[i]) for i in (0, 2))
        out[f"{name}_weights_decayed"] = float((params[1].detach() - (1 - 0.02 * 0.1) * weights_before[1]).abs().max())
        out[f"{name}_skips"] = int(optimizer.nonfinite_updates)
    print(json.dumps(out))
    """
)


def test_a_clean_step_launches_no_restoration_and_a_skipped_matrix_is_restored_in_the_update():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("muon", "dion3"):
        clean, nan = got[f"{name}_clean"], got[f"{name}_nan"]
        assert clean.get("restore", 0) == 0 and nan.get("restore", 0) == 0
        # every post-update launch of both steps carries the restoration
        assert clean["post_update"] >= 1 and clean.get("post_update restoring") == clean["post_update"]
        assert nan.get("post_update restoring") == nan["post_update"]
        assert got[f"{name}_restored"] <= 1e-6, name
        assert got[f"{name}_others_moved"] and got[f"{name}_skips"] == 1
        assert got[f"{name}_weights_decayed"] <= 1e-6


def test_a_verdict_of_the_wrong_length_is_refused_naming_it():
    pytest.importorskip("triton")
    import importlib

    import torch

    post_update = importlib.import_module("dion3.kernels.post_update")
    params = [torch.zeros(3, 4, 8)]
    with pytest.raises(ValueError, match="verdict must have one entry per matrix"):
        post_update.post_update_triton(params, torch.zeros(3, 4, 8), None, 1.0, 0.1, None, torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("name", ["muon", "normuon", "dion3"])
def test_a_clean_cpu_step_does_no_restoration_work(monkeypatch, name):
    """On the CPU (the host may look: kernels.reference.host_checks_free) a step with nothing to
    skip neither restores momentum nor builds per-row verdict factors; a NaN in one matrix's
    gradient restores that matrix, against its momentum before the step."""
    import torch

    import dion3
    from dion3 import kernels
    from dion3.kernels import reference

    calls = {"restore": 0, "factors": 0}
    restore, factors = kernels.restore_momentum, kernels.verdict_factors

    def counted_restore(*args, **kwargs):
        calls["restore"] += 1
        return restore(*args, **kwargs)

    def counted_factors(update, row_scale, verdict):
        calls["factors"] += verdict is not None
        return factors(update, row_scale, verdict)

    monkeypatch.setattr(kernels, "restore_momentum", counted_restore)
    monkeypatch.setattr(kernels, "verdict_factors", counted_factors)
    assert reference.host_checks_free(torch.device("cpu"))
    make = {"muon": dion3.Muon, "normuon": dion3.NorMuon,
            "dion3": lambda ps, **kw: dion3.Dion3(ps, fraction=0.5, **kw)}[name]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 32, dtype=torch.float64)) for _ in range(3)]
    optimizer = make(params, lr=0.02, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.step()
    assert calls == {"restore": 0, "factors": 0}
    params[1].grad[3, 5] = float("nan")
    before = optimizer.state[params[1]]["momentum"].clone()
    optimizer.step()
    assert calls["restore"] == 1 and int(optimizer.nonfinite_updates) == 1
    torch.testing.assert_close(optimizer.state[params[1]]["momentum"], before, rtol=1e-12, atol=1e-12)
