"""Spawned-worker side of tests/test_distributed_layouts.py: the layouts of large-model training
on gloo, each against one process.

Layouts: torchtitan's recipe on a (dp=2, tp=2) mesh (parallelize_module with ColwiseParallel /
RowwiseParallel, then fully_shard on dp: column-parallel weights get (_StridedShard(0, sf=2),
Shard(0)), row-parallel ones (Shard(0), Shard(1))); HSDP + TP on (replicate=2, shard=2, tp=2);
expert stacks [E, out, in] sharded over an expert axis, alone or with their rows sharded over a
dp axis; convolution kernels through param_groups under FSDP2; param_groups' fractions by cost and with
the most rows on the recipe. Gradients are full tensors drawn on every rank and cut by DTensor itself
(distribute_tensor with src_data_rank=None), so the distributed and the one-process optimizers
see the same numbers. Rank 0 writes the results to a JSON file. Not a test module.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gloo
from graph_standin import captured_region
from dion3 import Dion3, Muon, NorMuon, param_groups
from dion3.distributed import matrix_layout

OPTIMIZERS = {"muon": Muon, "normuon": NorMuon, "dion3": Dion3}
STEPS = 3
SETTINGS = dict(lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz")


class Block(torch.nn.Module):
    """Attention projections and an MLP, as torchtitan parallelizes them (no compute needed)."""

    def __init__(self, dim: int, hidden: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.wq, self.wk = torch.nn.Linear(dim, dim, bias=False), torch.nn.Linear(dim, dim // 2, bias=False)
        self.wv = torch.nn.Linear(dim, dim, bias=False)  # wq's layout: a bucket of two
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.up, self.down = torch.nn.Linear(dim, hidden, bias=False), torch.nn.Linear(hidden, dim, bias=False)


PLAN = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel(),
        "up": ColwiseParallel(), "down": RowwiseParallel()}


def recipe(mesh, dim=8, hidden=12, seed=0, dp=("dp",)):
    """torchtitan's order: tensor parallel on "tp", then fully_shard on the data-parallel axes."""
    model = Block(dim, hidden, seed)
    reference = Block(dim, hidden, seed)
    parallelize_module(model, mesh["tp"], PLAN)
    fully_shard(model, mesh=mesh[dp] if len(dp) > 1 else mesh[dp[0]])
    return model, reference


