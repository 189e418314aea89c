"""Resume across world sizes with torch.distributed.checkpoint (FSDP2, gloo, CPU).

N/2 steps on W₁ ranks → get_state_dict + dcp.save → new processes on W₂ ranks → dcp.load +
set_state_dict → N/2 steps. The result must match N steps of the plain single-process optimizer
(float tolerance), for Dion3 (global scope), Muon (Nesterov), NorMuon, each with an AdamW group,
and the reloaded optimizer state must match the single-process state too.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import gloo
from dion3 import Dion3, Muon, NorMuon
from dion3.distributed import local_row_span

# Repeated, tall, wide, 3-row (zero-row shard at W=4) and 5-row (uneven) matrices; odd-length biases.
SHAPES = [(16, 24), (24, 16), (3, 8), (16, 24), (5, 7)]
BIASES = [6, 3]
STEPS = 4
TOLERANCE = 1e-5
OPTIMIZERS = {
    "dion3_global": (Dion3, dict(selection_scope="global", fraction=0.25)),
    "muon_nesterov": (Muon, dict(nesterov=True)),
    "normuon": (NorMuon, {}),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES)
        self.biases = nn.ParameterList(nn.Parameter(torch.randn(n, generator=gen)) for n in BIASES)


def build(kind: str, model: Net, mesh):
    factory, options = OPTIMIZERS[kind]
    groups = [{"params": list(model.weights)}, {"params": list(model.biases), "algorithm": "adamw", "lr": 0.01}]
    return factory(groups, distributed_mesh=mesh, lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz", **options)


def grads_at(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES] + [torch.randn(n, generator=gen) for n in BIASES]


def set_grads(params, grads, world: int, rank: int) -> None:
    for p, g in zip(params, grads):
        if isinstance(p, DTensor):
            start, stop = local_row_span(g.shape[0], world, rank)
            p.grad = DTensor.from_local(g[start:stop].clone(), p.device_mesh, [Shard(0)], run_check=False,
                                        shape=g.shape, stride=g.stride())
        else:
            p.grad = g.clone()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def params_of(model: Net) -> list[torch.Tensor]:
    return [*model.weights, *model.biases]


def run_steps(model, opt, steps, world, rank) -> None:
    for step in steps:
        set_grads(params_of(model), grads_at(step), world, rank)
        opt.step()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12))


def phase(rank: int, world: int, store: str, load_from: str, save_to: str, out: str) -> None:
    """On `world` ranks: optionally resume from `load_from`, run N/2 steps and compare with the
    straight single-process run (errors to `out`); optionally save N/2 fresh steps to `save_to`."""
    gloo.start(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,))
        errors = {}
        for kind in OPTIMIZERS:
            if save_to:
                model = Net()
                fully_shard(model, mesh=mesh)
                opt = build(kind, model, mesh)
                run_steps(model, opt, range(STEPS // 2), world, rank)
                model_sd, optim_sd = get_state_dict(model, opt)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{save_to}/{kind}")
            if load_from:
                errors[kind] = resumed_error(kind, mesh, world, rank, f"{load_from}/{kind}")
        if rank == 0 and out:
            with open(out, "w") as f:
                json.dump(errors, f)
    finally:
        gloo.stop()


def resumed_error(kind: str, mesh, world: int, rank: int, checkpoint: str) -> float:
    model = Net()  # fresh weights: everything after step N/2 must come from the checkpoint
    fully_shard(model, mesh=mesh)
    opt = build(kind, model, mesh)
    model_sd, optim_sd = get_state_dict(model, opt)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    run_steps(model, opt, range(STEPS // 2, STEPS), world, rank)
    reference = Net()  # the same optimizer on one process, N steps straight
    reference_opt = build(kind, reference, None)
    run_steps(reference, reference_opt, range(STEPS), 1, 0)
    worst = 0.0
    for p, q in zip(params_of(model), params_of(reference)):
        worst = max(worst, relative_error(full(p), q.detach()))
        for key, value in reference_opt.state[q].items():
            worst = max(worst, relative_error(full(opt.state[p][key]).reshape(value.shape), value))
    return worst


def spawn(world: int, store, load_from="", save_to="", out="") -> None:
    gloo.spawn(phase, (world, str(store), str(load_from), str(save_to), str(out)), world, str(store))


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    """Four process launches: save on 2 → load on 4 (and save on 4) → load on 2; load on 1."""
    root = tmp_path_factory.mktemp("dcp")
    on2, on4 = root / "saved_on_2", root / "saved_on_4"
    spawn(2, root / "store0", save_to=on2)
    spawn(4, root / "store1", load_from=on2, save_to=on4, out=root / "2to4.json")
    spawn(2, root / "store2", load_from=on4, out=root / "4to2.json")
    spawn(1, root / "store3", load_from=on2, out=root / "2to1.json")
    return {name: json.loads((root / f"{name}.json").read_text()) for name in ("2to4", "4to2", "2to1")}


@pytest.mark.parametrize("resume", ["2to4", "2to1", "4to2"])
def test_resume_on_another_world_size_matches_a_straight_run(errors, resume):
    assert set(errors[resume]) == set(OPTIMIZERS)
    for kind, error in errors[resume].items():
        assert error <= TOLERANCE, (resume, kind, error)
