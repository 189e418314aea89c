"""Run the real optimizer's planner on a pretend world and price every variant's step.

The planner (dion3.distributed.build_buckets, called by the optimizer's constructor) runs on
rank 0 of a fake process group of W ranks, with meta DTensor parameters. Its decisions do not
depend on which rank runs it: buckets come from global shapes and placements, owners from the
bucket order and sizes, and every rank builds the same (that is the invariant the distributed
step relies on, and `verify` rebuilds on other ranks to check it). Rank 0's view describes
every member of each of its buckets' groups; ranks outside them (another HSDP replica, another
expert group) hold copies of those groups and repeat their figures.
"""
from __future__ import annotations

import sys
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...optim.param_groups import BY_COST
from ..setting_names import ALLOCATION_WORDS, fraction_text, parse_dion3
from .buckets import BucketPlan, plans_of, same_owners
from .pricing import Hardware, Network, Variant
from .step_plan import StepPlan, plan_step
from .world import FakeWorld, Layout, Weight, meta_parameter

VARIANTS = {
    "muon-baseline": Variant("Muon (standard NS, cuBLAS)", "muon", orthogonalizer="newton_schulz", symmetric=False),
    "muon": Variant("Muon", "muon"),
    "normuon": Variant("NorMuon", "normuon"),
    "dion3": Variant("Dion3", "dion3", 0.25),
}


def variant(name: str, fraction: float = 0.25, scope: str = "local", momentum_dtype: Optional[str] = None) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"--optimizers: unknown optimizer {name!r}; expected some of {sorted(VARIANTS)}")
    base = VARIANTS[name]
    suffix = ", bf16 momentum" if momentum_dtype == "bfloat16" else ""
    if base.algorithm != "dion3":
        return dataclasses.replace(base, label=base.label + suffix, momentum_dtype=momentum_dtype)
    label = f"Dion3 f={fraction_text(fraction)}" + (" global" if scope == "global" else "") + suffix
    return Variant(label, "dion3", fraction, scope, base.orthogonalizer, base.symmetric, momentum_dtype)


def setting_variant(name: str, scope: str = "local", momentum_dtype: Optional[str] = None) -> Variant:
    """The variant of a setting as the commands name it (muon, normuon, dion3-1/4, dion3-1/4-cost)."""
    if name in ("muon", "normuon"):
        return variant(name, momentum_dtype=momentum_dtype)
    setting = parse_dion3(name)
    if setting is None or setting.warmup_steps:
        raise ValueError(f"the plan prices muon, normuon and fixed Dion3 settings (dion3-F, dion3-F-cost, "
                         f"dion3-F-rows), not {name!r}")
    base = variant("dion3", setting.fraction, scope, momentum_dtype)
    if setting.allocation == "uniform":
        return base
    return dataclasses.replace(base, label=base.label.replace("f=", "") + ALLOCATION_WORDS[setting.allocation],
                               allocation=setting.allocation)


def _optimizer(v: Variant, params: list):
    from ... import Dion3, Muon, NorMuon
    from ...optim.cost_fractions import cost_allocated_groups

    # the planned weights are linear layers and expert stacks [E, rows, cols] (--experts)
    if v.algorithm == "dion3":
        groups = [dict(params=params)]
        if v.allocation in BY_COST:  # as param_groups(..., fraction_allocation=...) splits a model's matrices
            groups = cost_allocated_groups(groups[0], v.fraction, most_rows=v.allocation == "most_rows")
        return Dion3(groups, fraction=v.fraction, selection_scope=v.scope, orthogonalizer=v.orthogonalizer,
                     momentum_dtype=v.momentum_dtype, stacked=True)
    cls = NorMuon if v.algorithm == "normuon" else Muon
    return cls(params, orthogonalizer=v.orthogonalizer, momentum_dtype=v.momentum_dtype, stacked=True)


@dataclass
class Planned:
    layout: Layout
    plans: dict[str, list[BucketPlan]]  # variant label → rank 0's buckets
    seconds: float  # wall time of building the worlds and the optimizers
    verified_ranks: tuple[int, ...] = ()


def build_plans(weights: list[Weight], layout: Layout, variants: list[Variant], dtype=torch.float32,
                verify: int = 0, progress: Optional[Callable[[str], None]] = None) -> Planned:
    """Rank 0's buckets of every variant's optimizer; with verify = V > 0, also V other ranks'
    (spread over the world), each checked to agree with rank 0 (ValueError if not)."""
    say = progress or (lambda text: None)
    start = time.perf_counter()
    plans = _on_rank(weights, layout, variants, dtype, 0, say)
    others = _spread(layout.world_size, verify)
    for rank in others:
        theirs = _on_rank(weights, layout, variants, dtype, rank, say)
        for label, mine in plans.items():
            if not same_owners(mine, theirs[label]):
                raise ValueError(f"rank {rank} plans {label} differently from rank 0")
    return Planned(layout, plans, time.perf_counter() - start, tuple(others))


def _spread(world: int, count: int) -> list[int]:
    if count <= 0 or world <= 1:
        return []
    count = min(count, world - 1)
    return sorted({1 + (i * (world - 1)) // count for i in range(count)} | {world - 1})[:count]


def _on_rank(weights, layout, variants, dtype, rank, say) -> dict[str, list[BucketPlan]]:
    world = FakeWorld(layout, rank) if layout.axes else None
    try:
        say(f"rank {rank}: {len(weights)} parameters on {layout.describe()} ({layout.world_size} ranks)")
        make = (lambda w: world.parameter(w, dtype)) if world else (lambda w: meta_parameter(w, dtype))
        params = [make(w) for w in weights]
        out = {}
        for v in variants:
            began = time.perf_counter()
            out[v.label] = plans_of(_optimizer(v, params), rank)
            say(f"rank {rank}: {v.label} planned in {time.perf_counter() - began:.1f} s")
        return out
    finally:
        if world is not None:
            world.close()


def price(planned: Planned, variants: list[Variant], hw: Hardware, net: Network,
          scalar_numel: int = 0, piece_launches: int = 0) -> dict[str, StepPlan]:
    """Each variant's step. AdamW's parameters (embeddings, norms) are sharded over every axis
    but the replica axis and cost parameters, gradients and two moments in fp32.
    piece_launches: see cost.bucket_stages (older code's launches per matrix)."""
    layout = planned.layout
    shards = max(layout.world_size // layout.size("replicate") // layout.size("ep"), 1)
    scalar_bytes = scalar_numel / shards * 4 * hw.param_bytes
    return {v.label: plan_step(planned.plans[v.label], v, hw, net, scalar_bytes, piece_launches=piece_launches)
            for v in variants}


def stderr_progress(text: str) -> None:
    print(f"[dion3 plan] {text}", file=sys.stderr, flush=True)
