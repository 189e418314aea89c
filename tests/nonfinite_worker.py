"""Spawned-worker side of tests/test_nonfinite_guard.py: FSDP2-sharded matrices (fully_shard,
Shard(0) over 2 gloo ranks) whose gradient has a NaN in one matrix's rows on one rank only. Every
rank must skip that matrix (its shards only decay), step the others exactly as one process
does, and count the skip. Rank 0 writes what it measured to a JSON file. Not a test module."""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gloo
from dion3 import Dion3, Muon, NorMuon

SHAPES = [(8, 6), (8, 6), (8, 6), (6, 10)]
BAD, BAD_ROW = 1, 6  # row 6 of matrix 1 lives on rank 1 (rows 4..7)
LR, DECAY = 0.05, 0.1
CASES = {"muon": (Muon, {}), "normuon": (NorMuon, {}), "dion3-local": (Dion3, dict(fraction=0.5)),
         "dion3-global": (Dion3, dict(fraction=0.5, selection_scope="global"))}


def grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(50 + step)
    out = [torch.randn(s, generator=generator) for s in SHAPES]
    if step == 2:
        out[BAD][BAD_ROW, 3] = float("nan")
    return out


def run(kind: str, mesh) -> dict:
    cls, options = CASES[kind]
    generator = torch.Generator().manual_seed(7)
    weights = [torch.randn(s, generator=generator) for s in SHAPES]
    sharded = torch.nn.ParameterList(torch.nn.Parameter(w.clone()) for w in weights)
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    fully_shard(sharded, mesh=mesh)
    settings = dict(lr=LR, weight_decay=DECAY, orthogonalizer="newton_schulz", **options)
    opt_sharded = cls(list(sharded.parameters()), distributed_mesh=mesh, **settings)
    opt_plain = cls(plain, **settings)
    for step in range(3):
        before = [p.detach().full_tensor() for p in sharded.parameters()]
        plain_before = [q.detach().clone() for q in plain]  # apart from `before` under local selection
        for p, q, g in zip(sharded.parameters(), plain, grads(step)):
            rows = p.to_local().shape[0]
            start = dist.get_rank() * rows
            p.grad = torch.distributed.tensor.DTensor.from_local(
                g[start:start + rows].clone(), mesh, p.placements, shape=g.shape, stride=g.stride())
            q.grad = g.clone()
        opt_sharded.step()
        opt_plain.step()
    after = [p.detach().full_tensor() for p in sharded.parameters()]
    return {
        "error": max(float((a - q.detach()).abs().max()) for i, (a, q) in enumerate(zip(after, plain)) if i != BAD),
        "bad_decayed_error": float((after[BAD] - before[BAD] * (1 - LR * DECAY)).abs().max()),
        "plain_bad_decayed_error": float((plain[BAD].detach() - plain_before[BAD] * (1 - LR * DECAY)).abs().max()),
        "finite": all(bool(torch.isfinite(a).all()) for a in after),
        "skipped_by_rank": [int(v) for v in _gather(int(opt_sharded.nonfinite_updates))],
        "skipped_plain": int(opt_plain.nonfinite_updates),
    }


def _gather(value: int) -> list[int]:
    values = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value]))
    return [int(v) for v in values]


def worker(rank: int, world: int, store: str, out: str) -> None:
    gloo.start(rank, world, store)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = {kind: run(kind, mesh) for kind in CASES}
        if rank == 0:
            with open(out, "w") as handle:
                json.dump(results, handle)
    finally:
        gloo.stop()


if __name__ == "__main__":
    sys.exit("a worker module: run tests/test_nonfinite_guard.py")
