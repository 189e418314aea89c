"""Spawned-worker side of tests/test_distributed.py: gloo process groups on loopback.

Each worker runs every scenario against a plain single-process run of the same optimizer on
the same full matrices and gradients (computed redundantly on every rank), and rank 0 writes
the measured errors, moved-row counts and per-rank byte counts to a JSON file that the tests
assert on. Not a test module itself (no test_ prefix).
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import gloo
from dion3 import Dion3, Muon, NorMuon
from dion3.distributed import local_row_span
from dion3.ortho import cpu_compute_dtype

# Mixed shapes in one group: repeated shapes (bucket of 3, not a multiple of W), tall and
# wide matrices, 3 rows (a zero-row shard at W=4) and 5 rows (uneven 2/2/1/0 at W=4).
MIXED = [(16, 24), (24, 16), (3, 8), (16, 24), (5, 7), (16, 24)]
# Larger rows so that f·⌈rows/W⌉ is not dominated by rounding: for the byte budgets.
TRAFFIC = [(64, 48)] * 5 + [(32, 40)] * 3
# Three buckets of two matrices (fewer than 4 ranks), in the order the buckets are built:
# (12, 8), (10, 6), (7, 9), of three different costs. See test_small_fsdp_buckets_spread_over_the_ranks.
SPREAD = [(12, 8), (10, 6), (7, 9), (12, 8), (10, 6), (7, 9)]
# A bucket of 5 beside a bucket of one: without its first matrix on some steps, its 4
# remaining matrices keep their owners.
SPREAD_SUBSET = [(7, 9)] + [(10, 6)] * 5
STEPS = 3
OPTIMIZERS = {"muon": Muon, "normuon": NorMuon, "dion3": Dion3}


class Matrices(torch.nn.Module):
    def __init__(self, shapes, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes)


def full_grads(shapes, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) for s in shapes]


def make_optimizer(kind: str, params, mesh, **options):
    settings = dict(lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz")
    settings.update(options)
    return OPTIMIZERS[kind](params, distributed_mesh=mesh, **settings)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


class Run:
    """One model on one layout ("fsdp": fully_shard Shard(0), "ddp": replicated + ProcessGroup)."""

    def __init__(self, layout: str, shapes, mesh, world: int, rank: int):
        self.layout, self.shapes, self.world, self.rank = layout, shapes, world, rank
        self.model = Matrices(shapes, seed=7)
        if layout == "fsdp":
            fully_shard(self.model, mesh=mesh)
            self.mesh = mesh
        else:
            self.mesh = dist.group.WORLD
        self.params = list(self.model.parameters())

    def set_grads(self, grads) -> None:
        for p, g in zip(self.params, grads):
            if isinstance(p, DTensor):
                start, stop = local_row_span(g.shape[0], self.world, self.rank)
                p.grad = DTensor.from_local(g[start:stop].clone(), p.device_mesh, [Shard(0)], run_check=False,
                                            shape=g.shape, stride=g.stride())
            else:
                p.grad = g.clone()

    def weights(self) -> list[torch.Tensor]:
        return [full(p) for p in self.params]


def spread_owners(shapes, world: int):
    """The owner rule, restated by hand for the Muon byte counts: per bucket (same shape, in
    order of appearance), its member indices and each one's owner. Longest processing time
    first over every matrix: the heaviest (ties: the earlier) to the least loaded rank (ties:
    the lower), each bucket's owners then in rank order. A Muon matrix costs its owner the
    bytes of its rows in and out (∝ rows·cols at one wire dtype) plus its Newton–Schulz FLOPs;
    here the cost is rows·cols alone, which splits TRAFFIC as the planner does: its (64, 48)
    matrices outweigh its (32, 40) ones 2.4× in bytes and 3.5× in FLOPs, and the one close
    call (W = 2: a third (32, 40) onto rank 1, 2·64·48 + 3·32·40 against 3·64·48) holds in
    both."""
    order = sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1], i))
    loads, owner = [0] * world, {}
    for i in order:
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += shapes[i][0] * shapes[i][1]
    for shape in sorted(set(shapes), key=shapes.index):
        members = [i for i, s in enumerate(shapes) if s == shape]
        yield shape, members, sorted(owner[i] for i in members)


def owned_counts(opt) -> list[list[int]]:
    """Per rank, the matrices it orthogonalizes in each row-sharded bucket (build order)."""
    from dion3.distributed import ShardedBucket

    mine = [len(b.owned(b.rank)) for group in opt._buckets for b in group if isinstance(b, ShardedBucket)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def gathered_strings(value: str) -> list[str]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def max_relative_error(got, want) -> float:
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want))


def compare_to_single(layout, shapes, kind, mesh, world, rank, steps=STEPS, without_grad=None, **options):
    """Max relative error against the single-process optimizer, and per-rank bytes of the last step.
    without_grad(step) -> indices of parameters that get no gradient in that step (on every rank)."""
    run = Run(layout, shapes, mesh, world, rank)
    ref = Matrices(shapes, seed=7)
    opt = make_optimizer(kind, run.params, run.mesh, **options)
    ref_opt = make_optimizer(kind, list(ref.parameters()), None, **options)
    for step in range(steps):
        grads = full_grads(shapes, step)
        run.set_grads(grads)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        for i in without_grad(step) if without_grad else ():
            run.params[i].grad = None
            list(ref.parameters())[i].grad = None
        opt.step()
        ref_opt.step()
    error = max_relative_error(run.weights(), [p.detach() for p in ref.parameters()])
    return error, gather_ints(opt.communication_bytes), run, opt


def local_scope_error(mesh, world, rank, fraction=0.25) -> float:
    """FSDP2 Dion3 with local selection against a one-process float64 emulation of the rule
    (tests/reference.py): each rank's shard (torch.chunk rows) contributes its own top
    min(⌈f·chunk⌉, rows held) rows, and their union is orthogonalized as one matrix."""
    from reference import ReferenceOptimizer

    from dion3 import orthogonalize

    def local_selector(scores, k):
        rows = scores.shape[0]
        chunk = -(-rows // world)
        picked = []
        for start in range(0, rows, chunk):
            span = scores[start:start + chunk]
            take = min(math.ceil(round(fraction * chunk, 9)), span.shape[0])
            picked.append(torch.argsort(span, descending=True)[:take] + start)
        return torch.cat(picked)

    run = Run("fsdp", MIXED, mesh, world, rank)
    opt = make_optimizer("dion3", run.params, run.mesh, selection_scope="local", fraction=fraction)
    ref = ReferenceOptimizer(
        run.weights(), "dion3", lr=0.02, weight_decay=0.1, fraction=fraction, selector=local_selector,
        orthogonalizer=lambda u: orthogonalize(u, "newton_schulz", dtype=torch.float64),
    )
    for step in range(STEPS):
        grads = full_grads(MIXED, step)
        run.set_grads(grads)
        opt.step()
        ref.step(grads)
    return max_relative_error(run.weights(), [p.float() for p in ref.params])


def gather_ints(value: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(value))
    return out


def moved_rows(layout, shapes, mesh, world, rank, **options) -> list[list[int]]:
    """Rows of each matrix that one Dion3 step moves (no weight decay), per rank's shard."""
    run = Run(layout, shapes, mesh, world, rank)
    opt = make_optimizer("dion3", run.params, run.mesh, weight_decay=0.0, **options)
    before = [p.to_local().clone() if isinstance(p, DTensor) else p.detach().clone() for p in run.params]
    run.set_grads(full_grads(shapes, 0))
    opt.step()
    after = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in run.params]
    mine = [int((a != b).any(dim=1).sum()) for a, b in zip(after, before)]
    out = [None] * world
    dist.all_gather_object(out, mine)
    return out


