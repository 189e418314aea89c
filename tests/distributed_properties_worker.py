"""Spawned-worker side of tests/test_distributed_properties.py: hypothesis inside gloo ranks.

One process group per world size runs every property. Examples are drawn by hypothesis with a
fixed seed, no database and no shrinking, so every rank draws the same ones; each example first
checks that all ranks drew it (a mismatch would hang the collectives). Every verdict is computed
from full tensors (all-gathered) and per-rank byte counts gathered to all ranks, so all ranks
pass or fail the same example together. A rank that crashes alone leaves the others waiting
until the gloo timeout (60 s); the test then shows every rank's traceback.
Each rank writes {property: {"examples", "failure", "seen"}} to OUT.rank<r>.json.
"""
from __future__ import annotations

import hashlib
import json
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

import gloo
from distributed_worker import Matrices, Run, full, make_optimizer, max_relative_error
from dion3.distributed import local_row_span
from test_properties import fractions, reference_k

TOLERANCE = 1e-5  # float32 Newton–Schulz, relative to the largest weight: as tests/test_distributed.py
MU = 0.8  # far enough from 1 that μ·(M+G) and M+G are told apart clearly
STEPS = 2
ALGORITHMS = {  # name → (optimizer kind, extra options)
    "muon": ("muon", {}),
    "muon_nesterov": ("muon", {"nesterov": True}),
    "normuon": ("normuon", {}),
    "dion3_global": ("dion3", {"selection_scope": "global"}),
    "dion3_local": ("dion3", {"selection_scope": "local"}),
    # the unselected rows' momentum decayed too (unselected_decay): told apart from μ and from 1
    "dion3_global_decay": ("dion3", {"selection_scope": "global", "unselected_decay": 0.5}),
}
# Row counts that leave a rank with zero rows (torch.chunk): 1 (W ≥ 2); 2, 3, 5, 6, 9 (W = 4).
ZERO_ROW_COUNTS = [1, 2, 3, 5, 6, 9]
# Common fractions (the draw from test_properties alone is mostly tiny f at tiny row counts).
FRACTIONS = st.one_of(st.sampled_from([0.1, 0.25, 1 / 3, 0.5, 0.75, 0.9]), fractions)
# 5 rows over 2 ranks (3 + 2) and 11 over 4 (3+3+3+2) at f = ½: a rank holding fewer rows than
# ⌈rows/W⌉ still selects ⌈f·⌈rows/W⌉⌉ = 2 of them, not ⌈f·held⌉ = 1.
SHARDED_LOCAL_EXAMPLE = dict(shapes=[(5, 6), (11, 4)], fraction=0.5, weight_decay=0.1, seed=3)
CLUSTER: dict = {}  # rank, world, mesh of this process, set by worker()


def shape_lists(min_rows=1, max_rows=40, min_cols=1, max_cols=16):
    """1–2 distinct shapes, each repeated 1–3 times (buckets of N not a multiple of W)."""
    rows = st.integers(min_rows, max_rows)
    if min_rows == 1:
        rows = st.one_of(rows, st.sampled_from(ZERO_ROW_COUNTS))
    shape = st.tuples(rows, st.integers(min_cols, max_cols))
    entry = st.tuples(shape, st.integers(1, 3))
    return st.lists(entry, min_size=1, max_size=2, unique_by=lambda e: e[0]).map(
        lambda entries: [s for s, n in entries for _ in range(n)]
    )


def example_settings(max_examples: int, seed: int = 0):
    """Same examples on every rank: a fixed hypothesis seed, no database, no shrinking (a
    shrink would still agree across ranks, but costs time), no time-based health checks."""
    options = settings(
        max_examples=max_examples, database=None, deadline=None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False,
    )
    return lambda test: options(hypothesis_seed(seed)(test))


def agree(*values) -> None:
    """Raise on every rank if the ranks drew different examples."""
    digest = int.from_bytes(hashlib.sha256(repr(values).encode()).digest()[:7], "big")
    mine = torch.tensor([digest], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(CLUSTER["world"])]
    dist.all_gather(everyone, mine)
    if any(int(t) != digest for t in everyone):
        raise RuntimeError(f"ranks drew different examples: {values!r}")


