"""The AdamW groups' guard on DDP, FSDP2 and FSDP2 + TP (tests/scalar_guard_worker.py): a NaN in
the last rank's piece of one parameter's gradient costs that parameter one step on every rank (its
state bitwise as before, its weights decayed only), counted once per rank, and the scalar
parameters end as one process's given the same gradients; on the CPU's host-checked path and on
the sync-free masked path a GPU takes."""
from __future__ import annotations

import pytest

import gloo
import scalar_guard_worker
from test_scalar_guard import KINDS, SCALARS

LAYOUTS = {2: ["ddp", "fsdp2"], 4: ["fsdp2+tp"]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return gloo.spawn_per_world(scalar_guard_worker.worker, LAYOUTS, lambda world: tmp_path_factory.mktemp(f"scalar{world}"))


@pytest.mark.parametrize("path", ["host", "masked"])
@pytest.mark.parametrize("bad", SCALARS)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("layout", [layout for layouts in LAYOUTS.values() for layout in layouts])
def test_a_bad_piece_skips_the_parameter_on_every_rank(measured, layout, kind, bad, path):
    got = measured[f"{layout}/{kind}/{bad}/{path}"]
    world = len(got["skipped"])
    assert got["reference_skipped"] == 1
    assert got["skipped"] == [1] * world and got["last"] == [scalar_guard_worker.BAD_STEP + 1] * world
    assert got["state_kept"] and got["decayed_only"] <= 1e-7
    assert all(got["finite"])
    assert got["error"] <= 1e-6
