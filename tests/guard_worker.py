"""Spawned-worker side of tests/test_guard_layouts.py: one NaN in one entry of one matrix's
gradient, at one step, on every distributed layout (gloo), against one process given the same
gradients. Layouts: DDP (a ProcessGroup over plain parameters) and FSDP2 at 2 ranks; HSDP
(replicate=2, shard=2) and FSDP2 + TP (dp=2, tp=2, torchtitan's recipe) at 4. Rank 0 writes,
per layout and optimizer, what every rank measured to a JSON file. Not a test module."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gloo
from dion3 import Dion3, Muon, NorMuon
from layouts_worker import Block, cut, full, grads_for, recipe

STEPS, BAD_STEP = 4, 1
SETTINGS = dict(lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz")
CASES = {"muon": (Muon, {}), "normuon": (NorMuon, {}), "dion3-global": (Dion3, dict(fraction=0.5, selection_scope="global")),
         "dion3-local": (Dion3, dict(fraction=0.5))}
BAD = "up.weight"  # the matrix whose gradient gets a NaN: 12 × 8, its rows split over every rank
BAD_ENTRY = (7, 3)


def build(layout: str):
    """(distributed model, one-process model, distributed_mesh argument) with the same weights."""
    world = dist.get_world_size()
    if layout == "fsdp2+tp":
        return (*recipe(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))), None)
    model, reference = Block(8, 12, 0), Block(8, 12, 0)
    if layout == "ddp":
        return model, reference, dist.group.WORLD
    shape = (world,) if layout == "fsdp2" else (2, world // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp",) if layout == "fsdp2" else ("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    return model, reference, None


def _state_tensors(optimizer, p) -> dict:
    return {key: full(value) for key, value in optimizer.state[p].items() if isinstance(value, torch.Tensor)}


def _every_rank(flag: bool) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, flag)
    return values


def run(layout: str, kind: str) -> dict:
    cls, options = CASES[kind]
    settings = {**SETTINGS, **options}
    model, reference, mesh_arg = build(layout)
    names = [n for n, _ in model.named_parameters()]
    params, ref_params = list(model.parameters()), list(reference.parameters())
    opt = cls(list(model.named_parameters()), distributed_mesh=mesh_arg, **settings)
    ref = cls(list(reference.named_parameters()), **settings)
    bad = names.index(BAD)
    shapes = [tuple(p.shape) for p in params]
    out = {"bad_state_kept": [], "bad_decayed_only": None, "bad_moved_after": None}
    for step in range(STEPS):
        grads = grads_for(shapes, step)
        if step == BAD_STEP:
            grads[bad][BAD_ENTRY] = float("nan")
        state_before = _state_tensors(opt, params[bad])
        weight_before = full(params[bad])
        for p, r, g in zip(params, ref_params, grads):
            p.grad, r.grad = cut(g, p), g.clone()
        opt.step()
        ref.step()
        decayed = weight_before * (1 - settings["lr"] * settings["weight_decay"])
        if step == BAD_STEP:
            after = _state_tensors(opt, params[bad])
            out["bad_state_kept"] = {key: float((after[key] - value).abs().max() / value.abs().max().clamp_min(1e-12))
                                     for key, value in state_before.items()}
            out["bad_decayed_only"] = float((full(params[bad]) - decayed).abs().max())
        if step == BAD_STEP + 1:  # the next finite gradient trains it again
            out["bad_moved_after"] = float((full(params[bad]) - decayed).abs().max())
    states_finite = all(bool(torch.isfinite(t).all()) for p in params for t in _state_tensors(opt, p).values())
    out["finite"] = _every_rank(states_finite and all(bool(torch.isfinite(full(p)).all()) for p in params))
    out["skipped"] = _every_rank(int(opt.nonfinite_updates))
    out["last_skip_step"] = _every_rank(int(opt.last_nonfinite_step))
    out["reference_skipped"] = int(ref.nonfinite_updates)
    out["error"] = max(float((full(p) - r.detach()).abs().max() / r.detach().abs().max()) for p, r in zip(params, ref_params))
    return out


def worker(rank: int, world: int, out_path: str, layouts: list) -> None:
    gloo.run_and_report(rank, world, out_path, lambda: {f"{layout}/{kind}": run(layout, kind)
                                                          for layout in layouts for kind in CASES})


if __name__ == "__main__":
    sys.exit("a worker module: run tests/test_guard_layouts.py")