def full(t: torch.Tensor) -> torch.Tensor:
    return t.detach().full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def cut(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A full tensor as a DTensor laid out as `like`, cut by DTensor (no communication)."""
    if not isinstance(like, DTensor):
        return value.clone()
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def grads_for(shapes, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in shapes]


def max_relative_error(got, want) -> float:
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want))


def run_pair(params, ref_params, kind, steps=STEPS, mesh_arg=None, without_grad=(), **options):
    """The same optimizer on the distributed params and on one process; returns (error, bytes of
    the last step, rows moved by the last step per parameter on both sides). without_grad:
    (step, parameter index) pairs whose gradient is None on both sides."""
    options = {**SETTINGS, **options}
    opt = OPTIMIZERS[kind](params, distributed_mesh=mesh_arg, **options)
    ref = OPTIMIZERS[kind](ref_params, **options)
    shapes = [tuple(p.shape) for p in params]
    for step in range(steps):
        grads = grads_for(shapes, step)
        before = [full(p) for p in params], [p.detach().clone() for p in ref_params]
        for i, (p, r, g) in enumerate(zip(params, ref_params, grads)):
            p.grad, r.grad = (None, None) if (step, i) in without_grad else (cut(g, p), g.clone())
        opt.step()
        ref.step()
    moved = [_moved(before[0][i], full(p), options) for i, p in enumerate(params)]
    ref_moved = [_moved(before[1][i], r.detach(), options) for i, r in enumerate(ref_params)]
    error = max_relative_error([full(p) for p in params], [r.detach() for r in ref_params])
    return error, opt.communication_bytes, moved == ref_moved, opt


def _moved(before, after, options) -> list:
    """Rows that the step moved beyond weight decay (X ← (1 − lr·λ)X leaves the rest scaled)."""
    decayed = before * (1 - options["lr"] * options["weight_decay"])
    changed = ((after - decayed).abs() > 1e-7 * before.abs().max()).reshape(-1, after.shape[-2], after.shape[-1])
    return changed.any(dim=-1).nonzero().tolist()


def layout_checks(mesh) -> dict:
    """matrix_layout's indices against DTensor's own full_tensor(), for every recipe weight and
    for expert stacks; and that a (dp, tp) layout's local rows are not contiguous."""
    model, _ = recipe(mesh)
    out = {}
    for name, p in model.named_parameters():
        out[name] = [str(pl) for pl in p.placements] + [_matches(p, mesh)]
    experts = distribute_tensor(torch.randn(4, 6, 5), mesh, [Shard(1), Shard(0)], src_data_rank=None)
    out["experts"] = [str(pl) for pl in experts.placements] + [_matches(experts, mesh)]
    for name, shape, placements in UNEVEN:
        p = distribute_tensor(torch.randn(shape), mesh, placements, src_data_rank=None)
        out[name] = [str(pl) for pl in p.placements] + [_matches(p, mesh)]
    return out


def _uneven():
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [_StridedShard(0, split_factor=2), Shard(0)]
    return [("uneven_strided_7x5", (7, 5), strided), ("uneven_strided_3x10", (3, 10), strided),
            ("uneven_columns_6x3", (6, 3), [Shard(0), Shard(1)]), ("uneven_experts", (3, 5, 4), [Shard(1), Shard(0)]),
            ("columns_only_5x6", (5, 6), [Replicate(), Shard(1)])]


UNEVEN = _uneven()
# (replicate=2, shard=2, tp=2): rows over two axes and columns over the third (the row group is
# a product of axes); columns only (no row group)
UNEVEN_3D = [("rows_two_axes_10x6", (10, 6), [Shard(0), Shard(0), Shard(1)]),
             ("columns_only_5x6", (5, 6), [Replicate(), Replicate(), Shard(1)])]


def uneven_scenarios(mesh, cases=UNEVEN) -> dict:
    """Uneven pieces (7 or 3 rows over four row pieces: some ranks hold none; 3 columns over two
    column pieces; 3 experts over two ranks; columns split with rows whole) against one process."""
    errors = {}
    for name, kind, options in (("muon", "muon", {}), ("normuon", "normuon", {}),
                                ("dion3_global", "dion3", {"selection_scope": "global"})):
        gen = torch.Generator().manual_seed(11)
        weights = [(torch.randn(shape, generator=gen), placements) for _, shape, placements in cases]
        params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, pl, src_data_rank=None)) for w, pl in weights]
        ref = [torch.nn.Parameter(w.clone()) for w, _ in weights]
        errors[name] = run_pair(params, ref, kind, stacked=True, **options)[0]  # 3-D cases: expert stacks
    return errors


