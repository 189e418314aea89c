"""Spawned-worker side of tests/test_sharded_blocks.py: per-block groups (num_heads,
split_sizes) on sharded layouts (gloo), each against one process stepping separate per-block
parameters (tests/test_blocks.py shows that equals the fused weight on one device).

Layouts: FSDP2 Shard(0) on 2 ranks (DTensors cut by distribute_tensor, as fully_shard does),
and torchtitan's FSDP2 + TP recipe on a (dp=2, tp=2) mesh (tests/layouts_worker.py): column-
parallel weights (_StridedShard(0, sf=2), Shard(0)), row-parallel ones (Shard(0), Shard(1));
HSDP (Replicate(), Shard(0)) and expert stacks (Shard(1), Shard(0)) on the same 4 ranks.
Gradients are full tensors drawn on every rank and cut by DTensor. A DCP checkpoint of per-block
state saved on (dp, tp) is loaded on FSDP2 over the 4 ranks. The same processes run
CapturedStep's scenarios (tests/captured_scenarios.py) on the FSDP2 and (dp, tp) meshes. Rank 0
writes the results to a JSON file. Not a test module (no test_ prefix).
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import captured_scenarios
import gloo
from dion3 import Dion3
from layouts_worker import Block, cut, full, grads_for, max_relative_error, recipe

STEPS = 3
MOVED = 1e-5  # a change beyond weight decay larger than this: the row was selected (compare)
SETTINGS = dict(lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz", stacked=True)  # 3-D: expert stacks
ALGORITHMS = {
    "muon": {"algorithm": "muon"},
    "normuon": {"algorithm": "normuon"},
    "dion3_global": {"algorithm": "dion3", "fraction": 0.3, "selection_scope": "global"},
    "dion2": {"algorithm": "dion2", "fraction": 0.3, "selection_scope": "global"},
}
# FSDP2 on 2 ranks: a GQA-like fused QKV of 16 rows (q 8, k 4, v 4: whole blocks per rank),
# uneven blocks that straddle the rank boundary (6, 5, 5), 10 rows cut 5/5 with blocks (6, 2, 2),
# and 4 heads of 4 rows (whole heads per rank). Two weights of each shape: buckets of several.
FSDP_CASES = {
    "gqa": ((16, 8), {"split_sizes": (8, 4, 4)}),
    "straddling": ((16, 8), {"split_sizes": (6, 5, 5)}),
    "odd_rows": ((10, 6), {"split_sizes": (6, 2, 2)}),
    "heads": ((16, 8), {"num_heads": 4}),
}


def sizes_of(rows: int, option: dict) -> list[int]:
    if "split_sizes" in option:
        return list(option["split_sizes"])
    return [rows // option["num_heads"]] * option["num_heads"]


def compare(fused, groups, settings, steps=STEPS, reload=False) -> dict:
    """Step `fused` (DTensors; groups: [(params, option)]) and their blocks as separate
    parameters on one process; relative error of the weights and of the momentum state, and
    whether the last step moved the same rows (beyond weight decay) on both sides."""
    hyper = {**SETTINGS}
    fused_groups = [dict(params=ps, **option, **settings) for ps, option in groups]
    sizes = {id(p): sizes_of(p.shape[-2], option) for ps, option in groups for p in ps}
    separate = {id(p): [torch.nn.Parameter(b.clone()) for b in full(p).split(sizes[id(p)], dim=-2)] for p in fused}
    opt = Dion3(fused_groups, **hyper)
    ref = Dion3([dict(params=[b for p in fused for b in separate[id(p)]], **settings)], **hyper)
    for step in range(steps):
        if reload and step == steps - 1:  # state_dict round trip into a fresh optimizer
            saved = opt.state_dict()
            opt = Dion3([dict(params=ps, **option, **settings) for ps, option in groups], **hyper)
            opt.load_state_dict(saved)
        grads = grads_for([tuple(p.shape) for p in fused], step)
        before = [full(p) for p in fused]
        for p, g in zip(fused, grads):
            p.grad = cut(g, p)
            for b, gb in zip(separate[id(p)], g.split(sizes[id(p)], dim=-2)):
                b.grad = gb.clone()
        opt.step()
        ref.step()
    joined = [torch.cat([b.detach() for b in separate[id(p)]], dim=-2) for p in fused]
    weights = max_relative_error([full(p) for p in fused], joined)
    momentum = max_relative_error([full(opt.state[p]["momentum"]) for p in fused],
                                  [torch.cat([ref.state[b]["momentum"] for b in separate[id(p)]], dim=-2) for p in fused])
    decay = 1 - hyper["lr"] * hyper["weight_decay"]
    before_joined = [t * decay for t in before]
    # A moved row changes by ~lr·|update| (≥ 1e-3 here); an unselected one by the rounding of its
    # decay, up to an ulp of |x| ≤ 4 (4.8e-7), which differs between CPUs (FMA or not).
    moved = [((full(p) - b).abs() > MOVED).any(-1).nonzero().tolist() for p, b in zip(fused, before_joined)]
    ref_moved = [((j - b).abs() > MOVED).any(-1).nonzero().tolist() for j, b in zip(joined, before_joined)]
    placements = sorted({str(tuple(p.placements)) for p in fused})
    rows_sent = [None] * dist.get_world_size()  # bytes of rows (and their variances) each rank sent
    dist.all_gather_object(rows_sent, sum(v for k, v in opt.communication_bytes_by_kind.items() if k in ("rows", "variance")))
    return {"error": max(weights, momentum), "same_rows": moved == ref_moved, "placements": placements,
            "rows_sent": sum(rows_sent)}


def fsdp_params(mesh, shape, seed) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)], src_data_rank=None))
            for _ in range(2)]


def fsdp_scenarios(mesh) -> dict:
    out = {}
    for case, (shape, option) in FSDP_CASES.items():
        for name, settings in ALGORITHMS.items():
            params = fsdp_params(mesh, shape, 3)
            out[f"fsdp/{case}/{name}"] = compare(params, [(params, option)], settings)
    params = fsdp_params(mesh, (16, 8), 5)
    out["fsdp/heads/dion3_local"] = compare(params, [(params, {"num_heads": 4})],
                                            {"algorithm": "dion3", "fraction": 0.3, "selection_scope": "local"})
    params = fsdp_params(mesh, (16, 8), 6)
    out["fsdp/gqa/normuon_reload"] = compare(params, [(params, {"split_sizes": (8, 4, 4)})], ALGORITHMS["normuon"],
                                             reload=True)
    params = fsdp_params(mesh, (16, 8), 7)
    out["fsdp/straddling/dion3_global_reload"] = compare(params, [(params, {"split_sizes": (6, 5, 5)})],
                                                         ALGORITHMS["dion3_global"], reload=True)
    params = fsdp_params(mesh, (16, 8), 9)
    out["fsdp/straddling/dion3_local_definition"] = local_definition([(params, {"split_sizes": (6, 5, 5)})])
    return out


def local_definition(groups) -> bool:
    """Dion3 "local" on fused weights (groups: [(params, option)]), one step from zero momentum:
    the rows moved must be, per block and row shard (the ranks holding the same rows, whatever
    columns), the shard's top min(⌈f·b⌉, rows of the block it holds) rows of the block by full-
    row L1 norm of the gradient, b being the most rows of the block any shard holds. The row
    sets come from DTensor (a tensor of row numbers, cut like each parameter)."""
    fraction = 0.3
    params = [p for ps, _ in groups for p in ps]
    opt = Dion3([dict(params=ps, **option, algorithm="dion3", fraction=fraction, selection_scope="local")
                 for ps, option in groups], **SETTINGS)
    grads = grads_for([tuple(p.shape) for p in params], 0)
    before = [full(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = cut(g, p)
    opt.step()
    decay = 1 - SETTINGS["lr"] * SETTINGS["weight_decay"]
    same = True
    options = [option for ps, option in groups for _ in ps]
    for p, option, g, b in zip(params, options, grads, before):
        numbers = torch.arange(p.shape[0], dtype=torch.float32)[:, None].expand(p.shape).contiguous()
        local = cut(numbers, p).to_local()
        mine = sorted({int(v) for v in local[:, 0].tolist()}) if local.numel() else []
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        shards = sorted({tuple(rows) for rows in everyone})
        want, start = set(), 0
        for size in sizes_of(p.shape[0], option):
            shares = [[r for r in rows if start <= r < start + size] for rows in shards]
            block = max(len(s) for s in shares)
            for share in shares:
                take = min(math.ceil(round(fraction * block, 9)), len(share))
                if take:
                    score = g[share].abs().sum(-1)
                    want |= {share[i] for i in torch.argsort(score, descending=True)[:take].tolist()}
            start += size
        moved = set(((full(p) - b * decay).abs() > MOVED).any(-1).nonzero().squeeze(1).tolist())
        same = same and moved == want and len(want) > 0
    return same


def tp_scenarios(mesh) -> dict:
    """The recipe's weights: wq/wv/wo/down (8 rows) split (5, 3), up (12 rows) split (6, 4, 2),
    wk (4 rows) in 2 heads."""
    out = {}
    for name, settings in ALGORITHMS.items():
        model, _ = recipe(mesh)
        named = {n.split(".")[0]: p for n, p in model.named_parameters()}
        groups = [([named[n] for n in ("wq", "wv", "wo", "down")], {"split_sizes": (5, 3)}),
                  ([named["up"]], {"split_sizes": (6, 4, 2)}),
                  ([named["wk"]], {"num_heads": 2})]
        out[f"dp_tp/{name}"] = compare([p for ps, _ in groups for p in ps], groups, settings)
    model, _ = recipe(mesh, dim=16, hidden=24)
    named = {n.split(".")[0]: p for n, p in model.named_parameters()}
    out["dp_tp/dion3_local_definition"] = local_definition(
        [([named[n] for n in ("wq", "wv", "wo", "down")], {"split_sizes": (10, 6)}),
         ([named["up"]], {"split_sizes": (12, 8, 4)}), ([named["wk"]], {"num_heads": 2})])
    # HSDP on the same 4 ranks: rows sharded over "tp" (the shard axis), replicated over "dp"
    for name, settings in ALGORITHMS.items():
        gen = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(16, 8, generator=gen), mesh, [Replicate(), Shard(0)],
                                                       src_data_rank=None)) for _ in range(2)]
        out[f"hsdp/{name}"] = compare(params, [(params, {"split_sizes": (6, 5, 5)})], settings)
    # expert stacks [E, out, in]: experts over "tp" (as an expert axis), each expert's rows over "dp"
    for name, settings in ALGORITHMS.items():
        gen = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(4, 10, 6, generator=gen), mesh, [Shard(1), Shard(0)],
                                                       src_data_rank=None))]
        out[f"experts/{name}"] = compare(params, [(params, {"split_sizes": (6, 4)})], settings)
    return out


def recipe_groups(model) -> list:
    named = {n.split(".")[0]: p for n, p in model.named_parameters()}
    return [([named[n] for n in ("wq", "wv", "wo", "down")], {"split_sizes": (5, 3)}),
            ([named["up"]], {"split_sizes": (6, 4, 2)}), ([named["wk"]], {"num_heads": 2})]


def checkpoint_error(mesh, world: int, directory: str) -> float:
    """Dion3 (global) per-block groups on the (dp=2, tp=2) recipe for 2 steps → DCP save → load
    into the same groups on FSDP2 over all 4 ranks (the blocks cut differently) → 1 step, against
    one process stepping the blocks as separate parameters for 3 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    settings = ALGORITHMS["dion3_global"]
    model, reference = recipe(mesh)
    groups, ref_groups = recipe_groups(model), recipe_groups(reference)
    sizes = [sizes_of(p.shape[0], option) for ps, option in ref_groups for p in ps]
    ref_params = [p for ps, _ in ref_groups for p in ps]
    separate = [[torch.nn.Parameter(b.detach().clone()) for b in p.split(n, dim=0)] for p, n in zip(ref_params, sizes)]
    ref_opt = Dion3([dict(params=[b for bs in separate for b in bs], **settings)], **SETTINGS)

    def step(groups, opt, ref_step):
        params = [p for ps, _ in groups for p in ps]
        grads = grads_for([tuple(p.shape) for p in params], ref_step)
        for p, g in zip(params, grads):
            p.grad = cut(g, p)
        opt.step()

    def make(groups):
        return Dion3([dict(params=ps, **option, **settings) for ps, option in groups], **SETTINGS)

    opt = make(groups)
    for number in range(3):
        grads = grads_for([tuple(p.shape) for p in ref_params], number)
        for bs, g, n in zip(separate, grads, sizes):
            for b, gb in zip(bs, g.split(n, dim=0)):
                b.grad = gb.clone()
        ref_opt.step()
    for number in range(2):
        step(groups, opt, number)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{directory}/blocks")

    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = Block(8, 12, seed=1)  # other weights: the checkpoint must replace them
    fully_shard(model, mesh=flat)
    groups = recipe_groups(model)
    opt = make(groups)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{directory}/blocks")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step(groups, opt, 2)
    params = [p for ps, _ in groups for p in ps]
    return max_relative_error([full(p) for p in params], [torch.cat([b.detach() for b in bs]) for bs in separate])


def worker(rank: int, world: int, out_path: str, which: str) -> None:
    def scenarios() -> dict:
        if which == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
            results = fsdp_scenarios(mesh)
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            results = tp_scenarios(mesh)
            results["dcp/dp_tp_to_fsdp"] = checkpoint_error(mesh, world, os.path.dirname(out_path))
        results["captured"] = captured_scenarios.scenarios(mesh)  # CapturedStep (CPU stand-ins)
        return results

    gloo.run_and_report(rank, world, out_path, scenarios)