def fsdp_backward_error(mesh, optimizer_mesh=None) -> float:
    """Real fully_shard forward/backward (same batch on every rank) vs one process. For HSDP,
    `mesh` is 2-D (replicate, shard) and the optimizer gets its shard sub-mesh."""
    torch.manual_seed(3)
    layers = [torch.nn.Linear(12, 16, bias=False), torch.nn.Linear(16, 3, bias=False), torch.nn.Linear(3, 8, bias=False)]
    model = torch.nn.Sequential(*layers)
    ref = _copy(model)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer("dion3", list(model.parameters()), optimizer_mesh or mesh, selection_scope="global", fraction=0.5)
    ref_opt = make_optimizer("dion3", list(ref.parameters()), None, fraction=0.5)
    gloo.train_in_lockstep(((model, opt), (ref, ref_opt)), STEPS, 5, (6, 12))
    return max_relative_error([full(p) for p in model.parameters()], [p.detach() for p in ref.parameters()])


def nonfinite_raised(mesh, world, rank) -> list[bool]:
    """A NaN in rank 0's rows only: check_finite must raise on every rank (none may hang)."""
    run = Run("fsdp", MIXED, mesh, world, rank)
    opt = make_optimizer("dion3", run.params, mesh, check_finite=True)
    grads = full_grads(MIXED, 0)
    grads[0][0, 0] = float("nan")
    run.set_grads(grads)
    try:
        opt.step()
        raised = False
    except FloatingPointError:
        raised = True
    out = [None] * world
    dist.all_gather_object(out, raised)
    return out


