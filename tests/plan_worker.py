"""Spawned-worker side of tests/test_plan_gloo.py: the real distributed step on gloo, for the
layouts and weights that `dion3 plan` prices, reporting what the step did on every rank: the
owners of each bucket's matrices and the bytes it sent by kind. Not a test module."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import gloo
from dion3 import Dion3, Muon
from dion3.tools.plan.world import Weight, parse_layout, placements

# A small Llama-like stack: q, k, v, o, gate, up, down per layer, 3 layers; k/v have 6 rows
# (uneven shards over 4 ranks: 2, 2, 2, 0), gate/up 40 rows (10 per rank).
LAYER = [("q", (16, 16)), ("k", (6, 16)), ("v", (6, 16)), ("o", (16, 16)), ("gate", (40, 16)),
         ("up", (40, 16)), ("down", (16, 40))]
WEIGHTS = [Weight(name, shape) for _ in range(3) for name, shape in LAYER]
LAYOUTS = ("fsdp=4", "fsdp=2,tp=2", "replicate=2,fsdp=2")
OPTIMIZERS = {"muon": (Muon, {}), "dion3": (Dion3, dict(fraction=0.25))}  # Dion3: rows, variances, scores


def build(optimizer: str, layout_text: str, seed: int = 0):
    layout = parse_layout(layout_text)
    mesh = init_device_mesh("cpu", tuple(s for _, s in layout.axes), mesh_dim_names=tuple(n for n, _ in layout.axes))
    gen = torch.Generator().manual_seed(seed)
    params = []
    for w in WEIGHTS:
        full = torch.randn(w.shape, generator=gen)
        params.append(torch.nn.Parameter(distribute_tensor(full, mesh, placements(w, layout), src_data_rank=None)))
    cls, options = OPTIMIZERS[optimizer]
    opt = cls(params, lr=0.02, orthogonalizer="newton_schulz", **options)
    for p, w in zip(params, WEIGHTS):
        p.grad = distribute_tensor(torch.randn(w.shape, generator=gen), p.device_mesh, p.placements, src_data_rank=None)
    return opt


def scenarios() -> dict:
    out = {}
    for layout in LAYOUTS:
        for name in OPTIMIZERS:
            opt = build(name, layout)
            owners = [[len(m) for m in b.owners()] for buckets in opt._buckets for b in buckets]
            opt.step()
            mine = dict(opt.communication_bytes_by_kind)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (dist.get_rank(), mine, owners))
            out[f"{layout} {name}"] = everyone
    return out


def worker(rank: int, world: int, out_path: str) -> None:
    gloo.run_and_report(rank, world, out_path, scenarios)