class Convolutions(torch.nn.Module):
    """Kernels (6, 4, 3) and (5, 3, 2, 2): one 6 × 12 and one 5 × 12 matrix (5 rows: uneven over dp=2)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = torch.nn.Conv1d(4, 6, 3, bias=False)
        self.conv2 = torch.nn.Conv2d(3, 5, 2, bias=False)


def conv_scenarios(mesh) -> dict:
    """Convolution kernels through dion3.param_groups (their group flattens each to one matrix),
    sharded by FSDP2 over dp, against one process; the one-process step of such a group is held
    to the float64 reference of the flattened matrix in tests/test_param_groups.py."""
    errors = {}
    for name, kind, options in (("muon", "muon", {}), ("normuon", "normuon", {}),
                                ("dion3_global", "dion3", {"selection_scope": "global", "fraction": 0.5})):
        model, reference = Convolutions(), Convolutions()
        fully_shard(model, mesh=mesh["dp"])
        groups, reference_groups = param_groups(model), param_groups(reference)
        if [g.get("flatten") for g in groups + reference_groups] != [True, True]:
            raise AssertionError(f"param_groups did not flatten the kernels: {groups}")
        opt = OPTIMIZERS[kind](groups, **SETTINGS, **options)
        ref = OPTIMIZERS[kind](reference_groups, **SETTINGS, **options)
        params, ref_params = list(model.parameters()), list(reference.parameters())
        for step in range(STEPS):
            for p, r, g in zip(params, ref_params, grads_for([tuple(r.shape) for r in ref_params], step)):
                p.grad, r.grad = cut(g, p), g.clone()
            opt.step()
            ref.step()
        errors[name] = max_relative_error([full(p) for p in params], [r.detach() for r in ref_params])
    return errors


def allocation_scenarios(mesh, dp=("dp",)) -> dict:
    """param_groups by cost and with the most rows on the tensor- and data-parallel recipe: the
    groups (name → fraction) come from the global shapes, so the sharded model gets the plain
    model's, and its steps match one process. dim 16, hidden 24: shapes on which the two
    allocations give different fractions (the test checks that they do)."""
    out = {}
    for allocation in ("cost", "most_rows"):
        model, reference = recipe(mesh, dim=16, hidden=24, dp=dp)
        options = dict(lm_head=False, fraction=0.5, fraction_allocation=allocation)
        groups, reference_groups = param_groups(model, **options), param_groups(reference, **options)
        fractions = [{n: g["fraction"] for g in gs for n in g["param_names"]} for gs in (groups, reference_groups)]
        opt = Dion3(groups, **SETTINGS, selection_scope="global")
        ref = Dion3(reference_groups, **SETTINGS, selection_scope="global")
        named, ref_named = dict(model.named_parameters()), dict(reference.named_parameters())
        names = list(ref_named)
        for step in range(STEPS):
            for name, g in zip(names, grads_for([tuple(ref_named[n].shape) for n in names], step)):
                named[name].grad, ref_named[name].grad = cut(g, named[name]), g.clone()
            opt.step()
            ref.step()
        out[allocation] = dict(fractions=fractions[0], reference_fractions=fractions[1],
                               error=max_relative_error([full(named[n]) for n in names],
                                                        [ref_named[n].detach() for n in names]))
    return out


def _matches(p: DTensor, mesh) -> bool:
    whole = p.detach().full_tensor()
    lay = matrix_layout(tuple(p.shape), p.placements, tuple(mesh.mesh.shape), mesh.get_coordinate(), False)
    whole = whole.reshape(-1, *whole.shape[-2:])
    want = whole[list(lay.batch)][:, list(lay.rows), lay.cols[0] : lay.cols[1]]
    return bool(torch.equal(want, p.to_local().reshape(want.shape)))


def recipe_scenarios(mesh, dp=("dp",)) -> dict:
    errors, moved = {}, {}
    for name, kind, options in (
        ("muon", "muon", {}),
        ("muon_nesterov", "muon", {"nesterov": True}),
        ("normuon", "normuon", {}),
        ("dion3_global", "dion3", {"selection_scope": "global", "fraction": 0.25}),
        # rows ranked by L2 norms: squared partial norms summed over the column shards
        ("dion3_global_l2", "dion3", {"selection_scope": "global", "fraction": 0.25, "row_score": "l2"}),
        # the unselected rows' momentum decayed: each rank decays the rows it holds
        ("dion3_global_unselected_decay", "dion3", {"selection_scope": "global", "fraction": 0.25,
                                                   "unselected_decay": 0.9}),
        ("normuon_mesh_given", "normuon", {"mesh_arg": mesh}),  # the full mesh as distributed_mesh
        # wv (parameter 2) shares wq's bucket: a step where only wq has a gradient
        ("dion3_global_partial", "dion3", {"selection_scope": "global", "without_grad": {(1, 2)}}),
        ("normuon_partial", "normuon", {"without_grad": {(0, 2), (2, 0)}}),
    ):
        model, ref = recipe(mesh, dp=dp)
        error, _, same_rows, _ = run_pair(list(model.parameters()), list(ref.parameters()), kind, **options)
        errors[name], moved[name] = error, same_rows
    return {"errors": errors, "same_rows": moved}


def local_scope_error(mesh, dp=("dp",)) -> float:
    """Dion3 "local" on the recipe against a float64 one-process emulation of its definition:
    each row shard (rows a rank holds, whatever columns) picks its own top
    min(⌈f·b⌉, rows held) rows by full-row L1 score, b = the most rows any shard holds. The row
    sets come from DTensor (a tensor of row numbers, cut by distribute_tensor)."""
    from reference import ReferenceOptimizer

    from dion3 import orthogonalize

    fraction = 0.25
    model, _ = recipe(mesh, dim=16, hidden=24, dp=dp)
    params = list(model.parameters())
    shards = []
    for p in params:
        numbers = torch.arange(p.shape[0], dtype=torch.float32)[:, None].expand(p.shape).contiguous()
        mine = sorted({int(v) for v in cut(numbers, p).to_local()[:, 0].tolist()}) if p.to_local().shape[1] else []
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        shards.append(sorted({tuple(rows) for rows in everyone if rows}))
    chosen = iter([])

    def selector(scores, k):
        blocks = next(chosen)
        block = max(len(b) for b in blocks)
        picked = []
        for rows in blocks:
            take = min(math.ceil(round(fraction * block, 9)), len(rows))
            index = torch.tensor(rows)
            picked.append(index[torch.argsort(scores[index], descending=True)[:take]])
        return torch.cat(picked)

    opt = Dion3(params, selection_scope="local", fraction=fraction, **SETTINGS)
    ref = ReferenceOptimizer([full(p) for p in params], "dion3", lr=0.02, weight_decay=0.1, fraction=fraction,
                             selector=selector,
                             orthogonalizer=lambda u: orthogonalize(u, "newton_schulz", dtype=torch.float64))
    for step in range(STEPS):
        grads = grads_for([tuple(p.shape) for p in params], step)
        for p, g in zip(params, grads):
            p.grad = cut(g, p)
        opt.step()
        chosen = iter(shards)
        ref.step(grads)
    return max_relative_error([full(p) for p in params], [p.float() for p in ref.params])


def traffic(mesh) -> dict:
    """Bytes each rank sends per step on the recipe with larger matrices, Muon vs Dion3 f=¼:
    {name: [per rank (communication_bytes, communication_bytes_by_kind)]}."""
    from dion3.ortho import precision

    out = {}
    # Rows counted in one wire dtype: on a CPU whose bf16 products are fast, Muon's 128-row Gram
    # sides would travel in bf16 and Dion3's 32 selected rows in float32 (the rule's 96-row
    # threshold), and the byte ratios would measure that rather than the rows sent.
    saved, precision._override = precision._override, torch.float32
    try:
        for name, kind, options in (("muon", "muon", {}),
                                    ("dion3_local", "dion3", {"selection_scope": "local"}),
                                ("dion3_local_unselected_decay", "dion3", {"selection_scope": "local",
                                                                           "unselected_decay": 0.9}),
                                    ("dion3_global", "dion3", {"selection_scope": "global"})):
            model, ref = recipe(mesh, dim=128, hidden=192)
            _, sent, _, opt = run_pair(list(model.parameters()), list(ref.parameters()), kind, steps=1, **options)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (sent, opt.communication_bytes_by_kind))
            out[name] = gathered
    finally:
        precision._override = saved
    return out


@contextlib.contextmanager
def counting_group_creation():
    """Yield a list that receives the rank lists of every dist.new_subgroups_by_enumeration
    call made inside the block (the process groups the optimizer's construction creates)."""
    created = []
    enumerate_groups = dist.new_subgroups_by_enumeration

    def counting(ranks, *args, **kwargs):
        created.append([list(r) for r in ranks])
        return enumerate_groups(ranks, *args, **kwargs)

    dist.new_subgroups_by_enumeration = counting
    try:
        yield created
    finally:
        dist.new_subgroups_by_enumeration = enumerate_groups


def owners_and_groups(mesh) -> dict:
    """On the recipe, before any other optimizer is built on this process group: the process
    groups that constructing Muon and then Dion3 (each on a fresh model, whose parameters carry
    DeviceMesh objects of their own) creates, counted at dist.new_subgroups_by_enumeration; and
    per rank, the matrices each rank orthogonalizes under each optimizer."""
    from dion3.distributed import LayoutBucket

    owned = {}
    with counting_group_creation() as created:
        for name, kind, options in (("muon", "muon", {}), ("dion3_global", "dion3", {"selection_scope": "global"})):
            model, _ = recipe(mesh, dim=128, hidden=192)
            opt = OPTIMIZERS[kind](list(model.parameters()), **SETTINGS, **options)
            mine = sum(len(b.owned(b.rank)) for group in opt._buckets for b in group if isinstance(b, LayoutBucket))
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            owned[name] = gathered
    return {"created": created, "owned": owned}


def expert_scenarios(world: int) -> dict:
    """A 3-D expert stack sharded over an expert axis alone (every rank holds whole experts: no
    bytes may move) and with each expert's rows sharded over dp as well, against one process."""
    out = {"errors": {}, "bytes": {}}
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    two_d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
    gen = torch.Generator().manual_seed(9)
    weights = [torch.randn(2 * world, 6, 5, generator=gen), torch.randn(2 * world, 5, 6, generator=gen)]
    for layout, mesh, placements in (("ep", ep_mesh, [Shard(0)]), ("ep_fsdp", two_d, [Shard(1), Shard(0)])):
        for name, kind, options in (("muon", "muon", {}), ("normuon", "normuon", {}),
                                    ("dion3_global", "dion3", {"selection_scope": "global"}),
                                    ("dion3_local", "dion3", {"selection_scope": "local", "fraction": 0.5})):
            params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, placements, src_data_rank=None))
                      for w in weights]
            ref = [torch.nn.Parameter(w.clone()) for w in weights]
            error, sent, same_rows, _ = run_pair(params, ref, kind, stacked=True, **options)
            if layout == "ep_fsdp" and name == "dion3_local":
                continue  # per-shard selection is its own rule once rows are split (recipe test)
            out["errors"][f"{layout}/{name}"] = error
            gathered = [None] * world
            dist.all_gather_object(gathered, sent)
            out["bytes"][f"{layout}/{name}"] = gathered
    return out


