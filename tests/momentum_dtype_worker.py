"""Spawned-worker side of tests/test_momentum_dtype.py: Dion3 under FSDP2 on 2 gloo ranks saves
its state with torch.distributed.checkpoint under one momentum dtype and loads it into an
optimizer of another; rank 0 writes what every rank saw to a JSON file. Not a test module."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gloo
from dion3 import Dion3
from layouts_worker import cut, full, grads_for

SHAPES = [(12, 8), (12, 8), (8, 20)]


def model(mesh):
    generator = torch.Generator().manual_seed(3)
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES)
    fully_shard(params, mesh=mesh)
    return params


def run(mesh, folder: str, saved: str, loaded: str) -> dict:
    net = model(mesh)
    opt = Dion3(list(net.parameters()), lr=0.02, fraction=0.5, selection_scope="global", momentum_dtype=saved)
    for step in range(2):
        for p, g in zip(net.parameters(), grads_for(SHAPES, step)):
            p.grad = cut(g, p)
        opt.step()
    path = f"{folder}/{saved}-{loaded}"
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    momentum = [full(opt.state[p]["momentum"]) for p in net.parameters()]
    variance = [full(opt.state[p]["variance"]) for p in net.parameters()]
    fresh = model(mesh)
    resumed = Dion3(list(fresh.parameters()), lr=0.02, fraction=0.5, selection_scope="global", momentum_dtype=loaded)
    model_sd, optim_sd = get_state_dict(fresh, resumed)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=path)
    set_state_dict(fresh, resumed, model_state_dict=target["model"], optim_state_dict=target["optim"])
    want = getattr(torch, loaded)
    dtypes = [None] * dist.get_world_size()
    dist.all_gather_object(dtypes, str(resumed.state[list(fresh.parameters())[0]]["momentum"].to_local().dtype))
    cast = max(float((full(resumed.state[p]["momentum"]).float() - m.to(want).float()).abs().max())
               for p, m in zip(fresh.parameters(), momentum))
    var = max(float((full(resumed.state[p]["variance"]) - v).abs().max()) for p, v in zip(fresh.parameters(), variance))
    steps = 0
    for step in range(2, 4):
        for p, g in zip(fresh.parameters(), grads_for(SHAPES, step)):
            p.grad = cut(g, p)
        resumed.step()
        steps += 1
    finite = all(bool(torch.isfinite(full(p)).all()) for p in fresh.parameters())
    return {"dtypes": dtypes, "cast_error": cast, "variance_error": var, "finite": finite, "steps_after": steps}


def worker(rank: int, world: int, out_path: str, folder: str) -> None:
    def scenarios():
        mesh = init_device_mesh("cpu", (world,))
        return {f"{s}->{l}": run(mesh, folder, s, l)
                for s, l in (("float32", "bfloat16"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))}

    gloo.run_and_report(rank, world, out_path, scenarios)


if __name__ == "__main__":
    sys.exit("a worker module: run tests/test_momentum_dtype.py")
