"""`dion3 plan`'s arithmetic against hand counts: selection, bytes per collective, network
time, pipeline memory, critical path; layouts and flags (no process group needed)."""
from __future__ import annotations

import pytest

from dion3.plan import cli
from dion3.plan.buckets import BucketPlan
from dion3.plan.cost import Hardware, Network, RankCost, Variant, bucket_costs, collective_seconds, selection
from dion3.plan.total import StepPlan, peak_in_flight
from dion3.plan.world import Weight, parse_layout, placements

MUON = Variant("Muon", "muon", orthogonalizer="newton_schulz")
DION3 = Variant("Dion3", "dion3", 0.25, orthogonalizer="newton_schulz")
HW = Hardware("test", 1e12, 1e12, 1e12, 1e12, wire_bytes=2)


def rows_bucket(rows, cols, count, held, owned, ranks=None, classes=None) -> BucketPlan:
    world = len(held)
    return BucketPlan("rows", (rows, cols), count, [(h, cols) for h in held], owned,
                      ranks or list(range(world)), classes or list(range(world)), 1, world, max(held))


def test_selection_local_and_global_on_uneven_shards():
    bucket = rows_bucket(6, 16, 3, [2, 2, 2, 0], [1, 1, 1, 0])
    assert selection(bucket, MUON) == ([2.0, 2.0, 2.0, 0.0], 6)
    # local: ⌈0.25·2⌉ = 1 row from each rank holding rows, 3 on the owner
    assert selection(bucket, DION3) == ([1.0, 1.0, 1.0, 0.0], 3)
    # global: k = ⌈0.25·6⌉ = 2, expected from each rank in proportion to its rows
    ks, k = selection(bucket, Variant("D", "dion3", 0.25, "global"))
    assert k == 2 and ks == pytest.approx([2 / 3, 2 / 3, 2 / 3, 0.0])


def test_column_shards_of_one_row_set_count_once():
    # 2 row sets × 2 column shards: members 0, 1 hold rows 0-3, members 2, 3 rows 4-7
    bucket = BucketPlan("rows", (8, 16), 2, [(4, 8)] * 4, [1, 1, 0, 0], [0, 1, 2, 3], [0, 0, 1, 1], 2, 2, 4)
    assert selection(bucket, DION3) == ([1.0] * 4, 2)