def host_syncs(mesh) -> dict:
    """Whether a step after the first (which builds the static plans) reads a device value on the
    host or copies a host list to the device: what a CUDA graph cannot capture (what does so
    raises inside graph_standin.captured_region). Global selection must (its split sizes go
    through the host), showing the check can fail."""
    out = {}
    for name, kind, options in (("muon", "muon", {}), ("normuon", "normuon", {}),
                                ("dion3_local", "dion3", {"selection_scope": "local"}),
                                ("dion3_local_unselected_decay", "dion3", {"selection_scope": "local",
                                                                           "unselected_decay": 0.9}),
                                ("dion3_global", "dion3", {"selection_scope": "global"})):
        model, _ = recipe(mesh)
        params = list(model.parameters())
        opt = OPTIMIZERS[kind](params, **SETTINGS, **options)
        for step in range(2):
            for p, g in zip(params, grads_for([tuple(p.shape) for p in params], step)):
                p.grad = cut(g, p)
            if step == 0:
                opt.step()
                continue
            try:
                with captured_region():
                    opt.step()
                out[name] = False
            except RuntimeError as error:
                if "host sync" not in str(error):
                    raise
                out[name] = True
        if out[name]:  # a rank that stopped early left collectives behind: start a fresh group state
            dist.barrier()
    return out