def resume_error(mesh, world, rank) -> float:
    """Step 3 after state_dict() → load_state_dict() into a new optimizer vs an unbroken run."""
    options = dict(selection_scope="global", fraction=0.25)
    unbroken, resumed = Run("fsdp", MIXED, mesh, world, rank), Run("fsdp", MIXED, mesh, world, rank)
    first = make_optimizer("dion3", unbroken.params, mesh, **options)
    second = make_optimizer("dion3", resumed.params, mesh, **options)
    for step in range(STEPS):
        if step == STEPS - 1:
            saved = second.state_dict()
            second = make_optimizer("dion3", resumed.params, mesh, **options)
            second.load_state_dict(saved)
        for run, opt in ((unbroken, first), (resumed, second)):
            run.set_grads(full_grads(MIXED, step))
            opt.step()
    return max_relative_error(resumed.weights(), unbroken.weights())


def ddp_backward_error(world, rank) -> float:
    """Real DistributedDataParallel forward/backward (same batch everywhere) vs one process."""
    torch.manual_seed(4)
    ref = torch.nn.Sequential(torch.nn.Linear(10, 12, bias=False), torch.nn.Linear(12, 4, bias=False))
    model = torch.nn.parallel.DistributedDataParallel(_copy(ref))
    opt = make_optimizer("normuon", list(model.parameters()), dist.group.WORLD)
    ref_opt = make_optimizer("normuon", list(ref.parameters()), None)
    gloo.train_in_lockstep(((model, opt), (ref, ref_opt)), STEPS, 6, (5, 10))
    return max_relative_error([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()])


def _copy(module: torch.nn.Module) -> torch.nn.Module:
    clone = torch.nn.Sequential(*[torch.nn.Linear(l.in_features, l.out_features, bias=False) for l in module])
    clone.load_state_dict(module.state_dict())
    return clone


def rejected_layouts(mesh, world: int) -> dict:
    """The ValueError text for layouts the optimizer must refuse (None if it did not refuse)."""
    matrix = torch.randn(4 * world, 6)
    cases = {
        "dtensor_with_process_group": lambda: Muon([DTensor.from_local(matrix[:4].clone(), mesh, [Shard(0)], run_check=False,
                                                                      shape=matrix.shape, stride=matrix.stride())],
                                                   distributed_mesh=dist.group.WORLD),
    }
    return gloo.value_errors(cases)


