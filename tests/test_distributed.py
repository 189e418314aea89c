"""Distributed step (DDP ProcessGroup and FSDP2 Shard(0)) against a single-process run.

Two gloo process groups are spawned once per module (2 and 4 ranks on loopback); every worker
runs all scenarios of tests/distributed_worker.py and the assertions below read their results.
The reference is the same optimizer on one process with the full matrices and gradients.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import gloo
import distributed_worker as worker
from dion3 import Dion3, Muon
from dion3.distributed import local_row_span

TOLERANCE = 1e-5  # float32 NS; the distributed and single runs agree to ~1e-7 in practice
EXACT_SCENARIOS = [
    f"{layout}/{name}"
    for layout in ("fsdp", "ddp")
    for name in ("muon", "muon_nesterov", "normuon", "dion3_global", "dion3_global_half")
] + [
    "traffic/fsdp/muon", "traffic/fsdp/dion3_global", "traffic/ddp/muon", "traffic/ddp/dion3_global",
    "traffic/ddp/dion3_local",  # replicated: every rank sees whole matrices, so "local" is exact too
    "fsdp_backward/dion3_global", "ddp_backward/normuon", "resume/fsdp_dion3_global",
] + [f"partial/{layout}/{name}" for layout in ("fsdp", "ddp") for name in ("normuon", "dion3_global")] + [
    "local_scope/fsdp/dion3",  # against a float64 emulation of per-shard selection
    "spread/fsdp/muon", "spread/fsdp/normuon", "spread/fsdp/dion3_global", "spread_subset/fsdp/normuon",
]


def test_hsdp_shard_submesh_matches_single_process(results):
    # HSDP needs a 2 (replicate) × 2 (shard) mesh, so only the 4-rank run has this scenario.
    errors = results["errors"]
    assert ("hsdp_backward/dion3_global" in errors) == (results["world"] == 4)
    assert errors.get("hsdp_backward/dion3_global", 0.0) <= TOLERANCE


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    world = request.param
    data = gloo.spawn_and_read(worker.worker, world, tmp_path_factory.mktemp(f"dist{world}") / "results.json")
    data["world"] = world
    return data


def _chunk(rows: int, world: int) -> int:
    return -(-rows // world)


def _rows_on(rows: int, world: int, rank: int) -> int:
    return len(range(rows)[rank * _chunk(rows, world) : (rank + 1) * _chunk(rows, world)])


@pytest.mark.parametrize("scenario", EXACT_SCENARIOS)
def test_matches_single_process(results, scenario):
    assert results["errors"][scenario] <= TOLERANCE, (scenario, results["errors"][scenario])


def test_small_fsdp_buckets_spread_over_the_ranks(results):
    """worker.SPREAD: three row-sharded buckets of two matrices, built in the order (12, 8),
    (10, 6), (7, 9); owners by cost (longest processing time first), read after the Dion3
    global run (f = ¼). On the owner a matrix is its K = ⌈f·rows⌉ selected rows: 3×8, 3×6, 2×9,
    all Gram NS (m/n > 1.5) in float32 on a CPU, so the bytes its owner moves, 2·K·cols·4·(W−1)/W,
    are 144 : 108 : 108 at W = 4, and the FLOPs (under 1% of that time) order the tie: Gram NS
    on 3×6 multiplies more than on 2×9. W = 4: (12, 8) → ranks 0, 1; (10, 6) → ranks 2, 3;
    (7, 9) → the least loaded, ranks 2 and 3. W = 2: each bucket one matrix per rank.
    (By count, blocks of ⌈N/W⌉ from where the previous bucket stopped, W = 4 gave ranks 0–3
    [1, 0, 0], [1, 0, 1], [0, 1, 1], [0, 1, 0]: rank 1 a (12, 8) and a (7, 9).)
    The step still matches one process: test_matches_single_process["spread/..."]."""
    expected = {4: [[1, 0, 0], [1, 0, 0], [0, 1, 1], [0, 1, 1]], 2: [[1, 1, 1], [1, 1, 1]]}
    assert results["owned"] == expected[results["world"]]


def test_a_subset_of_a_bucket_still_has_an_owner_per_matrix(results):
    """worker.SPREAD_SUBSET under NorMuon: one (7, 9), then five (10, 6), whole on their owners.
    (10, 6) is Gram NS (m/n = 1.67) in float32: its owner moves 2·10·6·4·(W−1)/W bytes (360 at
    W = 4, 240 at W = 2); (7, 9) is standard NS in the CPU NS dtype of a 7-row Gram side (float32
    by the rule, whatever the CPU; bf16 only where set explicitly): 2·7·9·w·(W−1)/W, 189 or 378 at
    W = 4 (126 or 252 at 2).
    Bytes set the order (the FLOPs are under 2% of a matrix's time). Longest first, to the least
    loaded rank:
    float32, W = 4: (7, 9) → 0; (10, 6) → 1, 2, 3, then 1, 2 (360 < 378): [1, 0], [0, 2], [0, 2], [0, 1].
    float32, W = 2: (7, 9) → 0; (10, 6) → 1, 1 (360 < 378), 0, 1, 0: [1, 2], [0, 3].
    bf16, W = 4: (10, 6) → 0, 1, 2, 3, 0; (7, 9) → 1: [0, 2], [1, 1], [0, 1], [0, 1].
    bf16, W = 2: (10, 6) → 0, 1, 0, 1, 0; (7, 9) → 1: [0, 3], [1, 2].
    On steps where the first (10, 6) has no gradient, the other four keep their owners: the step
    still matches one process (test_matches_single_process["spread_subset/..."])."""
    dtypes = set(results["ns_dtype"])
    assert len(dtypes) == 1, dtypes  # every rank chose the same dtype (the owners depend on it)
    expected = {("torch.float32", 4): [[1, 0], [0, 2], [0, 2], [0, 1]], ("torch.float32", 2): [[1, 2], [0, 3]],
                ("torch.bfloat16", 4): [[0, 2], [1, 1], [0, 1], [0, 1]], ("torch.bfloat16", 2): [[0, 3], [1, 2]]}
    assert results["owned_subset"] == expected[(dtypes.pop(), results["world"])]


def test_local_equals_global_at_fraction_one(results):
    assert results["errors"]["local_vs_global_f1"] <= TOLERANCE


def test_local_scope_is_a_different_rule_when_sharded(results):
    # Shows the comparison above can fail: per-shard top-k is not the global top-k.
    assert results["errors"]["traffic/fsdp/dion3_local"] > 1e-4


def test_local_scope_moves_each_ranks_own_top_rows(results):
    world, fraction = results["world"], 0.25
    for rank, moved in enumerate(results["moved"]["local"]):
        for (rows, _), count in zip(worker.MIXED, moved):
            held = _rows_on(rows, world, rank)
            assert count == min(math.ceil(fraction * _chunk(rows, world)), held), (rank, rows, count)


def test_global_scope_moves_exactly_k_rows_of_each_matrix(results):
    moved = results["moved"]["global"]
    for i, (rows, _) in enumerate(worker.MIXED):
        assert sum(per_rank[i] for per_rank in moved) == max(1, math.ceil(0.25 * rows))
        for rank, per_rank in enumerate(moved):
            assert per_rank[i] <= _rows_on(rows, results["world"], rank)


def _muon_fsdp_bytes(shapes, world: int, rank: int, itemsize: int = 4) -> int:
    """Hand count: rows of matrices owned elsewhere go out, whole matrices' other rows come back;
    per bucket, one float32 sum of squares per matrix is all-reduced (a ring: 2·(W−1)/W of it)."""
    total = 0
    for (rows, cols), members, owners in worker.spread_owners(shapes, world):
        count, owned = len(members), owners.count(rank)
        held = _rows_on(rows, world, rank)
        total += ((count - owned) * held + owned * (rows - held)) * cols * itemsize
        total += 2 * count * 4 * (world - 1) // world
    return total


def _muon_ddp_bytes(shapes, world: int, itemsize: int = 4) -> int:
    """All-gather: each rank sends its block of ⌈N/W⌉ whole matrices to W − 1 ranks."""
    return sum(-(-shapes.count(s) // world) * s[0] * s[1] * itemsize * (world - 1) for s in set(shapes))


def test_muon_byte_counts_match_hand_count(results):
    world = results["world"]
    assert results["bytes"]["fsdp/muon"] == [_muon_fsdp_bytes(worker.TRAFFIC, world, r) for r in range(world)]
    assert results["bytes"]["ddp/muon"] == [_muon_ddp_bytes(worker.TRAFFIC, world)] * world


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_dion3_sends_a_fraction_of_muons_bytes(results, layout):
    muon = results["bytes"][f"{layout}/muon"]
    for scope, budget in (("local", 0.3), ("global", 0.5)):
        dion3 = results["bytes"][f"{layout}/dion3_{scope}"]
        for rank, (sent, reference) in enumerate(zip(dion3, muon)):
            assert 0 < sent <= budget * reference, (layout, scope, rank, sent, reference)
    assert results["errors"][f"traffic/{layout}/dion3_global"] <= TOLERANCE


def test_unsupported_layouts_raise_clear_errors(results):
    rejected = results["rejected"]
    assert "DeviceMesh" in rejected["dtensor_with_process_group"]  # the other layouts: test_distributed_layouts.py


def test_check_finite_raises_on_every_rank(results):
    assert results["nonfinite_raised"] == [True] * results["world"]


@pytest.mark.parametrize("mesh", ["cuda", 2, object()])
def test_bad_distributed_mesh_is_rejected(mesh):
    for optimizer in (Muon, Dion3):
        with pytest.raises(ValueError, match="distributed_mesh"):
            optimizer([torch.nn.Parameter(torch.randn(4, 4))], distributed_mesh=mesh)


@pytest.mark.parametrize("rows", [0, 1, 3, 5, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_row_spans_follow_torch_chunk(rows, world):
    pieces = torch.arange(rows).chunk(world) if rows else ()
    for rank in range(world):
        start, stop = local_row_span(rows, world, rank)
        expected = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(start, stop)) == expected


def test_single_rank_group_matches_single_process(tmp_path):
    """World size 1 (one GPU with torchrun): the distributed path is still exact."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        for layout, kind, options in (  # one rank: received rows are used in place (no placement copy)
            ("fsdp", "muon", {}),
            ("fsdp", "normuon", {}),
            ("fsdp", "dion3", {"selection_scope": "global"}),
            ("fsdp", "dion3", {"selection_scope": "local"}),
            ("ddp", "dion3", {}),
        ):
            error, sent, _, _ = worker.compare_to_single(layout, worker.MIXED, kind, mesh, 1, 0, **options)
            assert error <= TOLERANCE, (layout, kind, error)
            assert sent == [0]  # nothing leaves a single rank
    finally:
        dist.destroy_process_group()


