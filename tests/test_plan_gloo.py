"""`dion3 plan` against the real step (tests/plan_worker.py, 4 gloo ranks): for FSDP2, FSDP2 +
TP and HSDP, the planner on a fake process group predicts every rank's owners and its bytes
sent by kind, as the optimizer counts them (communication_bytes_by_kind), exactly."""
from __future__ import annotations

import pytest
import torch

import gloo
import plan_worker as worker
from dion3.ortho.newton_schulz import default_compute_dtype
from dion3.tools.plan.pricing import Hardware, Network, Variant
from dion3.tools.plan.run import build_plans, price
from dion3.tools.plan.world import parse_layout

VARIANTS = {"muon": Variant("Muon", "muon", orthogonalizer="newton_schulz"),
            "dion3": Variant("Dion3", "dion3", 0.25, orthogonalizer="newton_schulz")}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return gloo.spawn_and_read(worker.worker, 4, tmp_path_factory.mktemp("plan") / "results.json")


@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_plan_equals_the_step(measured, layout):
    # rows travel in the compute dtype of Newton–Schulz on this CPU for these shapes: every Gram
    # side is at most 16 rows, below the bf16 rule's 96, so float32 on every CPU (one wire dtype)
    wire = default_compute_dtype(torch.device("cpu"), "newton_schulz", torch.float32, rows=16).itemsize
    hardware = Hardware("cpu", 1e12, 1e12, 1e11, 1e10, wire_bytes=wire)
    variants = list(VARIANTS.values())
    planned = build_plans(worker.WEIGHTS, parse_layout(layout), variants, verify=1)
    steps = price(planned, variants, hardware, Network())
    for name, v in VARIANTS.items():
        plans = planned.plans[v.label]
        for rank, sent, owners in measured[f"{layout} {name}"]:
            # every bucket's owners (matrices per member of its group), as this rank built them
            assert owners == [p.owned for p in plans], (layout, name, rank)
            # rank 0's groups; HSDP's ranks 2, 3 are the other replica of ranks 0, 1
            predicted = steps[v.label].ranks[rank % len(plans[0].ranks)].sent
            assert {k: int(round(b)) for k, b in predicted.items()} == sent, (layout, name, rank, predicted, sent)
