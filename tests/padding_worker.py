"""Spawned-worker side of tests/test_padding.py: DDP (a ProcessGroup over plain parameters) and
FSDP2 on 2 gloo ranks with padding forced (set_padding(8)), against one process without it, in
float64 with odd selected row counts. Rank 0 writes the largest relative difference per layout
and optimizer to a JSON file. Not a test module."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gloo
from dion3 import Dion3, Muon, NorMuon
from dion3.ortho.padding import set_padding
from layouts_worker import cut, full, grads_for

SHAPES = [(13, 29), (13, 29), (22, 9)]
CASES = {"dion3-global": (Dion3, dict(fraction=0.37, selection_scope="global")),
         "dion3-local": (Dion3, dict(fraction=0.37)), "normuon": (NorMuon, {}), "muon": (Muon, {})}


def run(layout: str, kind: str) -> float:
    cls, options = CASES[kind]
    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(s, generator=generator, dtype=torch.float64) for s in SHAPES]
    params = torch.nn.ParameterList(torch.nn.Parameter(w.clone()) for w in weights)
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    mesh_arg = dist.group.WORLD if layout == "ddp" else None
    if layout == "fsdp2":
        fully_shard(params, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    settings = dict(lr=0.03, weight_decay=0.1, **options)
    opt, ref = cls(list(params.parameters()), distributed_mesh=mesh_arg, **settings), cls(plain, **settings)
    for step in range(3):
        for p, q, g in zip(params.parameters(), plain, grads_for(SHAPES, step)):
            p.grad, q.grad = cut(g.double(), p), g.double()
        set_padding(8)
        opt.step()
        set_padding("off")
        ref.step()
    if layout == "fsdp2" and kind == "dion3-local":  # per-shard selection: the one process is
        ref = None  # not its reference; compare with itself unpadded instead (below)
    if ref is None:
        return _against_unpadded(layout, kind, [full(p) for p in params.parameters()])
    return max(float((full(p) - q.detach()).abs().max() / q.detach().abs().max()) for p, q in zip(params.parameters(), plain))


def _against_unpadded(layout: str, kind: str, padded: list) -> float:
    set_padding("off")
    cls, options = CASES[kind]
    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(s, generator=generator, dtype=torch.float64) for s in SHAPES]
    params = torch.nn.ParameterList(torch.nn.Parameter(w.clone()) for w in weights)
    fully_shard(params, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = cls(list(params.parameters()), lr=0.03, weight_decay=0.1, **options)
    for step in range(3):
        for p, g in zip(params.parameters(), grads_for(SHAPES, step)):
            p.grad = cut(g.double(), p)
        opt.step()
    set_padding(None)
    return max(float((a - full(p)).abs().max() / full(p).abs().max()) for a, p in zip(padded, params.parameters()))


def worker(rank: int, world: int, out_path: str) -> None:
    gloo.run_and_report(rank, world, out_path, lambda: {f"{layout}/{kind}": run(layout, kind)
                                                          for layout in ("ddp", "fsdp2") for kind in CASES})


if __name__ == "__main__":
    sys.exit("a worker module: run tests/test_padding.py")
