"""Per-block groups (num_heads, split_sizes) on sharded layouts against one process stepping
separate per-block parameters (tests/sharded_blocks_worker.py, gloo): FSDP2 Shard(0) on 2
ranks; torchtitan's FSDP2 + TP recipe on (dp=2, tp=2), HSDP (Replicate, Shard(0)) and expert
stacks [E, out, in] (experts over one axis, rows over the other) on 4."""
from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

import sharded_blocks_worker as worker

TOLERANCE = 1e-6  # float32 Newton–Schulz on both sides (measured: at most ~2.5e-7)
FSDP = ([f"fsdp/{case}/{name}" for case in worker.FSDP_CASES for name in worker.ALGORITHMS]
        + ["fsdp/heads/dion3_local", "fsdp/gqa/normuon_reload", "fsdp/straddling/dion3_global_reload"])
DP_TP = [f"{layout}/{name}" for layout in ("dp_tp", "hsdp", "experts") for name in worker.ALGORITHMS]
PLACEMENTS = {"dp_tp": ["(Shard(dim=0), Shard(dim=1))", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"],
              "hsdp": ["(Replicate(), Shard(dim=0))"], "experts": ["(Shard(dim=1), Shard(dim=0))"]}


def _spawn(tmp_path_factory, world: int, which: str) -> dict:
    out = tmp_path_factory.mktemp(which) / "results.json"
    mp.spawn(worker.worker, args=(world, str(out), which), nprocs=world)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return _spawn(tmp_path_factory, 2, "fsdp")


@pytest.fixture(scope="module")
def dp_tp(tmp_path_factory):
    return _spawn(tmp_path_factory, 4, "dp_tp")


@pytest.mark.parametrize("scenario", FSDP)
def test_fsdp_fused_weight_matches_separate_blocks(fsdp, scenario):
    """Weights and momentum agree; the last step moved the same rows (Dion3/Dion2: the per-block
    selection, k = max(1, ⌈f·block rows⌉) for global scope)."""
    result = fsdp[scenario]
    assert result["placements"] == ["(Shard(dim=0),)"]
    assert result["error"] <= TOLERANCE, (scenario, result["error"])
    assert result["same_rows"], scenario


@pytest.mark.parametrize("name", list(worker.ALGORITHMS) + ["dion3_local"])
def test_blocks_held_whole_by_one_rank_send_no_rows(fsdp, name):
    """q/k/v and 4 heads of 16 rows over 2 ranks: every block lies on one rank, which steps it
    itself (no row leaves any rank); blocks straddling the ranks do send rows."""
    for case in ("gqa", "heads") if name != "dion3_local" else ("heads",):
        assert fsdp[f"fsdp/{case}/{name}"]["rows_sent"] == 0, (case, name)
    if name != "dion3_local":
        assert fsdp[f"fsdp/straddling/{name}"]["rows_sent"] > 0


def test_local_scope_follows_its_per_block_definition(fsdp, dp_tp):
    """Each row shard's top min(⌈f·b⌉, rows held) rows of each block (b: the largest share of
    the block's rows on one shard): blocks straddling FSDP2 ranks, and the recipe's strided
    (dp × tp) rows and column-sharded rows."""
    assert fsdp["fsdp/straddling/dion3_local_definition"] is True
    assert dp_tp["dp_tp/dion3_local_definition"] is True


@pytest.mark.parametrize("scenario", DP_TP)
def test_tp_hsdp_and_expert_fused_weights_match_separate_blocks(dp_tp, scenario):
    result = dp_tp[scenario]
    assert result["placements"] == PLACEMENTS[scenario.split("/")[0]]
    assert result["error"] <= TOLERANCE, (scenario, result["error"])
    assert result["same_rows"], scenario


def test_dcp_checkpoint_of_block_state_moves_across_layouts(dp_tp):
    """Per-block Dion3 state saved with DCP on (dp=2, tp=2) and loaded on FSDP2 over 4 ranks,
    where every block is cut differently, continues as one process would."""
    assert dp_tp["dcp/dp_tp_to_fsdp"] <= TOLERANCE


def test_every_scenario_ran(fsdp, dp_tp):
    assert sorted(fsdp) == sorted(FSDP + ["fsdp/straddling/dion3_local_definition"])
    assert sorted(dp_tp) == sorted(DP_TP + ["dp_tp/dion3_local_definition", "dcp/dp_tp_to_fsdp"])
