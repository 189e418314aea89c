"""The world mesh as `distributed_mesh`, run inside the (dp=2, tp=2) worker of
tests/layouts_worker.py and asserted in tests/test_distributed_layouts.py.

An FSDP2 + TP model on (dp=2, tp=2) as torchtitan builds it, where only some layers are tensor
parallel: the attention/MLP block is parallelized on world["tp"] and then every parameter is
sharded by fully_shard on world["dp"], so the block's matrices live on the 2-D world mesh and the
other layers' (a projection, a 4-row router, a norm gain) on the 1-D sub-mesh world["dp"].
Each optimizer is built three times on fresh copies: given the world mesh, given None (each
parameter's own mesh), and in one process; and the meshes the check accepts or refuses are
listed. Not a test module.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import gloo
from layouts_worker import PLAN, Block, cut, full, grads_for, max_relative_error
from dion3 import Dion3, Muon, NorMuon, orthogonalize
from dion3.distributed.mesh import within_mesh

STEPS = 3
SETTINGS = dict(lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz")
SCENARIOS = {  # name: (optimizer, options)
    "muon": (Muon, {}),
    "normuon": (NorMuon, {}),
    "dion3_global": (Dion3, {"selection_scope": "global", "fraction": 0.25}),
    "dion3_local": (Dion3, {"selection_scope": "local", "fraction": 0.25}),
}


class Mixed(nn.Module):
    """A tensor-parallel block beside layers that stay FSDP-only."""

    def __init__(self, dim: int = 8, hidden: int = 12, seed: int = 0):
        super().__init__()
        self.block = Block(dim, hidden, seed)  # seeds the generator itself
        self.proj = nn.Linear(dim, dim, bias=False)
        self.router = nn.Linear(dim, 4, bias=False)
        self.norm = nn.RMSNorm(dim)
        with torch.no_grad():
            self.norm.weight.normal_()


def build(world):
    model, reference = Mixed(), Mixed()
    parallelize_module(model.block, world["tp"], PLAN)
    fully_shard(model, mesh=world["dp"])
    return model, reference


def groups(model: nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    gains = [p for p in model.parameters() if p.dim() == 1]
    return [dict(params=matrices), dict(params=gains, algorithm="adamw", lr=0.01)]


def train(model: nn.Module, factory, options: dict, mesh_arg=None) -> nn.Module:
    opt = factory(groups(model), distributed_mesh=mesh_arg, **SETTINGS, **options)
    shapes = [tuple(p.shape) for p in model.parameters()]
    for step in range(STEPS):
        for p, g in zip(model.parameters(), grads_for(shapes, step)):
            p.grad = cut(g, p)
        opt.step()
    return model


def row_shards(params) -> list[list[tuple[int, ...]]]:
    """Per parameter, the distinct sets of global rows the ranks hold (from DTensor itself: a
    tensor of row numbers cut as the parameter is)."""
    out = []
    for p in params:
        numbers = torch.arange(p.shape[0], dtype=torch.float32)[:, None].expand(p.shape).contiguous()
        local = cut(numbers, p).to_local()
        mine = sorted({int(v) for v in local[:, 0].tolist()}) if local.shape[1] else []
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out.append(sorted({tuple(rows) for rows in everyone if rows}))
    return out


def local_definition(params, fraction: float) -> list[torch.Tensor]:
    """Dion3 "local" in one process (float64 reference of tests/reference.py): each row shard
    picks its own top min(⌈f·b⌉, rows held) rows by full-row L1 score, b the most rows a shard
    holds; the AdamW gains are not part of it."""
    from reference import ReferenceOptimizer

    matrices = [p for p in params if p.dim() == 2]
    shards = iter([])

    def selector(scores, k):
        blocks = next(shards)
        block = max(len(b) for b in blocks)
        picked = []
        for rows in blocks:
            index = torch.tensor(rows)
            take = min(math.ceil(round(fraction * block, 9)), len(rows))
            picked.append(index[torch.argsort(scores[index], descending=True)[:take]])
        return torch.cat(picked)

    every = row_shards(matrices)
    ref = ReferenceOptimizer([full(p) for p in matrices], "dion3", lr=SETTINGS["lr"], weight_decay=SETTINGS["weight_decay"],
                             fraction=fraction, selector=selector,
                             orthogonalizer=lambda u: orthogonalize(u, "newton_schulz", dtype=torch.float64))
    shapes = [tuple(p.shape) for p in params]
    for step in range(STEPS):
        grads = grads_for(shapes, step)
        shards = iter(every)
        ref.step([g for p, g in zip(params, grads) if p.dim() == 2])
    return [p.float() for p in ref.params]


def scenarios(world) -> dict:
    out = {"errors": {}, "world_vs_none": {}, "meshes": {}}
    probe, _ = build(world)
    out["meshes"]["params"] = {n: list(p.device_mesh.mesh_dim_names) for n, p in probe.named_parameters()}
    for name, (factory, options) in SCENARIOS.items():
        given = train(build(world)[0], factory, options, mesh_arg=world)
        own = train(build(world)[0], factory, options, mesh_arg=None)
        out["world_vs_none"][name] = max(float((full(a) - full(b)).abs().max())
                                         for a, b in zip(given.parameters(), own.parameters()))
        if options.get("selection_scope") == "local":  # matrices only: the gains' AdamW is not in the definition
            got = [full(p) for p in given.parameters() if p.dim() == 2]
            want = local_definition(list(build(world)[0].parameters()), options["fraction"])
        else:  # every parameter, the AdamW gains included
            got = [full(p) for p in given.parameters()]
            want = [p.detach() for p in train(build(world)[1], factory, options).parameters()]
        out["errors"][name] = max_relative_error(got, want)
    out["meshes"].update(mesh_checks(world))
    out["rejected"] = other_root_refused(world)
    return out


def mesh_checks(world) -> dict:
    """within_mesh(mesh, world) for meshes cut from the world and for meshes of other roots."""
    again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # equal to world: the same layout
    transposed = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))  # another rank layout
    cases = {"world": world, "world_dp": world["dp"], "world_tp": world["tp"], "equal_root": again,
             "equal_root_dp": again["dp"], "other_root": transposed, "other_root_dp": transposed["dp"],
             "other_root_tp": transposed["tp"]}
    if hasattr(world, "_flatten"):
        cases["world_flattened"] = world["dp", "tp"]._flatten("dp_tp")
    accepted = {name: within_mesh(mesh, world) for name, mesh in cases.items()}
    accepted["world_in_world_dp"] = within_mesh(world, world["dp"])  # the bigger mesh is no sub-mesh
    return {"within_world": accepted}


def other_root_refused(world) -> dict:
    """A parameter on the dp axis of a mesh with another rank layout, given the world mesh."""
    transposed = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))
    torch.manual_seed(3)
    foreign = nn.Parameter(distribute_tensor(torch.randn(8, 6), transposed["dp"], [Shard(0)], src_data_rank=None))
    mine = nn.Parameter(distribute_tensor(torch.randn(8, 6), world["dp"], [Shard(0)], src_data_rank=None))
    return gloo.value_errors({
        "other_root_dp": lambda: Dion3([foreign], distributed_mesh=world),
        "world_dp": lambda: Dion3([mine], distributed_mesh=world),
    })

