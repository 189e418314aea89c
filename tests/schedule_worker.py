"""Spawned-worker side of tests/test_fraction_schedule.py's distributed test (gloo, CPU).

A Dion3 fraction that changes every step (FractionScheduler), under FSDP2 (Shard(0)) and DDP,
with global and local selection, against one process: the same optimizer and schedule on the
full matrices, or, for local selection of row-sharded matrices (a different rule), a float64
emulation of per-shard selection with the same fractions. Rank 0 writes the results as JSON.
Not a test module itself (no test_ prefix).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import gloo
from distributed_worker import MIXED, Matrices, Run, full_grads, make_optimizer, max_relative_error
from dion3 import FractionScheduler, FractionWarmup, orthogonalize
from reference import ReferenceOptimizer

SCHEDULE = FractionWarmup(0.25, 4)  # 1, 0.8125, 0.625, 0.4375, then 0.25
STEPS = 6


def against_one_process(layout: str, scope: str, mesh, world: int, rank: int) -> float:
    run = Run(layout, MIXED, mesh, world, rank)
    opt = make_optimizer("dion3", run.params, run.mesh, selection_scope=scope)
    scheduler = FractionScheduler(opt, SCHEDULE)
    single = Matrices(MIXED, seed=7)
    single_opt = make_optimizer("dion3", list(single.parameters()), None)
    single_scheduler = FractionScheduler(single_opt, SCHEDULE)
    for step in range(STEPS):
        grads = full_grads(MIXED, step)
        run.set_grads(grads)
        for p, g in zip(single.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        single_opt.step()
        scheduler.step()
        single_scheduler.step()
    return max_relative_error(run.weights(), [p.detach() for p in single.parameters()])


def local_rows_against_emulation(mesh, world: int, rank: int) -> float:
    """FSDP2 local selection: each rank's own top min(⌈f·chunk⌉, rows held) rows, f changing."""
    current = {"fraction": SCHEDULE(0)}

    def per_shard(scores, k):
        chunk = -(-scores.shape[0] // world)
        picked = []
        for start in range(0, scores.shape[0], chunk):
            span = scores[start:start + chunk]
            take = min(math.ceil(round(current["fraction"] * chunk, 9)), span.shape[0])
            picked.append(torch.argsort(span, descending=True)[:take] + start)
        return torch.cat(picked)

    run = Run("fsdp", MIXED, mesh, world, rank)
    opt = make_optimizer("dion3", run.params, run.mesh, selection_scope="local")
    scheduler = FractionScheduler(opt, SCHEDULE)
    ref = ReferenceOptimizer(run.weights(), "dion3", lr=0.02, weight_decay=0.1, selector=per_shard,
                             orthogonalizer=lambda u: orthogonalize(u, "newton_schulz", dtype=torch.float64))
    for step in range(STEPS):
        current["fraction"] = SCHEDULE(step)
        grads = full_grads(MIXED, step)
        run.set_grads(grads)
        opt.step()
        ref.step(grads)
        scheduler.step()
    return max_relative_error(run.weights(), [p.float() for p in ref.params])


def local_slot_entries(mesh, world: int, rank: int) -> int:
    """Four fractions that give the same k on 8-row chunks (16 rows over 2 ranks): the cached
    owner slots of local selection must be keyed by k, one entry, not one per fraction."""
    shapes = [(16, 24)] * 3
    run = Run("fsdp", shapes, mesh, world, rank)
    opt = make_optimizer("dion3", run.params, run.mesh, selection_scope="local")
    fractions = [0.5, 0.45, 0.4, 0.49]
    for step, fraction in enumerate(fractions):
        opt.param_groups[0]["fraction"] = fraction
        run.set_grads(full_grads(shapes, step))
        opt.step()
    (bucket,) = opt._buckets[0]
    return sum(1 for key in bucket.slot_cache if key[0] == "local")


def disagreement_raised(mesh, world: int, rank: int) -> bool:
    """Ranks given different warm-up targets: the scheduler must refuse on every rank."""
    run = Run("fsdp", MIXED, mesh, world, rank)
    opt = make_optimizer("dion3", run.params, run.mesh, selection_scope="local")
    try:
        FractionScheduler(opt, FractionWarmup(0.25 if rank == 0 else 0.5, 4))
    except ValueError as error:
        return "ranks disagree" in str(error)
    return False


def gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def scenarios(world: int, rank: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    errors = {f"{layout}/global": against_one_process(layout, "global", mesh, world, rank) for layout in ("fsdp", "ddp")}
    # replicated matrices are whole on every rank: local selection is the one-process rule
    errors["ddp/local"] = against_one_process("ddp", "local", mesh, world, rank)
    errors["fsdp/local"] = local_rows_against_emulation(mesh, world, rank)
    return {
        "errors": errors,
        "local_slot_entries": gathered(local_slot_entries(mesh, world, rank)),
        "disagreement_raised": gathered(disagreement_raised(mesh, world, rank)),
    }


def worker(rank: int, world: int, out_path: str) -> None:
    gloo.run_and_report(rank, world, out_path, lambda: scenarios(world, rank))
