"""Per-block groups (num_heads, split_sizes) and Dion2 under DDP on 2 gloo ranks, against one
process stepping separate per-block parameters (tests/blocks_worker.py runs the scenarios)."""
from __future__ import annotations

import pytest

import blocks_worker as worker
import gloo

TOLERANCE = 1e-6  # the same float32 math per matrix on every rank (measured on CPU: 0.0 everywhere)

SCENARIOS = (
    [f"{option}/{name}" for option in ("split_sizes", "num_heads") for name in worker.ALGORITHMS]
    + ["partial/split_sizes/dion3", "ddp_backward/split_sizes/dion3", "fsdp/dion2_global"]
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return gloo.spawn_and_read(worker.worker, 2, tmp_path_factory.mktemp("blocks") / "results.json")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ddp_per_block_step_matches_one_process(results, scenario):
    assert results["errors"][scenario] <= TOLERANCE, (scenario, results["errors"][scenario])


def test_every_scenario_ran(results):
    assert sorted(results["errors"]) == sorted(SCENARIOS)