def test_half_precision_rows_on_the_wire_match_single_process(tmp_path, monkeypatch):
    """With a half-precision compute dtype (as on GPU: bf16 for NS, fp16 for Gram NS) the sharded
    step sends rows already normalized in that dtype and the owner orthogonalizes them as they
    are; forced here on CPU for both the one-rank group and the single-process reference."""
    import importlib

    newton_schulz = importlib.import_module("dion3.ortho.newton_schulz")  # the package re-exports a function of that name

    def half(device, method, input_dtype=torch.float32, rows=None):
        return torch.float16 if method == "gram" else torch.bfloat16

    monkeypatch.setattr(newton_schulz, "default_compute_dtype", half)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        for kind, options in (("muon", {}), ("normuon", {}), ("dion3", {"selection_scope": "local"}),
                              ("dion3", {"selection_scope": "global"})):
            error, _, _, _ = worker.compare_to_single("fsdp", worker.MIXED, kind, mesh, 1, 0, **options)
            # the same half-precision NS on both sides: float-rounding apart (a step that left
            # the weights alone would be off by ~1e-2 here)
            assert error <= 1e-4, (kind, options, error)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nesterov", [False, True])
def test_float64_fsdp_muon_matches_single_process(tmp_path, nesterov):
    """float64 parameters under FSDP2 (one rank), with and without Nesterov (whose U the
    momentum pass never sees, so its norm is measured on the way): exact against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from dion3 import Muon

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(24, 16, bias=False).double()
        plain = torch.nn.Linear(24, 16, bias=False).double()
        plain.weight.data.copy_(model.weight.data)
        fully_shard(model, mesh=mesh)
        sharded_opt = Muon(model.parameters(), lr=0.02, nesterov=nesterov, distributed_mesh=mesh)
        plain_opt = Muon(plain.parameters(), lr=0.02, nesterov=nesterov)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            grad = torch.randn(16, 24, dtype=torch.float64, generator=g)
            model.weight.grad = DTensor.from_local(grad.clone(), mesh, [Shard(0)], run_check=False,
                                                   shape=grad.shape, stride=grad.stride())
            plain.weight.grad = grad.clone()
            sharded_opt.step()
            plain_opt.step()
        moved = (plain.weight - model.weight.full_tensor()).abs().max()
        assert moved <= 1e-12 * plain.weight.abs().max(), float(moved)
    finally:
        dist.destroy_process_group()


def _recording_step(name: str, stages: int, log: list):
    for stage in range(stages):
        log.append((name, stage))
        yield


@pytest.mark.parametrize("depth,budget,sizes,running_with_a", [
    (4, float("inf"), [10, 10, 1], {"b", "c"}),  # no budget: everything in flight together
    (4, 15.0, [10, 10, 1], set()),  # a + b > 15: b waits for a (and c, admitted in order, behind b)
    (4, 15.0, [10, 1, 10], {"b"}),  # a + b ≤ 15 overlap; c waits
    (1, float("inf"), [10, 10, 1], set()),  # depth 1: strictly one after another
])
def test_interleave_admits_buckets_within_depth_and_byte_budget(depth, budget, sizes, running_with_a):
    from dion3.distributed.interleave import interleave

    log = []
    steps = [_recording_step(n, 3, log) for n in "abc"]
    interleave(steps, depth, sizes, budget)
    assert sorted(log) == [(n, s) for n in "abc" for s in range(3)]  # every stage ran once
    assert [s for n, s in log if n == "b"] == [0, 1, 2]  # each step's stages in order
    a_done = log.index(("a", 2))
    assert {n for n, _ in log[:a_done]} - {"a"} == running_with_a


def test_interleave_admits_a_bucket_larger_than_the_budget_alone():
    from dion3.distributed.interleave import interleave

    log = []
    interleave([_recording_step("big", 2, log), _recording_step("small", 2, log)], 4, [100, 1], 10.0)
    assert log == [("big", 0), ("big", 1), ("small", 0), ("small", 1)]


def test_padded_selection_keeps_selected_rows_and_pads_with_unselected_zero_rows():
    """Global scope on one rank: matrix 0 holds selected rows 0 and 2, matrix 1 only row 1
    (flat indices over chunk = 4 rows, 3 of them real); the result rows come in that order."""
    from dion3.distributed.sharded import padded_selection

    result = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    update, rows = padded_selection(torch.tensor([0, 2, 5]), result, count=2, chunk=4, rows_here=3, width=2)
    assert rows.tolist() == [[0, 2], [1, 0]]  # matrix 1: its selected row, then unselected row 0
    assert update.tolist() == [[[1.0, 1.0], [2.0, 2.0]], [[3.0, 3.0], [0.0, 0.0]]]


def test_pending_hands_its_buffer_over_once():
    from dion3.distributed.exchange import Pending

    buffer = torch.arange(4.0)
    pending = Pending(None, buffer, lambda t: t.view(2, 2))
    assert pending.wait().data_ptr() == buffer.data_ptr()  # the buffer itself, transformed
    with pytest.raises(RuntimeError, match="already waited on"):
        pending.wait()


@pytest.mark.parametrize("seed", range(5))
def test_padded_selection_against_a_row_by_row_reference(seed):
    """Random selections of different sizes per matrix: applying (update, rows) row by row gives
    the selected rows their result rows and every other row no change."""
    from dion3.distributed.sharded import padded_selection

    g = torch.Generator().manual_seed(seed)
    count, chunk = 4, 9
    rows_here = int(torch.randint(5, chunk + 1, (1,), generator=g))
    chosen = [sorted(torch.randperm(rows_here, generator=g)[: int(torch.randint(0, rows_here + 1, (1,), generator=g))].tolist())
              for _ in range(count)]
    flat = torch.tensor([m * chunk + r for m, rows in enumerate(chosen) for r in rows], dtype=torch.long)
    result = torch.randn(len(flat), 3, generator=g)
    width = max(len(rows) for rows in chosen)
    update, rows = padded_selection(flat, result, count, chunk, rows_here, width)
    applied = torch.zeros(count, rows_here, 3)
    for m in range(count):
        assert len(set(rows[m].tolist())) == width  # distinct rows: the fused update's position table
        for j in range(width):
            applied[m, rows[m, j]] += update[m, j]
    expected = torch.zeros(count, rows_here, 3)
    expected.view(-1, 3)[torch.tensor([m * rows_here + r for m, rs in enumerate(chosen) for r in rs], dtype=torch.long)] = result
    assert torch.equal(applied, expected)


def test_owner_mapping_by_hand():
    """Each member owns the contiguous range of the matrices whose owner it is (owner_of, in
    member order); a holder owns everything; the same mapping object for the same inputs
    (built once, not per step)."""
    from dion3.distributed.bucketing import Owners

    class Mapping(Owners):
        def __init__(self, owner_of, world_size):
            self.owner_of, self.world_size = owner_of, world_size

    empty = range(0, 0)
    assert Mapping((1, 1, 2, 2, 3), 4).owners() == (empty, range(0, 2), range(2, 4), range(4, 5))
    assert Mapping((0, 0, 1, 1, 2), 4).owners() == (range(0, 2), range(2, 4), range(4, 5), empty)
    assert Mapping((1, 2), 4).owners() == (empty, range(0, 1), range(1, 2), empty)
    assert Mapping((2,) * 5, 4).owners() == (empty, empty, range(0, 5), empty)
    assert [Mapping((1, 2), 4).owned(m) for m in range(4)] == list(Mapping((1, 2), 4).owners())
    assert Mapping((1, 1, 2, 2, 3), 4).owners() is Mapping((1, 1, 2, 2, 3), 4).owners()
