"""Spawned-worker side of tests/test_blocks_distributed.py: per-block groups under DDP (gloo).

Every rank steps fused weights (num_heads / split_sizes groups) with distributed_mesh = the
world ProcessGroup; the reference is one process stepping separate per-block parameters with
the same initial values and gradients (tests/test_blocks.py shows that equals the fused weight on
one device). Rank 0 writes the measured errors to a JSON file. Not a test module (no test_ prefix).
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import gloo
from distributed_worker import MIXED, Matrices, Run, full_grads, max_relative_error
from dion3 import Dion3

# Fused QKV-like weights: blocks of 8, 2 and 2 rows (k, v share a bucket), a 3-D batch, and
# a second weight of the same shape (repeated shapes: buckets of several entries, split 1/W).
SHAPES = [(12, 16), (12, 16), (2, 12, 6), (12, 16)]
SPLIT = (8, 2, 2)
HEADS = 3
STEPS = 3
ALGORITHMS = {
    "muon": {"algorithm": "muon"},
    "muon_nesterov": {"algorithm": "muon", "nesterov": True},
    "normuon": {"algorithm": "normuon"},
    "dion3": {"algorithm": "dion3", "fraction": 0.3},
    "dion3_global": {"algorithm": "dion3", "fraction": 0.3, "selection_scope": "global"},
    "dion2": {"algorithm": "dion2", "fraction": 0.3},
}


def blocks_of(tensor: torch.Tensor, sizes) -> list[torch.Tensor]:
    return list(tensor.split(list(sizes), dim=-2))


def fused_vs_separate(sizes, option: dict, settings: dict, without_grad=None) -> float:
    """DDP-stepped fused weights against one process stepping their blocks as parameters."""
    gen = torch.Generator().manual_seed(21)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    separate = [[torch.nn.Parameter(b.clone()) for b in blocks_of(t, sizes)] for t in start]
    hyper = dict(lr=0.03, weight_decay=0.1, orthogonalizer="newton_schulz", stacked=True)
    ddp_opt = Dion3([dict(params=fused, **option, **settings)], distributed_mesh=dist.group.WORLD, **hyper)
    one_opt = Dion3([dict(params=[b for blocks in separate for b in blocks], **settings)], **hyper)
    for step in range(STEPS):
        skipped = without_grad(step) if without_grad else ()
        for index, (p, blocks) in enumerate(zip(fused, separate)):
            g = torch.randn(p.shape, generator=gen)  # the same on every rank (same seed)
            p.grad = None if index in skipped else g.clone()
            for b, gb in zip(blocks, blocks_of(g, sizes)):
                b.grad = None if index in skipped else gb.clone()
        ddp_opt.step()
        one_opt.step()
    joined = [torch.cat([b.detach() for b in blocks], dim=-2) for blocks in separate]
    weights = max_relative_error([p.detach() for p in fused], joined)
    momentum = max_relative_error([ddp_opt.state[p]["momentum"] for p in fused],
                                  [torch.cat([one_opt.state[b]["momentum"] for b in blocks], dim=-2) for blocks in separate])
    return max(weights, momentum)


class FusedAttentionInput(torch.nn.Module):
    """A fused QKV projection (bias-free) followed by a plain output layer."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(10, sum(SPLIT), bias=False)
        self.out = torch.nn.Linear(sum(SPLIT), 4, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.qkv(x)))


def ddp_backward_error(world: int) -> float:
    """Real DistributedDataParallel forward/backward (same batch everywhere) with a split_sizes
    group for the fused weight, against the same model and optimizer on one process."""
    torch.manual_seed(8)
    ref = FusedAttentionInput()
    model = FusedAttentionInput()
    model.load_state_dict(ref.state_dict())
    model = torch.nn.parallel.DistributedDataParallel(model)

    def groups(net):
        return [dict(params=[net.qkv.weight], split_sizes=SPLIT), dict(params=[net.out.weight])]

    opt = Dion3(groups(model.module), distributed_mesh=dist.group.WORLD, lr=0.02, fraction=0.3)
    ref_opt = Dion3(groups(ref), lr=0.02, fraction=0.3)
    gloo.train_in_lockstep(((model, opt), (ref, ref_opt)), STEPS, 9, (5, 10))
    return max_relative_error([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()])


def scenarios(world: int, rank: int) -> dict:
    errors = {}
    for name, settings in ALGORITHMS.items():
        errors[f"split_sizes/{name}"] = fused_vs_separate(SPLIT, {"split_sizes": SPLIT}, settings)
        errors[f"num_heads/{name}"] = fused_vs_separate((4, 4, 4), {"num_heads": HEADS}, settings)
    # parameter 1 has no gradient on even steps, parameter 2 on odd ones
    def partial(step):
        return (1,) if step % 2 == 0 else (2,)

    errors["partial/split_sizes/dion3"] = fused_vs_separate(SPLIT, {"split_sizes": SPLIT}, ALGORITHMS["dion3"], partial)
    errors["ddp_backward/split_sizes/dion3"] = ddp_backward_error(world)
    errors["fsdp/dion2_global"] = fsdp_dion2_error(world, rank)
    return {"errors": errors}


def fsdp_dion2_error(world: int, rank: int) -> float:
    """Dion2 on FSDP2 (Shard(0), whole parameters: no blocks) with global selection, against one
    process: the sharded step without the per-row normalization (no variance travels)."""
    mesh = init_device_mesh("cpu", (world,))
    run, ref = Run("fsdp", MIXED, mesh, world, rank), Matrices(MIXED, seed=7)
    settings = dict(algorithm="dion2", fraction=0.25, selection_scope="global")
    hyper = dict(lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz")
    opt = Dion3([dict(params=run.params, **settings)], distributed_mesh=mesh, **hyper)
    ref_opt = Dion3([dict(params=list(ref.parameters()), **settings)], **hyper)
    for step in range(STEPS):
        grads = full_grads(MIXED, step)
        run.set_grads(grads)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        ref_opt.step()
    assert all(set(opt.state[p]) == {"momentum"} for p in run.params)
    return max_relative_error(run.weights(), [p.detach() for p in ref.parameters()])


def worker(rank: int, world: int, out_path: str) -> None:
    gloo.run_and_report(rank, world, out_path, lambda: scenarios(world, rank))
