"""Per-block groups (num_heads, split_sizes) on sharded layouts against one process stepping
separate per-block parameters (tests/sharded_blocks_worker.py, gloo): FSDP2 Shard(0) on 2
ranks; torchtitan's FSDP2 + TP recipe on (dp=2, tp=2), HSDP (Replicate, Shard(0)) and expert
stacks [E, out, in] (experts over one axis, rows over the other) on 4. CapturedStep on
per-block groups of FSDP2 and (dp=2, tp=2) with the CPU stand-ins for capture
(tests/captured_scenarios.py, in the same processes), and on a GPU, real capture on a one-rank
NCCL (dp=1, tp=1) mesh."""
from __future__ import annotations

import pytest
import torch

import gloo
import captured_scenarios as captured
import sharded_blocks_worker as worker

TOLERANCE = 1e-6  # float32 Newton–Schulz on both sides (measured: at most ~2.5e-7)
FSDP = ([f"fsdp/{case}/{name}" for case in worker.FSDP_CASES for name in worker.ALGORITHMS]
        + ["fsdp/heads/dion3_local", "fsdp/gqa/normuon_reload", "fsdp/straddling/dion3_global_reload"])
DP_TP = [f"{layout}/{name}" for layout in ("dp_tp", "hsdp", "experts") for name in worker.ALGORITHMS]
PLACEMENTS = {"dp_tp": ["(Shard(dim=0), Shard(dim=1))", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"],
              "hsdp": ["(Replicate(), Shard(dim=0))"], "experts": ["(Shard(dim=1), Shard(dim=0))"]}


def _spawn(tmp_path_factory, world: int, which: str) -> dict:
    return gloo.spawn_and_read(worker.worker, world, tmp_path_factory.mktemp(which) / "results.json", which)


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
    assert sorted(fsdp) == sorted(FSDP + ["fsdp/straddling/dion3_local_definition", "captured"])
    assert sorted(dp_tp) == sorted(DP_TP + ["dp_tp/dion3_local_definition", "dcp/dp_tp_to_fsdp", "captured"])


# ---------------------------------------------------- CapturedStep (tests/captured_scenarios.py)
# Each new k: an eager step (WARMUP = 1), then a capture, which records only, so its call
# replays the graph, then a replay; a k seen before: replays only.
NEW, SEEN = ["eager", "capture", "replay", "replay"], ["replay"] * 3
PLAIN_LOG = NEW  # Muon/NorMuon: no k, one graph
# Dion3 at fractions 0.45, 0.35, 0.2 (3 calls each); k = ⌈f·b⌉, b the most rows of a block (or
# of a whole weight) one rank holds. FSDP, 10 rows split (6, 2, 2) over 5/5 rows, beside whole
# 12-row weights: b = 5, 2, 6 give k = (3, 1, 3), (2, 1, 3), (1, 1, 2): three graphs. FSDP, 12
# rows in 3 heads over 6/6 rows: b = 4, 2, 4, 6 give (2, 1, 2, 3) twice, then (1, 1, 1, 2).
# 16 rows in 4 heads over 8/8: b = 4: 2, 2, 1. On (dp=2, tp=2) (counted from the recipe's
# placements) b is at most 4 (a head or block of the row-parallel weights on one dp rank's 4
# rows: 2, 2, 1), 3 (2, 2, 1) or 2 and 1 (1, 1, 1): 0.35 replays 0.45's graph, 0.2 gets another.
DION3_LOGS = {"fsdp/split_sizes": NEW * 3}
CAPTURED = [f"{option}/{name}" for option in ("num_heads", "split_sizes") for name in captured.ALGORITHMS]


def _check(result: dict, scenario: str, one_process: bool) -> None:
    name = scenario.split("/")[-1]
    # every replay ran inside captured_region (no host sync) with the collectives of its capture
    if name == "dion3_local":
        want = DION3_LOGS.get(scenario.rsplit("/", 1)[0], NEW + SEEN + NEW)
    else:
        want = PLAIN_LOG
    assert result["log"] == want, scenario
    assert result["keys"] == want.count("capture")
    assert result["eager_gap"] == 0.0, scenario  # the replays are the eager steps, bit for bit
    # Dion3: one cached split plan per distinct k of a bucket (here as many as graphs), not one
    # per fraction (3); Muon/NorMuon: none
    assert result["local_plans"] == (result["keys"] if name == "dion3_local" else 0), scenario
    if one_process:
        assert result["one_process"] <= TOLERANCE, (scenario, result["one_process"])
    else:
        assert "one_process" not in result


@pytest.mark.parametrize("scenario", CAPTURED)
def test_fsdp_captured_step_equals_eager_and_one_process(fsdp, scenario):
    """Per-block groups beside a group of whole Shard(0) weights (the row-sharded fast path)."""
    _check(fsdp["captured"][f"fsdp/{scenario}"], f"fsdp/{scenario}", not scenario.endswith("dion3_local"))


def test_fsdp_captured_local_selection_of_whole_heads_equals_one_process(fsdp):
    """Heads that lie whole on one rank: "local" selection is the one-process selection."""
    _check(fsdp["captured"]["fsdp/whole_heads/dion3_local"], "fsdp/whole_heads/dion3_local", one_process=True)


@pytest.mark.parametrize("scenario", CAPTURED)
def test_dp_tp_captured_step_equals_eager_and_one_process(dp_tp, scenario):
    _check(dp_tp["captured"][f"dp_tp/{scenario}"], f"dp_tp/{scenario}", not scenario.endswith("dion3_local"))


@pytest.mark.parametrize("algorithm", ["dion3", "dion2"])
def test_capture_of_global_selection_is_refused_naming_the_group(fsdp, dp_tp, algorithm):
    for results in (fsdp, dp_tp):
        message = results["captured"]["refused"][algorithm]
        assert message is not None, "CapturedStep accepted a global selection"
        assert "parameter group 1" in message and "selection_scope='global'" in message, message
        assert f"'{algorithm}'" in message and "selection_scope='local'" in message, message


def test_every_captured_scenario_ran(fsdp, dp_tp):
    assert sorted(fsdp["captured"]) == sorted([f"fsdp/{s}" for s in CAPTURED]
                                              + ["fsdp/whole_heads/dion3_local", "refused"])
    assert sorted(dp_tp["captured"]) == sorted([f"dp_tp/{s}" for s in CAPTURED] + ["refused"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("option", ["num_heads", "split_sizes"])
def test_captured_per_block_step_on_a_one_by_one_nccl_mesh(tmp_path, option):
    """Real capture of per-block groups on the layout path with NCCL: a one-rank group, the
    torchtitan recipe on a (dp=1, tp=1) mesh (tests/test_distributed_layouts.py's one-GPU TP
    check), its weights in heads or uneven blocks; CapturedStep (new DTensor gradients every
    step) against the same optimizer stepped eagerly, for Muon, NorMuon and Dion3 "local"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dion3 import Dion3
    from dion3.distributed import LayoutBucket
    from dion3.optim.graph import CapturedStep, to_device_scalars
    from layouts_worker import cut, full, grads_for, max_relative_error

    device = torch.device("cuda")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    steps = []  # released before the group is destroyed: NCCL's teardown waits on live graphs
    try:
        mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "tp"))
        for name, settings in captured.ALGORITHMS.items():
            with device:
                graphed, eager = (captured.recipe_groups(mesh, option, scale=32) for _ in range(2))
            made = [Dion3([dict(params=ps, **o, **settings) for ps, o in groups], lr=0.02, weight_decay=0.1,
                          fraction=0.25) for groups in (graphed, eager)]
            assert all(isinstance(b, LayoutBucket) for buckets in made[0]._buckets for b in buckets), name
            to_device_scalars(made[1], device)
            step = CapturedStep(made[0], warmup_steps=2)
            steps.append(step)
            params = [[p for ps, _ in groups for p in ps] for groups in (graphed, eager)]
            for number in range(5):
                grads = [g.to(device) for g in grads_for([tuple(p.shape) for p in params[0]], number)]
                for p, e, g in zip(*params, grads):
                    p.grad, e.grad = cut(g, p), cut(g, e)
                step()
                made[1].step()
            assert step.graph is not None and step.captures == 1, name
            error = max_relative_error([full(p) for p in params[0]], [full(e) for e in params[1]])
            print(f"{option}/{name}: max relative error {error:.2e}")
            assert error <= 2e-3, (option, name, error)  # tests/test_graph.py's bound for captured vs eager
    finally:
        for step in steps:
            step.release()
        dist.destroy_process_group()
