"""Spawned-worker side of tests/test_owners.py: gloo process groups on loopback.

Every rank builds the optimizer on the same model, records the owner of every matrix of every
bucket, and steps against a single-process run of the same optimizer on the full matrices and
gradients; rank 0 writes each rank's owners and the errors. Not a test module (no test_ prefix).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import gloo
from distributed_worker import Matrices, Run, full, full_grads, make_optimizer, max_relative_error

# Two matrices whose owners move many bytes each and six that move few (see test_owners.py).
SHAPES = [(48, 40)] * 2 + [(8, 40)] * 6
STEPS = 2
ALGORITHMS = {"muon": ("muon", {}), "dion3_global": ("dion3", {"selection_scope": "global"})}


def owners(opt) -> dict:
    """{bucket shape: owner of each of its matrices} of the optimizer's one group."""
    return {"x".join(map(str, b.shape)): list(b.owner_of) for b in opt._buckets[0]}


def gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def fsdp_run(kind, options, world, rank) -> tuple[float, dict]:
    """fully_shard rows (ShardedBucket) against one process."""
    mesh = init_device_mesh("cpu", (world,))
    run, ref = Run("fsdp", SHAPES, mesh, world, rank), Matrices(SHAPES, seed=7)
    opt = make_optimizer(kind, run.params, run.mesh, **options)
    ref_opt = make_optimizer(kind, list(ref.parameters()), None, **options)
    for step in range(STEPS):
        grads = full_grads(SHAPES, step)
        run.set_grads(grads)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        ref_opt.step()
    return max_relative_error(run.weights(), [p.detach() for p in ref.parameters()]), owners(opt)


def rows_and_columns_run(kind, options) -> tuple[float, dict]:
    """Rows over one axis and columns over the other of a (2, 2) mesh (FSDP2 + TP's row-parallel
    layout: LayoutBucket) against one process."""
    mesh = init_device_mesh("cpu", (2, 2))
    placements = [Shard(0), Shard(1)]
    ref = Matrices(SHAPES, seed=7)
    params = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements, src_data_rank=None))
              for p in ref.parameters()]
    opt = make_optimizer(kind, params, None, **options)
    ref_opt = make_optimizer(kind, list(ref.parameters()), None, **options)
    for step in range(STEPS):
        grads = full_grads(SHAPES, step)
        for p, q, g in zip(params, ref.parameters(), grads):
            p.grad = distribute_tensor(g, mesh, placements, src_data_rank=None)
            q.grad = g.clone()
        opt.step()
        ref_opt.step()
    return max_relative_error([full(p) for p in params], [p.detach() for p in ref.parameters()]), owners(opt)


def scenarios(world: int, rank: int) -> dict:
    results = {"errors": {}, "owners": {}}
    for name, (kind, options) in ALGORITHMS.items():
        error, mine = fsdp_run(kind, options, world, rank)
        results["errors"][f"fsdp/{name}"] = error
        results["owners"][f"fsdp/{name}"] = gathered(mine)
        if world == 4:
            error, mine = rows_and_columns_run(kind, options)
            results["errors"][f"rows_columns/{name}"] = error
            results["owners"][f"rows_columns/{name}"] = gathered(mine)
    return results


def worker(rank: int, world: int, out_path: str) -> None:
    gloo.run_and_report(rank, world, out_path, lambda: scenarios(world, rank))


if __name__ == "__main__":  # manual run: python tests/owners_worker.py WORLD OUT.json
    gloo.spawn(worker, (int(sys.argv[1]), sys.argv[2]), int(sys.argv[1]), f"{sys.argv[2]}.store")
    print(open(sys.argv[2]).read())