def checkpoint_errors(mesh, world: int, directory: str) -> dict:
    """Dion3 (global selection) on (dp=2, tp=2) for 3 steps → DCP save → load on (dp=4, FSDP2
    only) → 1 step → save → load in one process → 2 steps, against one uninterrupted process.
    Optimizer state entries are DTensors with each layout's placements, so DCP reshards them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = {**SETTINGS, "selection_scope": "global", "fraction": 0.25}
    reference = Block(8, 12, seed=0)
    ref_opt = Dion3(list(reference.parameters()), **options)
    shapes = [tuple(p.shape) for p in reference.parameters()]
    trajectory = []
    for step in range(6):
        for p, g in zip(reference.parameters(), grads_for(shapes, step)):
            p.grad = g
        ref_opt.step()
        trajectory.append([p.detach().clone() for p in reference.parameters()])

    def steps(model, opt, first, last):
        for step in range(first, last):
            for p, g in zip(model.parameters(), grads_for(shapes, step)):
                p.grad = cut(g, p)
            opt.step()

    def restore(model, opt, path, **load_options):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path, **load_options)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def save(model, opt, path):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    errors = {}
    model, _ = recipe(mesh)
    opt = Dion3(list(model.parameters()), **options)
    steps(model, opt, 0, 3)
    errors["dp_tp"] = max_relative_error([full(p) for p in model.parameters()], trajectory[2])
    save(model, opt, f"{directory}/dp_tp")

    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = Block(8, 12, seed=1)  # other weights: the checkpoint must replace them
    fully_shard(model, mesh=flat)
    opt = Dion3(list(model.parameters()), **options)
    restore(model, opt, f"{directory}/dp_tp")
    steps(model, opt, 3, 4)
    errors["dp4"] = max_relative_error([full(p) for p in model.parameters()], trajectory[3])
    save(model, opt, f"{directory}/dp4")
    dist.barrier()

    if dist.get_rank() == 0:
        model = Block(8, 12, seed=2)
        opt = Dion3(list(model.parameters()), **options)
        restore(model, opt, f"{directory}/dp4", no_dist=True)
        steps(model, opt, 4, 6)
        errors["one_process"] = max_relative_error([p.detach() for p in model.parameters()], trajectory[5])
    return errors


def rejected_layouts(mesh) -> dict:
    """The ValueError text for each layout the optimizer refuses (None if it did not refuse)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    def dtensor(shape, placements, on=mesh):
        return torch.nn.Parameter(distribute_tensor(torch.randn(shape), on, placements, src_data_rank=None))

    other = init_device_mesh("cpu", (4,), mesh_dim_names=("flat",))
    cases = {
        "partial": lambda: Muon([DTensor.from_local(torch.randn(4, 6), mesh, [Partial(), Replicate()],
                                                    run_check=False)]),
        "strided_columns": lambda: Muon([dtensor((8, 8), [_StridedShard(1, split_factor=2), Shard(1)])]),
        "flatten_sharded_dim1": lambda: Muon([dtensor((4, 4, 6), [Shard(1), Replicate()])], flatten=True),
        "dtensor_with_process_group": lambda: Muon([dtensor((8, 6), [Shard(0), Replicate()])],
                                                   distributed_mesh=dist.group.WORLD),
        "foreign_mesh": lambda: Muon([dtensor((8, 6), [Shard(0), Shard(1)])], distributed_mesh=other),
    }
    return gloo.value_errors(cases)


