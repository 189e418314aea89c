"""Global selection's plan on hand-built sharded buckets (one process, no collectives): which
rows each member sends, which of them are this rank's, and where the owner puts them, against
a row-by-row reference; and the index compaction it uses, against nonzero and a stable sort."""
from __future__ import annotations

import pytest
import torch

from dion3 import rules
from dion3.distributed import selection
from dion3.distributed.bucket import LayoutBucket
from dion3.distributed.layout import MatrixLayout
from dion3.distributed.mesh import MeshInfo


def _split(seq: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """torch.chunk blocks of a sequence (the last ones may be short or empty)."""
    size = -(-len(seq) // parts)
    return [seq[p * size : (p + 1) * size] for p in range(parts)]


def _chunks(rows: int, parts: int) -> list[tuple[int, ...]]:
    return _split(tuple(range(rows)), parts)


def _strided(rows: int, parts: int, factor: int) -> list[tuple[int, ...]]:
    """_StridedShard rows: part p of each of `factor` torch.chunk blocks, concatenated."""
    blocks = _chunks(rows, factor)
    return [tuple(r for block in blocks for r in _split(block, parts)[p]) for p in range(parts)]


def _col_ranges(cols: int, parts: int) -> list[tuple[int, int]]:
    size = -(-cols // parts)
    return [(min(p * size, cols), min((p + 1) * size, cols)) for p in range(parts)]


# name: (rows, cols, row sets of the row shards, column shards); members are row-major over
# (row shard, column shard), as a (dp, tp) mesh orders its group
LAYOUTS = {
    "one member": (37, 24, _chunks(37, 1), 1),
    "rows over 3 (uneven)": (10, 6, _chunks(10, 3), 1),
    "rows over 4, one empty": (3, 8, _chunks(3, 4), 1),
    "columns over 2 (every member holds every row)": (21, 8, _chunks(21, 1), 2),
    "columns over 3 (every member holds every row)": (9, 7, _chunks(9, 1), 3),
    "rows over 2 x columns over 2": (13, 10, _chunks(13, 2), 2),
    "strided rows over 2": (16, 6, _strided(16, 2, 2), 1),
}


def _bucket(name: str, rank: int, count: int, owner_of: tuple[int, ...]) -> LayoutBucket:
    rows, cols, row_sets, col_parts = LAYOUTS[name]
    ranges = _col_ranges(cols, col_parts)
    members = [MatrixLayout((0,), row_set, span) for row_set in row_sets for span in ranges]
    world = len(members)
    mesh = None if world == 1 else MeshInfo(None, world, rank, "process_group")
    column = members[rank].cols
    row_members = [m for m in members if m.cols == column]  # the row group around this rank
    row_mesh = None if len(row_members) == 1 else MeshInfo(None, len(row_members), row_members.index(members[rank]),
                                                           "process_group")
    local = members[rank]
    bucket = LayoutBucket((rows, cols), mesh, members, row_mesh=row_mesh, row_members=row_members,
                          views=[torch.zeros(count, len(local.rows), local.cols[1] - local.cols[0])])
    bucket.owner_of = owner_of
    return bucket


def _gathered(bucket: LayoutBucket, scores: torch.Tensor) -> torch.Tensor:
    """[R, N, b]: each row-group member's full-row scores, padded with −1 (padded_scores)."""
    width = bucket.chunk
    out = torch.full((len(bucket.row_members), scores.shape[0], width), -1.0)
    for r, member in enumerate(bucket.row_members):
        out[r, :, : len(member.rows)] = scores[:, list(member.rows)]
    return out


def _reference(bucket: LayoutBucket, scores: torch.Tensor, fraction: float):
    """Row by row: the k highest scores of each matrix (ties to the lower row); member s sends
    the selected rows it holds, in its local order; this rank's rows as flat indices into
    [N·rows held]; the owner's slot of each arriving row (member-major, then matrix, then the
    sender's order) is its matrix's offset plus the row's place among the matrix's k."""
    rows, count = bucket.shape[0], scores.shape[0]
    k = rules.selected_row_count(rows, fraction)
    chosen = [sorted(sorted(range(rows), key=lambda r: (-float(scores[i, r]), r))[:k]) for i in range(count)]
    counts = [[sum(r in chosen[i] for r in m.rows) for i in range(count)] for m in bucket.members]
    held = len(bucket.local.rows)
    local_rows = [i * held + j for i in range(count) for j, r in enumerate(bucket.local.rows) if r in chosen[i]]
    mine = bucket.owned(bucket.rank)
    slots = [(i - mine.start) * k + chosen[i].index(r)
             for m in bucket.members for i in mine for r in m.rows if r in chosen[i]]
    return counts, local_rows, slots, k


def _scores(count: int, rows: int, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # small integers: many equal scores across the members' rows
        return torch.randint(0, 3, (count, rows), generator=g).float()
    if kind == "zeros":
        return torch.zeros(count, rows)
    return torch.rand(count, rows, generator=g)


@pytest.mark.parametrize("kind", ["distinct", "ties", "zeros"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_global_plan_matches_a_row_by_row_reference(name, fraction, kind):
    rows, cols, row_sets, col_parts = LAYOUTS[name]
    world, count = len(row_sets) * col_parts, 5
    owner_of = tuple(sorted(i * world // count for i in range(count)))
    scores = _scores(count, rows, seed=len(name) + int(fraction * 8), kind=kind)
    for rank in range(world):
        bucket = _bucket(name, rank, count, owner_of)
        plan = selection.global_plan(bucket, _gathered(bucket, scores), fraction)
        counts, local_rows, slots, k = _reference(bucket, scores, fraction)
        assert plan.per_matrix == k
        assert plan.counts == counts, (name, rank)
        assert plan.rows.dtype == torch.int64 and plan.rows.tolist() == local_rows, (name, rank)
        if world == 1:  # one member: the rows arrive in place, no slots
            assert plan.slots.numel() == 0
        else:
            assert plan.slots.tolist() == slots, (name, rank)
        again = selection.global_plan(bucket, _gathered(bucket, scores), fraction)  # cached slots and counts
        assert again.counts == counts and torch.equal(again.rows, plan.rows) and torch.equal(again.slots, plan.slots)


@pytest.mark.parametrize("name", [n for n, (_, _, row_sets, _) in LAYOUTS.items() if len(row_sets) == 1])
def test_global_plan_without_a_host_sync_where_every_member_holds_every_row(name, monkeypatch):
    """No split sizes to read back from the device (FSDP2 on one rank, columns split only): the
    plan makes no .tolist() / .item() / nonzero call, the host syncs of a GPU."""
    rows, cols, row_sets, col_parts = LAYOUTS[name]
    world, count = col_parts, 4
    bucket = _bucket(name, 0, count, tuple(sorted(i * world // count for i in range(count))))
    gathered = _gathered(bucket, _scores(count, rows, 0, "distinct"))

    def refused(*args, **kwargs):
        raise AssertionError("host sync")

    for method in ("tolist", "item", "nonzero"):
        monkeypatch.setattr(torch.Tensor, method, refused)
    monkeypatch.setattr(torch, "nonzero", refused)
    plan = selection.global_plan(bucket, gathered, 0.25)
    monkeypatch.undo()
    assert plan.counts == [[rules.selected_row_count(rows, 0.25)] * count] * world


def _masks():
    g = torch.Generator().manual_seed(0)
    yield torch.zeros(0, dtype=torch.bool)
    for n in (1, 7, 1000, 4099):
        yield torch.zeros(n, dtype=torch.bool)  # all False
        yield torch.ones(n, dtype=torch.bool)  # all True
        for density in (0.01, 0.25, 0.5, 0.9):
            yield torch.rand(n, generator=g) < density
    edges = torch.zeros(50, dtype=torch.bool)
    edges[[0, 49]] = True  # the first and the last entry
    yield edges


@pytest.mark.parametrize("variant", ["cpu", "static", "sorted"])
def test_true_indices_equal_nonzero_and_a_stable_sort(variant):
    compute = {"cpu": selection._true_indices, "static": selection._true_indices_static,
               "sorted": selection._true_indices_sorted}[variant]
    for mask in _masks():
        count = int(mask.sum())
        expected = torch.nonzero(mask).flatten()
        assert torch.equal(expected, torch.argsort((~mask).to(torch.uint8), stable=True)[:count])  # the reference pair
        got = compute(mask, count)
        assert got.dtype == torch.int64 and torch.equal(got, expected), (variant, mask.numel(), count)


def test_true_indices_refuse_a_count_that_does_not_match_on_cpu():
    mask = torch.tensor([True, False, True, True])
    for count in (2, 4, 0):
        with pytest.raises(ValueError, match="3 True entries"):
            selection._true_indices(mask, count)
    # the sync-free form cannot check; a count too large pads with an index past the mask's end
    padded = selection._true_indices_static(mask, 5)
    assert padded.tolist() == [0, 2, 3, 4, 4]


def test_true_indices_sort_where_nonzero_static_has_no_kernel(monkeypatch):
    """A torch whose nonzero_static has no kernel for the device: the stable sort, from then on."""
    calls = []

    def missing(*args, **kwargs):
        calls.append(1)
        raise NotImplementedError("no kernel for this backend")

    monkeypatch.setattr(torch, "nonzero_static", missing)
    monkeypatch.setattr(selection, "_NO_STATIC_NONZERO", set())
    mask = torch.rand(300, generator=torch.Generator().manual_seed(3)) < 0.3
    for _ in range(2):
        assert torch.equal(selection._true_indices_static(mask, int(mask.sum())), torch.nonzero(mask).flatten())
    assert len(calls) == 1 and selection._NO_STATIC_NONZERO == {"cpu"}