def scenarios(world: int, rank: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    results: dict = {"errors": {}, "bytes": {}, "moved": {}}
    for layout in ("fsdp", "ddp"):
        for name, kind, options in (
            ("muon", "muon", {}),
            ("muon_nesterov", "muon", {"nesterov": True}),
            ("normuon", "normuon", {}),
            ("dion3_global", "dion3", {"selection_scope": "global", "fraction": 0.25}),
            ("dion3_global_half", "dion3", {"selection_scope": "global", "fraction": 0.5}),
        ):
            error, _, _, _ = compare_to_single(layout, MIXED, kind, mesh, world, rank, **options)
            results["errors"][f"{layout}/{name}"] = error
    # "local" at f = 1 selects every row on every rank, so it must equal "global" at f = 1.
    local_run = compare_to_single("fsdp", MIXED, "dion3", mesh, world, rank, selection_scope="local", fraction=1.0)[2]
    global_run = compare_to_single("fsdp", MIXED, "dion3", mesh, world, rank, selection_scope="global", fraction=1.0)[2]
    results["errors"]["local_vs_global_f1"] = max_relative_error(local_run.weights(), global_run.weights())
    for scope in ("local", "global"):
        results["moved"][scope] = moved_rows("fsdp", MIXED, mesh, world, rank, selection_scope=scope, fraction=0.25)
    for layout in ("fsdp", "ddp"):
        for name, kind, options in (
            ("muon", "muon", {}),
            ("dion3_local", "dion3", {"selection_scope": "local", "fraction": 0.25}),
            ("dion3_global", "dion3", {"selection_scope": "global", "fraction": 0.25}),
        ):
            error, sent, _, _ = compare_to_single(layout, TRAFFIC, kind, mesh, world, rank, steps=2, **options)
            results["bytes"][f"{layout}/{name}"] = sent
            results["errors"][f"traffic/{layout}/{name}"] = error
    # MIXED's (16, 24) bucket (parameters 0, 3, 5) loses parameter 3's gradient on even steps;
    # the (24, 16) bucket has none on odd steps: the step must still match one process.
    def partial(step):
        return (3,) if step % 2 == 0 else (1,)

    for layout in ("fsdp", "ddp"):
        for name, kind, options in (("normuon", "normuon", {}), ("dion3_global", "dion3", {"selection_scope": "global"})):
            error, _, _, _ = compare_to_single(layout, MIXED, kind, mesh, world, rank, without_grad=partial, **options)
            results["errors"][f"partial/{layout}/{name}"] = error
    for name, kind, options in (("muon", "muon", {}), ("normuon", "normuon", {}),
                                ("dion3_global", "dion3", {"selection_scope": "global"})):
        error, _, _, opt = compare_to_single("fsdp", SPREAD, kind, mesh, world, rank, **options)
        results["errors"][f"spread/fsdp/{name}"] = error
    results["owned"] = owned_counts(opt)
    error, _, _, opt = compare_to_single("fsdp", SPREAD_SUBSET, "normuon", mesh, world, rank,
                                         without_grad=lambda step: (1,) if step % 2 == 0 else ())
    results["errors"]["spread_subset/fsdp/normuon"] = error
    results["owned_subset"] = owned_counts(opt)
    results["ns_dtype"] = gathered_strings(str(cpu_compute_dtype(7)))  # the dtype of (7, 9) (its Gram side: 7 rows)
    results["errors"]["local_scope/fsdp/dion3"] = local_scope_error(mesh, world, rank)
    results["rejected"] = rejected_layouts(mesh, world)
    results["nonfinite_raised"] = nonfinite_raised(mesh, world, rank)
    results["errors"]["fsdp_backward/dion3_global"] = fsdp_backward_error(mesh)
    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        results["errors"]["hsdp_backward/dion3_global"] = fsdp_backward_error(hsdp, hsdp["shard"])
    results["errors"]["resume/fsdp_dion3_global"] = resume_error(mesh, world, rank)
    results["errors"]["ddp_backward/normuon"] = ddp_backward_error(world, rank)
    return results


def worker(rank: int, world: int, out_path: str) -> None:
    gloo.run_and_report(rank, world, out_path, lambda: scenarios(world, rank))


if __name__ == "__main__":  # manual run: python tests/distributed_worker.py WORLD OUT.json
    gloo.spawn(worker, (int(sys.argv[1]), sys.argv[2]), int(sys.argv[1]), f"{sys.argv[2]}.store")
    print(open(sys.argv[2]).read())