def test_bytes_of_a_two_rank_bucket_by_hand():
    # 3 matrices of 8×16, 4 rows on each of 2 ranks; rank 0 owns 2 matrices, rank 1 one; bf16 rows
    bucket = rows_bucket(8, 16, 3, [4, 4], [2, 1])
    costs, _ = bucket_costs(bucket, MUON, HW)
    one = 4 * 16 * 2  # one matrix's rows from one rank
    # rank 0: its rows of the matrix it does not own (1·one), back: its 2 matrices' rows of rank 1 (2·one)
    assert costs[0].sent == {"rows": 3 * one, "norms": 2 * 3 * 4 * 1 // 2}
    assert costs[1].sent["rows"] == 2 * one + 1 * one
    assert costs[0].received["rows"] == 3 * one
    # NorMuon also sends each row's variance (4 B) both ways
    costs, _ = bucket_costs(bucket, Variant("N", "normuon", orthogonalizer="newton_schulz"), HW)
    assert costs[0].sent["variance"] == 3 * 4 * 4
    # Dion3 local: ⌈0.25·4⌉ = 1 row per rank and matrix
    costs, _ = bucket_costs(bucket, DION3, HW)
    assert costs[0].sent["rows"] == 3 * 16 * 2 and costs[1].sent["rows"] == 3 * 16 * 2


def test_state_and_memory_passes_by_hand():
    bucket = rows_bucket(8, 16, 3, [4, 4], [2, 1])
    costs, _ = bucket_costs(bucket, DION3, HW)
    local = 3 * 4 * 16
    assert costs[0].params == costs[0].grads == local * 4
    assert costs[0].state == local * 4 + 3 * 4 * 4  # momentum + one float32 variance per row
    # Dion3's fused passes 20 B per element + 14 B per selected element; owner placing 4·2 B per element
    assert costs[0].memory_bytes == 3 * (20 * 4 * 16 + 14 * 1 * 16) + 4 * 2 * 2 * 2 * 16


def test_network_time_within_and_across_nodes():
    bucket = rows_bucket(8, 16, 2, [4, 4], [1, 1])
    _, links = bucket_costs(bucket, MUON, HW)
    one = 4 * 16 * 2
    # each rank sends one matrix's rows forward and receives the same back: 2·one each way
    within = collective_seconds(bucket, links, Network(node_size=8, nvlink=1e6, latency=1e-3))
    assert within["rows"] == pytest.approx(2 * one / 1e6 + 2 * 1e-3)
    _, links = bucket_costs(bucket, MUON, HW, node_size=1)  # one GPU per node: every byte crosses
    across = collective_seconds(bucket, links, Network(node_size=1, fabric=1e5, fabric_latency=1e-2))
    assert across["rows"] == pytest.approx(2 * one / 1e5 + 2 * 1e-2)
    assert across["norms"] == pytest.approx(8 / 1e5 + 1e-2)  # ring all-reduce of 2 floats over 2 ranks


def test_pipeline_memory_admits_at_most_four_within_budget():
    # budget 1.5·10 = 15 on a small device: from the 4th bucket (10) the 5th (2) fits, 8 + 16
    assert peak_in_flight([(10, 1), (4, 2), (4, 4), (10, 8), (2, 16)], capacity=0) == 24
    # a large device (10% of 1000 = 100): four at a time
    assert peak_in_flight([(10, 1), (10, 2), (10, 4), (10, 8), (10, 16)], capacity=1000) == 30


def test_critical_path_and_imbalance():
    a = RankCost(compute_s=3.0, memory_s=1.0)
    b = RankCost(compute_s=1.0, memory_s=2.0)
    step = StepPlan(MUON, {0: a, 1: b}, {"rows": 2.5})
    assert step.critical_path_s(overlap=True) == 2.0 + 3.0
    assert step.critical_path_s(overlap=False) == 2.0 + 3.0 + 2.5
    assert step.imbalance() == 3.0 / 2.0


def test_layouts_and_placements():
    assert parse_layout("fsdp=64,tp=8").world_size == 512
    assert parse_layout("64").axes == (("fsdp", 64),)
    assert parse_layout("single").world_size == 1
    layout = parse_layout("replicate=2,fsdp=4,tp=2")
    text = lambda w: [type(p).__name__ + str(getattr(p, "dim", "")) for p in placements(w, layout)]  # noqa: E731
    assert text(Weight("q", (8, 8))) == ["Replicate", "_StridedShard0", "Shard0"]
    assert text(Weight("down", (8, 8))) == ["Replicate", "Shard0", "Shard1"]
    assert text(Weight("experts", (4, 8, 8))) == ["Replicate", "Shard1", "Replicate"]


@pytest.mark.parametrize("argv, flag", [
    (["--layout", "fsdp=8,dp=2"], "--layout"), (["--layout", "fsdp=0"], "--layout"),
    (["--world", "16"], "--world"), (["--nvlink-gbs", "0"], "--nvlink-gbs"),
    (["--fraction", "1.5"], "--fraction"), (["--scope", "exact"], "--scope"), (["--gpu", "tpu"], "--gpu"),
    (["--optimizers", "adam"], "--optimizers"), (["--preset", "gpt5"], "--preset"),
    (["--latency-us", "-1"], "--latency-us"), (["--experts", "4"], "--experts"), (["--ranks", "x"], "--ranks"), (["--node-size", "0"], "--node-size"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    assert cli.main(argv) == 2
    assert flag in capsys.readouterr().err