def pipeline_scenarios(world) -> dict:
    """(pp=2, dp=2, tp=2): each pipeline stage holds a model stage of its own (other seed, other
    hidden width), tensor parallel on world["tp"] and fully_shard on world["dp"], so every
    parameter lives on the sub-mesh world["dp", "tp"], whose rank tensor covers only this rank's
    stage. Muon and Dion3 (global selection), given that sub-mesh or None (each parameter's own
    mesh), against one process on the stage's parameters; the process groups that construction
    creates, counted at dist.new_subgroups_by_enumeration; and the members of each rank's group of
    the sub-mesh's two axes. Errors and members per global rank."""
    from dion3.distributed import axes_group
    from dion3.distributed import mesh as mesh_module

    stage = world.get_coordinate()[0]
    errors = {}
    with counting_group_creation() as created:
        for name, kind, options in (("muon", "muon", {}),
                                    ("dion3_global", "dion3", {"selection_scope": "global", "fraction": 0.25})):
            for given in ("sub_mesh", "none"):
                model, reference = recipe(world, hidden=12 + 4 * stage, seed=stage)
                mesh_arg = world["dp", "tp"] if given == "sub_mesh" else None
                error, _, same_rows, _ = run_pair(list(model.parameters()), list(reference.parameters()), kind,
                                                  mesh_arg=mesh_arg, **options)
                errors[f"{name}/{given}"] = (error, same_rows)
        members = dist.get_process_group_ranks(axes_group(world["dp", "tp"], (0, 1)).group)
        # without a readable root mesh (older or changed torch): every rank's slice, gathered
        saved_root, saved_groups = mesh_module._root_mesh, dict(mesh_module._GROUPS)
        mesh_module._root_mesh = lambda mesh: None
        mesh_module._GROUPS.clear()
        try:
            gathered_members = dist.get_process_group_ranks(axes_group(world["dp", "tp"], (0, 1)).group)
        finally:
            mesh_module._root_mesh = saved_root
            mesh_module._GROUPS.clear()
            mesh_module._GROUPS.update(saved_groups)
    enumerations = {"pp_tp": mesh_module.world_members(world["pp", "tp"], (0, 1)),
                    "pp_tp/tp": mesh_module.world_members(world["pp", "tp"], (1,))}
    if hasattr(world, "_flatten"):  # a flattened axis spans two root axes
        enumerations["dp_tp_flat"] = mesh_module.world_members(world["dp", "tp"]._flatten("dp_tp"), (0,))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"errors": errors, "members": members, "created": created,
                                      "gathered_members": gathered_members, "enumerations": enumerations})
    return {"ranks": gathered}