def gather_ints(value: int) -> list[int]:
    mine = torch.tensor([int(value)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(CLUSTER["world"])]
    dist.all_gather(everyone, mine)
    return [int(t) for t in everyone]


def gradients(shapes, seed: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 16 + step)
    return [torch.randn(s, generator=gen) for s in shapes]


def full_momentum(opt, params) -> list[torch.Tensor]:
    return [full(opt.state[p]["momentum"]) for p in params]


def selected_rows(before_m, after_m, grad, unselected: float = 1.0) -> torch.Tensor:
    """Rows whose momentum became μ·(M+G) (error feedback) rather than M+G (with unselected_decay
    d: d·(M+G)), in float64."""
    accumulated = before_m.double() + grad.double()
    slack = (before_m.double().abs() + grad.double().abs()) * 4e-5
    feedback = ((after_m.double() - MU * accumulated).abs() <= slack).all(dim=1)
    kept = ((after_m.double() - unselected * accumulated).abs() <= slack).all(dim=1)
    assert bool((feedback ^ kept).all()), "each momentum row is either μ·(M+G) or d·(M+G), unambiguously"
    return feedback


def moved_rows(before_x, after_x, decay: float) -> torch.Tensor:
    """Rows of X that are not just (1 − ηλ)·X rounded once to float32."""
    decayed = (before_x.double() * decay).float().double()
    return ((after_x.double() - decayed).abs() > torch.finfo(torch.float32).eps * decayed.abs()).any(dim=1)


def assert_top(scores: torch.Tensor, selected: torch.Tensor) -> None:
    """Selected rows score at least as high as unselected ones (up to float32 rounding)."""
    if selected.any() and (~selected).any():
        assert scores[selected].min() >= scores[~selected].max() * (1 - 1e-5), "a lower-scoring row was selected"


def planned_owners(opt) -> dict:
    """{matrix shape: the owner of each matrix of its bucket} as the optimizer's planner set
    them (owners by cost: tests/test_owners.py checks the rule), for the byte count."""
    return {tuple(b.shape): list(b.owner_of) for b in opt._buckets[0] if hasattr(b, "owner_of")}


def expected_bytes(layout, kind, scope, shapes, world, contributed, owners_of) -> list[int]:
    """Hand count of the bytes each rank sends (float32 rows, fp32 variance and scores, and under
    fsdp one float32 sum of squares per matrix all-reduced per bucket, counted as a ring; global
    selection also all-reduces one float32 verdict per matrix).
    contributed[s][i]: rows of matrix i that rank s sends for orthogonalization (fsdp), or
    the rows per matrix of the orthogonalized block (ddp, the same on every rank).
    owners_of: the owners of each fsdp bucket's matrices (planned_owners)."""
    sent = [0] * world
    for rows, cols in sorted(set(shapes), key=shapes.index):
        members = [i for i, s in enumerate(shapes) if s == (rows, cols)]
        owners = owners_of.get((rows, cols))
        if layout == "ddp":  # all-gather of ⌈N/W⌉ blocks of K×cols to W − 1 ranks
            for r in range(world):
                sent[r] += -(-len(members) // world) * contributed[r][members[0]] * cols * 4 * (world - 1)
            continue
        row_bytes = cols * 4 + (4 if kind != "muon" else 0)  # + one variance value per row
        chunk = -(-rows // world)
        for r in range(world):
            sent[r] += 2 * len(members) * 4 * (world - 1) // world  # the norms' all-reduce
            if kind == "dion3" and scope == "global":  # all-gather of one score per padded row
                sent[r] += len(members) * chunk * 4 * (world - 1)
                sent[r] += 2 * len(members) * 4 * (world - 1) // world  # the owners' verdicts, all-reduced
            for i, owner in zip(members, owners):
                if owner != r:  # my rows to the owner
                    sent[r] += contributed[r][i] * row_bytes
                else:  # the others' rows back to them
                    sent[r] += sum(contributed[s][i] for s in range(world) if s != r) * row_bytes
    return sent


def check_step(layout, name, shapes, fraction, decay, before, after, before_m, after_m, grads) -> list[list[int]]:
    """Row-movement invariants of one step; returns contributed[s][i] for the byte count."""
    world = CLUSTER["world"]
    kind, options = ALGORITHMS[name]
    contributed = [[0] * len(shapes) for _ in range(world)]
    for i, (rows, _) in enumerate(shapes):
        spans = [local_row_span(rows, world, s) for s in range(world)]
        if kind != "dion3":  # every row is orthogonalized and moves
            assert bool(moved_rows(before[i], after[i], decay).all()), f"{name}: a row of matrix {i} {shapes[i]} did not move"
            for s, (a, b) in enumerate(spans):
                contributed[s][i] = rows if layout == "ddp" else b - a
            continue
        selected = selected_rows(before_m[i], after_m[i], grads[i], options.get("unselected_decay", 1.0))
        moved = moved_rows(before[i], after[i], decay)
        scores = (before_m[i].double() + grads[i].double()).abs().sum(dim=1)
        assert torch.equal(selected, moved), f"{name}: moved rows {moved.nonzero().flatten().tolist()} are not " \
                                             f"the selected rows {selected.nonzero().flatten().tolist()} of matrix {i}"
        k = reference_k(rows, fraction)
        if layout == "fsdp" and options["selection_scope"] == "local":
            for s, (a, b) in enumerate(spans):
                want = min(reference_k(-(-rows // world), fraction), b - a)
                got = int(selected[a:b].sum())
                assert got == want, f"local scope: rank {s} moved {got} of its {b - a} rows of {shapes[i]}, want {want}"
                assert_top(scores[a:b], selected[a:b])
        else:
            assert int(selected.sum()) == k, f"{name}/{layout}: {int(selected.sum())} rows moved in {shapes[i]}, want k={k}"
            assert_top(scores, selected)
        for s, (a, b) in enumerate(spans):
            contributed[s][i] = k if layout == "ddp" else int(selected[a:b].sum())
    return contributed


def run_example(layout, name, shapes, fraction, weight_decay, seed, stats):
    """Steps a distributed and a single-process optimizer side by side, checking every step."""
    world, rank, mesh = CLUSTER["world"], CLUSTER["rank"], CLUSTER["mesh"]
    kind, options = ALGORITHMS[name]
    options = dict(options, weight_decay=weight_decay, mu=MU)
    if kind == "dion3":
        options["fraction"] = fraction
    run = Run(layout, shapes, mesh, world, rank)
    single = Matrices(shapes, seed=7)  # Run's model starts from the same weights
    opt = make_optimizer(kind, run.params, run.mesh, **options)
    single_opt = make_optimizer(kind, list(single.parameters()), None, **options)
    exact = layout == "ddp" or kind != "dion3" or options["selection_scope"] == "global" or fraction == 1.0
    decay = 1.0 - 0.02 * weight_decay  # make_optimizer's lr is 0.02
    for step in range(STEPS):
        grads = gradients(shapes, seed, step)
        before, before_m = run.weights(), full_momentum(opt, run.params)
        run.set_grads(grads)
        for p, g in zip(single.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        single_opt.step()
        after, after_m = run.weights(), full_momentum(opt, run.params)
        for p in run.params:
            assert all(torch.isfinite(full(v)).all() for v in [p, *opt.state[p].values()]), "non-finite weight or state"
        contributed = check_step(layout, name, shapes, fraction, decay, before, after, before_m, after_m, grads)
        sent = gather_ints(opt.communication_bytes)
        assert min(sent) >= 0, sent
        scope = options.get("selection_scope")
        assert sent == expected_bytes(layout, kind, scope, shapes, world, contributed, planned_owners(opt)), (sent, step)
        if exact:
            error = max_relative_error(after, [p.detach() for p in single.parameters()])
            assert error <= TOLERANCE, f"{name}/{layout} differs from one process by {error:.2e} at step {step}"
    stats.update([f"layout={layout}", f"algorithm={name}", "exact" if exact else "sharded-local"])
    rows_held = [[b - a for a, b in (local_row_span(r, world, s) for s in range(world))] for r, _ in shapes]
    if layout == "fsdp" and any(0 in held for held in rows_held):
        stats["zero-row rank"] += 1
    if layout == "fsdp" and any(len(set(held)) > 1 for held in rows_held):
        stats["uneven shards"] += 1
    if len(shapes) > len(set(shapes)):
        stats["bucket of several"] += 1


# ---------------------------------------------------------------- properties

# Sharded Dion3 is where layouts differ most (local scope is its own rule there): more examples.
PAIR_WEIGHT = {("fsdp", "dion3_local"): 4, ("fsdp", "dion3_global"): 2}
PAIRS = [(layout, name) for layout in ("fsdp", "ddp") for name in ALGORITHMS]


def rule_examples(per_pair: int) -> int:
    return sum(per_pair * PAIR_WEIGHT.get(pair, 1) for pair in PAIRS)


def steps_follow_the_rules(stats: Counter, per_pair: int) -> None:
    """Every layout × algorithm pair gets its own examples (and its own hypothesis seed)."""
    for index, (layout, name) in enumerate(PAIRS):
        sharded_local = (layout, name) == ("fsdp", "dion3_local")  # f = 1: its own property below

        @given(shapes=shape_lists(), fraction=FRACTIONS.filter(lambda f: f < 1) if sharded_local else FRACTIONS,
               weight_decay=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**16))
        def prop(shapes, fraction, weight_decay, seed):
            agree(layout, name, shapes, fraction, weight_decay, seed)
            stats["examples"] += 1
            run_example(layout, name, shapes, fraction, weight_decay, seed, stats)

        if sharded_local:
            prop = example(**SHARDED_LOCAL_EXAMPLE)(prop)
        example_settings(per_pair * PAIR_WEIGHT.get((layout, name), 1), seed=index)(prop)()


def local_equals_global_at_fraction_one(stats: Counter, max_examples: int) -> None:
    @example_settings(max_examples)
    @given(shapes=shape_lists(), seed=st.integers(0, 2**16))
    def prop(shapes, seed):
        agree(shapes, seed)
        stats["examples"] += 1
        world, rank, mesh = CLUSTER["world"], CLUSTER["rank"], CLUSTER["mesh"]
        runs = [Run("fsdp", shapes, mesh, world, rank) for _ in range(2)]
        opts = [make_optimizer("dion3", run.params, mesh, fraction=1.0, selection_scope=scope)
                for run, scope in zip(runs, ("local", "global"))]
        for step in range(STEPS):
            grads = gradients(shapes, seed, step)
            for run, opt in zip(runs, opts):
                run.set_grads(grads)
                opt.step()
        local, global_ = (run.weights() for run in runs)
        assert max_relative_error(local, global_) <= TOLERANCE

    prop()


def dion3_sends_less_than_muon(stats: Counter, max_examples: int) -> None:
    """f ≤ ½: Dion3's row payload never exceeds Muon's, per rank; total bytes are strictly lower
    for DDP whenever a matrix has ≥ 2 rows, and for FSDP in the regime f ≤ ¼, rows ≥ 4W,
    cols ≥ 16, where even the worst placement of the selected rows (all off the owner) plus
    the score all-gather stays below Muon's traffic."""
    world = CLUSTER["world"]
    for index, layout in enumerate(("fsdp", "ddp")):

        @given(
            scope=st.sampled_from(["local", "global"]),
            regime=st.one_of(
                st.tuples(st.just("small"), shape_lists(), st.integers(2, 1000).map(lambda n: n / 2000)),
                st.tuples(st.just("large"), shape_lists(4 * world, 40, 16, 24), st.integers(1, 250).map(lambda n: n / 1000)),
            ),
            seed=st.integers(0, 2**16),
        )
        def prop(scope, regime, seed):
            label, shapes, fraction = regime
            agree(layout, scope, regime, seed)
            stats.update(["examples", f"{layout}/{label}"])
            sent, payload = {}, {}
            for kind, options in (("muon", {}), ("dion3", {"fraction": fraction, "selection_scope": scope})):
                run = Run(layout, shapes, CLUSTER["mesh"], world, CLUSTER["rank"])
                opt = make_optimizer(kind, run.params, run.mesh, **options)
                run.set_grads(gradients(shapes, seed, 0))
                opt.step()
                sent[kind] = gather_ints(opt.communication_bytes)
                payload[kind] = gather_ints(opt.communication_bytes_by_kind.get("rows", 0))
            assert min(sent["dion3"]) >= 0 and min(sent["muon"]) >= 0
            assert all(d <= m for d, m in zip(payload["dion3"], payload["muon"])), payload
            strict = max(r for r, _ in shapes) >= 2 if layout == "ddp" else label == "large"
            if strict:
                assert sum(sent["dion3"]) < sum(sent["muon"]), (sent, shapes, fraction)
                stats[f"{layout}/strictly below"] += 1

        example_settings(-(-max_examples // 2), seed=index)(prop)()


PROPERTIES = [steps_follow_the_rules, local_equals_global_at_fraction_one, dion3_sends_less_than_muon]


def worker(rank: int, world: int, out_path: str, counts: dict) -> None:
    gloo.start(rank, world, f"{out_path}.store")
    try:
        CLUSTER.update(rank=rank, world=world, mesh=init_device_mesh("cpu", (world,)))
        report = {}
        failed = False
        for prop in PROPERTIES:
            stats: Counter = Counter()
            failure = "not run: an earlier property failed (its collectives may be out of step)" if failed else None
            try:
                if not failed:
                    prop(stats, counts[prop.__name__])
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                failure, failed = traceback.format_exc(), True
            report[prop.__name__] = {"examples": stats.pop("examples", 0), "failure": failure, "seen": dict(stats)}
        with open(f"{out_path}.rank{rank}.json", "w") as f:
            json.dump(report, f, indent=1)
    finally:
        CLUSTER.clear()  # its mesh holds the process group: nothing may keep it past the worker
        gloo.stop()
