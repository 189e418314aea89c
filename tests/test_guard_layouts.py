"""The guard on every layout: one NaN in one entry of one matrix's gradient at one step
(tests/guard_worker.py) costs that matrix that step and nothing more, everywhere.

Per layout and optimizer: every rank counts exactly one skip, in that step; every weight and
state tensor stays finite; the matrix's momentum, error feedback and variance come back as they
were before the step (to within the rounding of undoing the step's arithmetic), its weights only
decay; the next step trains it again; and the weights end as one process's given the same
gradients (Dion3 with local selection on sharded layouts selects per shard: not one process's
rows, so only its own properties are checked there)."""
from __future__ import annotations

import pytest

import gloo
import guard_worker

LAYOUTS = {2: ["ddp", "fsdp2"], 4: ["hsdp", "fsdp2+tp"]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return gloo.spawn_per_world(guard_worker.worker, LAYOUTS, lambda world: tmp_path_factory.mktemp(f"guard{world}"))


@pytest.mark.parametrize("kind", sorted(guard_worker.CASES))
@pytest.mark.parametrize("layout", [layout for layouts in LAYOUTS.values() for layout in layouts])
def test_one_nan_costs_one_step_of_one_matrix(measured, layout, kind):
    got = measured[f"{layout}/{kind}"]
    world = len(got["skipped"])
    assert got["reference_skipped"] == 1
    assert got["skipped"] == [1] * world, "every rank holds a piece of the matrix and skips it once"
    assert got["last_skip_step"] == [guard_worker.BAD_STEP + 1] * world
    assert all(got["finite"])
    assert set(got["bad_state_kept"]) >= {"momentum"}
    assert max(got["bad_state_kept"].values()) <= 1e-6, got["bad_state_kept"]
    assert got["bad_decayed_only"] <= 1e-6
    assert got["bad_moved_after"] > 1e-3
    if not (kind == "dion3-local" and layout != "ddp"):
        assert got["error"] <= 1e-5