def worker(rank: int, world: int, out_path: str, which: str) -> None:
    gloo.start(rank, world, f"{out_path}.store")
    try:
        if which == "dp_tp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            results = {"owners": owners_and_groups(mesh), "layouts": layout_checks(mesh), **recipe_scenarios(mesh)}
            results["errors"]["local_scope"] = local_scope_error(mesh)
            results["uneven"] = uneven_scenarios(mesh)
            results["convolutions"] = conv_scenarios(mesh)
            results["allocations"] = allocation_scenarios(mesh)
            results["traffic"] = traffic(mesh)
            results["experts"] = expert_scenarios(world)
            results["rejected"] = rejected_layouts(mesh)
            results["host_syncs"] = host_syncs(mesh)
            results["checkpoint"] = checkpoint_errors(mesh, world, os.path.dirname(out_path))
            import world_mesh_worker  # the world mesh as distributed_mesh, on a model beside the recipe

            results["world_mesh"] = world_mesh_worker.scenarios(mesh)
        elif which == "pp_dp_tp":  # pipeline stages on one 3-D mesh, each on its sub-mesh (dp, tp)
            results = pipeline_scenarios(init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp")))
        else:  # HSDP + TP: (replicate=2, shard=2, tp=2)
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
            results = recipe_scenarios(mesh, dp=("replicate", "shard"))
            results["errors"]["local_scope"] = local_scope_error(mesh, dp=("replicate", "shard"))
            results["uneven"] = uneven_scenarios(mesh, UNEVEN_3D)
            results["allocations"] = allocation_scenarios(mesh, dp=("replicate", "shard"))
            model, _ = recipe(mesh, dp=("replicate", "shard"))
            results["placements"] = {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()}
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        gloo.stop()


if __name__ == "__main__":  # manual run: python tests/layouts_worker.py WORLD dp_tp|hsdp_tp|pp_dp_tp OUT.json
    gloo.spawn(worker, (int(sys.argv[1]), sys.argv[3], sys.argv[2]), int(sys.argv[1]), f"{sys.argv[3]}.store")
    print(open(sys.argv[3]).read())
