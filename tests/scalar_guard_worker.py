"""Spawned-worker side of tests/test_scalar_guard_layouts.py: one NaN in the last entry of one
AdamW parameter's gradient (a bias, a norm gain, an embedding, an LM head) at one step, on DDP and
FSDP2 (2 ranks) and FSDP2 + TP (dp=2, tp=2), against one process given the same gradients. The
last entry lies in the last rank's shard: the other ranks' pieces are finite, and must skip the
parameter too. Each case runs the CPU's host-checked path and the sync-free masked path a GPU takes, the latter
through the CPU stand-in of a captured step for Muon and NorMuon (distributed Dion3 captures only
with local selection; its masked runs are eager).
Rank 0 writes what every rank measured. Not a test module."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import gloo
from dion3.kernels import reference as reference_kernels
from graph_standin import CPUCapturedStep
from layouts_worker import cut, full
from test_scalar_guard import BAD_STEP, DECAY, KINDS, LR, SCALAR_LR, SCALARS, Tiny, grads, groups

STEPS = 3


def build(layout: str):
    """(distributed model, its distributed_mesh argument)."""
    model = Tiny()
    if layout == "ddp":
        return model, dist.group.WORLD
    if layout == "fsdp2+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"proj": ColwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model, None
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",)))
    return model, None


def _every_rank(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def run(layout: str, kind: str, bad: str, masked: bool) -> dict:
    reference_kernels.HOST_CHECKS = not masked  # masked: the sync-free path a GPU takes, here on the CPU
    cls, options = KINDS[kind]
    model, mesh_arg = build(layout)
    reference = Tiny()
    opt = cls(groups(model), distributed_mesh=mesh_arg, lr=LR, weight_decay=DECAY, **options)
    # masked: also captured (the CPU stand-in refuses host syncs and host-to-device copies)
    step_fn = CPUCapturedStep(opt, warmup_steps=1) if masked and kind != "dion3" else opt.step
    ref = cls(groups(reference), lr=LR, weight_decay=DECAY, **options)
    named, ref_named = dict(model.named_parameters()), dict(reference.named_parameters())
    out = {}
    for step in range(STEPS):
        full_grads = grads(reference, step)
        if step == BAD_STEP:
            full_grads[bad].view(-1)[-1] = float("nan")
            state_before = {k: full(v) for k, v in opt.state[named[bad]].items()}
            weight_before = full(named[bad])
        for name, g in full_grads.items():
            named[name].grad, ref_named[name].grad = cut(g, named[name]), g.clone()
        step_fn()
        ref.step()
        if step == BAD_STEP:
            after = {k: full(v) for k, v in opt.state[named[bad]].items()}
            out["state_kept"] = all(torch.equal(after[k], v) for k, v in state_before.items())
            out["decayed_only"] = float((full(named[bad]) - weight_before * (1 - SCALAR_LR * DECAY)).abs().max())
    out["skipped"] = _every_rank(int(opt.nonfinite_updates))
    out["last"] = _every_rank(int(opt.last_nonfinite_step))
    finite = all(bool(torch.isfinite(full(t)).all()) for p in model.parameters() for t in opt.state[p].values())
    out["finite"] = _every_rank(finite and all(bool(torch.isfinite(full(p)).all()) for p in model.parameters()))
    out["error"] = max(float((full(named[n]) - ref_named[n].detach()).abs().max()) for n in SCALARS)
    out["reference_skipped"] = int(ref.nonfinite_updates)
    reference_kernels.HOST_CHECKS = True
    return out


def worker(rank: int, world: int, out_path: str, layouts: list) -> None:
    gloo.run_and_report(rank, world, out_path, lambda: {
        f"{layout}/{kind}/{bad}/{'masked' if masked else 'host'}": run(layout, kind, bad, masked)
        for layout in layouts for kind in KINDS for bad in SCALARS for masked in (False, True)})


if __name__ == "__main__":
    sys.exit("a worker module: run tests/test_scalar_guard_layouts.py")
