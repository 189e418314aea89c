"""`dion3 plan`'s arithmetic against hand counts: selection, bytes per collective, network
time, pipeline memory, critical path, the host's launches and the time the device waits for
them; layouts and flags (no process group needed)."""
from __future__ import annotations

import pytest

from dion3.tools.plan import cli
from dion3.tools.plan.buckets import BucketPlan
from dion3.tools.plan.pricing import (STAGE_LAUNCHES, Hardware, Network, RankCost, Stage, Variant, bucket_costs, bucket_stages,
                             collective_seconds, selection)
from dion3.tools.plan.step_plan import StepPlan, exposed_host_s, issue_order, peak_in_flight, plan_step
from dion3.tools.plan.world import Weight, parse_layout, placements

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
    # the device waits 1 s for the host: the collectives overlap compute and waits together
    step = StepPlan(MUON, {0: a, 1: b}, {"rows": 2.5}, exposed_s=1.0)
    assert step.critical_path_s(overlap=True) == 2.0 + 3.0 + 1.0
    assert step.critical_path_s(overlap=False) == 2.0 + 3.0 + 2.5 + 1.0
    step = StepPlan(MUON, {0: a, 1: b}, {"rows": 5.0}, exposed_s=1.0)
    assert step.critical_path_s(overlap=True) == 2.0 + 5.0


def test_device_waits_for_the_host_by_hand():
    # 1 s per launch. Host issues stage 0 (2 launches) over [0, 2]: the device's 1 s of it ends at
    # 2; stage 1 (5 s) is issued by 3 and runs 2..7; stage 2 runs 7..8: 8 s against 7 s of work.
    order = [Stage(2, 1.0), Stage(1, 5.0), Stage(1, 1.0)]
    assert exposed_host_s(order, 1.0) == pytest.approx(1.0)
    # host-bound: 20 s of launches over 2 s of device work, spread over them
    assert exposed_host_s([Stage(10, 1.0), Stage(10, 1.0)], 1.0) == pytest.approx(18.0)
    # no host time, no wait
    assert exposed_host_s(order, 0.0) == 0.0


def test_a_host_sync_exposes_the_launches_after_it():
    # the host issues stage 1's 3 s of launches while stage 0 runs 4 s: hidden
    assert exposed_host_s([Stage(0, 4.0), Stage(3, 1.0)], 1.0) == pytest.approx(0.0)
    # after a sync it waits the 4 s out first, then the device waits for the 3 s of launches
    assert exposed_host_s([Stage(0, 4.0), Stage(3, 1.0, sync=True)], 1.0) == pytest.approx(2.0)


def test_issue_order_follows_the_pipeline_admission():
    a, b = [Stage(1, 0.0), Stage(2, 0.0)], [Stage(3, 0.0), Stage(4, 0.0)]
    # a large device admits both buckets: one stage of each in turn
    assert [s.launches for s in issue_order([(10, a), (10, b)], capacity=1e6)] == [1, 3, 2, 4]
    # budget 1.5·10 = 15 on a small device: the second waits until the first is done
    assert [s.launches for s in issue_order([(10, a), (10, b)], capacity=0)] == [1, 2, 3, 4]


def test_stages_of_a_bucket_split_its_bytes_by_hand():
    bucket = rows_bucket(8, 16, 3, [4, 4], [2, 1])
    hw = Hardware("test", 1e12, 1e12, 1e12, 1e12, wire_bytes=2, bucket_overhead=4e-9)
    costs, _ = bucket_costs(bucket, MUON, hw)
    stages = bucket_stages(bucket, MUON, 0, costs[0], hw, piece_launches=1)
    local = 3 * 4 * 16
    # momentum 12 B, half copy 6 B, placing 2 matrices of 8×16 (4·2 B each), apply 10 B per element
    assert [s.device_s for s in stages] == pytest.approx(
        [12 * local * 1e-12 + 1e-9, 6 * local * 1e-12 + 1e-9, 4 * 2 * 2 * 8 * 16 * 1e-12 + costs[0].compute_s + 1e-9,
         10 * local * 1e-12 + 1e-9])
    assert [s.launches for s in stages] == [STAGE_LAUNCHES["muon"][0] + 3, *STAGE_LAUNCHES["muon"][1:]]
    assert not any(s.sync for s in stages)
    # Dion3 global: scores first, the plan in two parts around its host sync
    glob = Variant("D", "dion3", 0.25, "global", orthogonalizer="newton_schulz")
    costs, _ = bucket_costs(bucket, glob, hw)
    stages = bucket_stages(bucket, glob, 0, costs[0], hw)
    assert [s.sync for s in stages] == [False, False, True, False, False, False]
    assert stages[1].device_s == stages[2].device_s == pytest.approx(4e-9 / 6)
    # every byte and FLOP of the member lands in some stage, with the fixed time
    assert sum(s.device_s for s in stages) == pytest.approx(costs[0].memory_s + costs[0].compute_s + 4e-9)


def test_step_adds_the_time_the_device_waits():
    bucket = rows_bucket(8, 16, 3, [4, 4], [2, 1])
    hw = Hardware("test", 1e12, 1e12, 1e12, 1e12, launch_s=1e-3)
    step = plan_step([bucket], MUON, hw, Network())
    launches = sum(STAGE_LAUNCHES["muon"])
    assert step.host_s == pytest.approx(launches * 1e-3)
    # nanoseconds of device work: the device waits for nearly all the host time
    assert step.exposed_s == pytest.approx(launches * 1e-3, rel=1e-3)
    # the waits outlast the collectives (tens of µs): memory passes + compute + waits
    compute, memory = step.worst(lambda c: c.compute_s), step.worst(lambda c: c.memory_s)
    assert step.communication_s < step.exposed_s
    assert step.critical_path_s(True) == pytest.approx(memory + compute + step.exposed_s)


def test_waits_of_a_rank_that_owns_nothing_hide_behind_the_owner():
    # rank 0 owns both matrices of 4096×16: its orthogonalization outlasts rank 1's launches
    bucket = rows_bucket(8, 4096, 2, [4, 4], [2, 0])
    hw = Hardware("test", 1e9, 1e9, 1e12, 1e12, launch_s=1e-6)
    step = plan_step([bucket], MUON, hw, Network())
    owner, other = step.ranks[0], step.ranks[1]
    assert owner.compute_s > sum(STAGE_LAUNCHES["muon"]) * 1e-6 > other.compute_s == 0.0
    # rank 1 waits ~53 µs for its launches, hidden in rank 0's orthogonalization; rank 0 waits
    # for its first two stages' 5 + 7 launches, less their momentum and half-copy passes
    local = 2 * 4 * 4096
    assert step.exposed_s == pytest.approx((5 + 7) * 1e-6 - (12 + 6) * local / 1e12)


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
    (["--launch-us", "-1"], "--launch-us"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    assert cli.main(argv) == 2
    assert flag in capsys.readouterr().err
