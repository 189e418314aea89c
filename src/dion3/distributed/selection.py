"""Which rows of a sharded bucket's matrices each member sends to their owners, and where the
owner puts them.

A `RowRoutes` says, for every member s and matrix i of the bucket, how many rows s sends
(counts[s][i]); which of this rank's rows they are (flat indices into [N·rows held]); and, on
the owner, the slot of every received row among its matrices' rows. Muon/NorMuon send every
row; Dion3 "local" sends each row shard's own top ⌈f·b⌉ rows (b: the most rows any member
holds, ⌈rows/W⌉ under FSDP2); Dion3 "global" sends this rank's share of the exact top-k of the
whole matrix, found from an all-gather of one score per row. Members send rows restricted to
the columns they hold, so a row split over column shards arrives in pieces that land in the
same slot, side by side.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import rules
from .bucket import LayoutBucket


@dataclass
class RowRoutes:
    counts: list[list[int]]  # counts[s][i]: rows of matrix i that member s sends
    rows: Optional[Tensor]  # this rank's sent rows, flat in [N·rows held]; None = all rows
    # Owner side: the slot in [n_owned·K] of every received row, in the order they arrive
    # (member-major, then matrix, then the sender's row order).
    slots: Tensor
    per_matrix: int  # K: rows of each matrix on its owner
    owners: tuple[range, ...]  # the matrices each member owns (bucket.owners(): consecutive in member order)

    def send_counts(self, rank: int) -> list[int]:
        """Rows this rank sends to each owner (its rows are in matrix order, so grouped by owner)."""
        return [sum(self.counts[rank][i] for i in mine) for mine in self.owners]

    def recv_counts(self, rank: int) -> list[int]:
        """Rows this rank receives from each member, for the matrices it owns."""
        return [sum(row[i] for i in self.owners[rank]) for row in self.counts]


def _member_rows(bucket: LayoutBucket, device, group: str = "members") -> Tensor:
    """[members, b] global row indices of every member of the bucket's group (`group=
    "row_members"`: of its row group), padded with `rows` (a row no member holds) to b = the
    most rows any of them holds; built once per bucket."""
    key = ("index", group)
    if key not in bucket.slot_cache:
        pieces, rows = getattr(bucket, group), bucket.shape[0]
        width = max((len(m.rows) for m in pieces), default=0)
        bucket.slot_cache[key] = torch.tensor(
            [list(m.rows) + [rows] * (width - len(m.rows)) for m in pieces], dtype=torch.long, device=device)
    return bucket.slot_cache[key]


def all_rows_plan(bucket: LayoutBucket) -> RowRoutes:
    """Muon/NorMuon: every member sends all its rows; the owner holds whole matrices (K = rows)."""
    if "all" not in bucket.slot_cache:
        rows, count = bucket.shape[0], bucket.count
        device = bucket.momentum.device
        owned = len(bucket.owned(bucket.rank))
        base = torch.arange(owned, device=device)[:, None] * rows
        slots = torch.cat([(base + torch.tensor(m.rows, dtype=torch.long, device=device)).reshape(-1)
                           for m in bucket.members])
        counts = [[len(m.rows)] * count for m in bucket.members]
        bucket.slot_cache["all"] = RowRoutes(counts, None, slots, rows, bucket.owners())
    return bucket.slot_cache["all"]


def local_count(bucket: LayoutBucket, fraction: float, member: int) -> int:
    """"local" scope: ⌈f·b⌉ rows (b = bucket.chunk, the most rows any member holds), capped by
    the rows this member holds (never padding)."""
    held = len(bucket.members[member].rows)
    return min(rules.selected_row_count(bucket.chunk, fraction), held) if bucket.chunk else 0


def local_plan(bucket: LayoutBucket, scores: Tensor, fraction: float) -> RowRoutes:
    """Each row shard's own top rows by full-row L1 score (scores: [N, rows held], already summed
    over the column shards, so the members of a row shard pick the same rows); static counts,
    no host sync. On the owner, row shard q's rows fill slots [offset_q, offset_q + k_q)."""
    count, device = bucket.count, bucket.momentum.device
    counts_key = ("local_counts", fraction)  # a per-member loop: not redone every step
    if counts_key not in bucket.slot_cache:
        bucket.slot_cache[counts_key] = [local_count(bucket, fraction, s) for s in range(bucket.world_size)]
    ks = bucket.slot_cache[counts_key]
    # keyed by the counts, not the fraction: a fraction schedule gives many fractions but few
    # counts, and a captured step must find the slots of its k without a host copy
    key = ("local", tuple(ks))
    if key not in bucket.slot_cache:
        classes = bucket.row_classes()
        first = {q: s for s, q in reversed(list(enumerate(classes)))}
        offsets, total = {}, 0
        for q in sorted(first):
            offsets[q], total = total, total + ks[first[q]]
        owned = len(bucket.owned(bucket.rank))
        base = torch.arange(owned, device=device)[:, None] * total
        slots = torch.cat([(base + offsets[q] + torch.arange(k, device=device)).reshape(-1)
                           for q, k in zip(classes, ks)])
        bucket.slot_cache[key] = ([[k] * count for k in ks], slots, total)
    counts, slots, total = bucket.slot_cache[key]
    k = counts[bucket.rank][0]
    if k == 0:
        return RowRoutes(counts, scores.new_empty((0,), dtype=torch.long), slots, total, bucket.owners())
    return RowRoutes(counts, _flatten_rows(rules.top_rows(scores, k), scores.shape[1]), slots, total, bucket.owners())


def _flatten_rows(rows: Tensor, stride: int) -> Tensor:
    offsets = torch.arange(rows.shape[0], device=rows.device)[:, None] * stride
    return (rows + offsets).reshape(-1)


def padded_scores(bucket: LayoutBucket, scores: Tensor) -> Tensor:
    """[N, b] float32 full-row scores of this rank's rows, b = the most rows any member holds
    (bucket.chunk; every row set is held by some member of the row group); padding scores −1
    (real scores are ≥ 0)."""
    padded = scores.new_full((bucket.count, bucket.chunk), -1.0, dtype=torch.float32)
    padded[:, : scores.shape[1]] = scores
    return padded


def global_plan(bucket: LayoutBucket, gathered: Tensor, fraction: float) -> RowRoutes:
    """Exact top-k rows of every whole matrix (k from the true row count) from the full-row
    scores [R, N, b] of the row group's members (bucket.row_members: every row once; the other
    column shards hold the same summed scores, so every member computes the same selection).
    One host sync for the split sizes, none where every member holds every row (one member, or
    only columns split): each then sends all k rows of each matrix. On the owner, matrix rows
    are in ascending global order. Vectorized over the members (index tensors of every member's
    rows, padded with a row past the last that is never selected), so its cost does not grow
    with a loop over the group."""
    rows, count, device = bucket.shape[0], bucket.count, gathered.device
    k = rules.selected_row_count(rows, fraction)
    if _every_member_holds_every_row(bucket):
        return _whole_rows_plan(bucket, gathered[0], k)
    held = _member_rows(bucket, device)  # [W, b]
    whole = gathered.new_full((count, rows + 1), -1.0)
    whole[:, _member_rows(bucket, device, "row_members").reshape(-1)] = gathered.permute(1, 0, 2).reshape(count, -1)
    selected = torch.zeros((count, rows + 1), dtype=torch.bool, device=device)
    selected.scatter_(1, rules.top_rows(whole[:, :rows], k), True)
    slot = selected.cumsum(1) - 1  # position of each selected row among its matrix's k
    sent = selected[:, held]  # [N, W, b]: which rows each member sends
    counts = sent.sum(2).mT.tolist()  # the one host sync: the all-to-all's split sizes
    mine = bucket.owned(bucket.rank)
    owned_slots = slot[mine.start : mine.stop][:, held] + (torch.arange(len(mine), device=device) * k)[:, None, None]
    arriving = sent[mine.start : mine.stop].transpose(0, 1).reshape(-1)
    arrive_count = sum(row[i] for row in counts for i in mine)  # a row split in columns arrives once per piece
    slots = owned_slots.transpose(0, 1).reshape(-1)[_true_indices(arriving, arrive_count)]
    mine_sent = sent[:, bucket.rank, : len(bucket.local.rows)].reshape(-1)
    local_rows = _true_indices(mine_sent, sum(counts[bucket.rank]))
    return RowRoutes(counts, local_rows, slots, k, bucket.owners())


def _every_member_holds_every_row(bucket: LayoutBucket) -> bool:
    """Every member holds all rows of the matrices (local rows are in ascending global order,
    so they are 0..rows−1 in order): one member, or only columns split."""
    key = "every row on every member"
    if key not in bucket.slot_cache:
        bucket.slot_cache[key] = all(len(m.rows) == bucket.shape[0] for m in bucket.members)
    return bucket.slot_cache[key]


def _whole_rows_plan(bucket: LayoutBucket, scores: Tensor, k: int) -> RowRoutes:
    """global_plan where every member holds every row: scores [N, rows] are the whole matrices'
    already, every member sends the k selected rows of each matrix (its own rows are the
    selection's indices, no mask to compact), and the owner receives them from each member in
    the matrices' order: slots 0..owned·k−1 per member (none with one member: they arrive in
    place). No host sync."""
    count, device = bucket.count, scores.device
    key = ("whole rows", k)
    if key not in bucket.slot_cache:
        owned = len(bucket.owned(bucket.rank))
        per_member = torch.arange(owned * k, device=device)
        slots = per_member.new_empty((0,)) if bucket.world_size == 1 else per_member.repeat(bucket.world_size)
        bucket.slot_cache[key] = ([[k] * count for _ in range(bucket.world_size)], slots)
    counts, slots = bucket.slot_cache[key]
    local_rows = _flatten_rows(rules.top_rows(scores, k), bucket.shape[0])
    return RowRoutes(counts, local_rows, slots, k, bucket.owners())


def _true_indices(mask: Tensor, count: int) -> Tensor:
    """The positions of the `count` True entries of a flat bool mask, ascending, without a host
    sync on a GPU (count is known from the split sizes). On CPU, where nothing waits for a
    device, nonzero, and a count that does not match the mask is refused."""
    if mask.device.type == "cpu":
        found = mask.nonzero().squeeze(1)
        if found.numel() != count:
            raise ValueError(f"the mask has {found.numel()} True entries, not the {count} of the split sizes")
        return found
    return _true_indices_static(mask, count)


# device types whose nonzero_static has no kernel (CUDA before its sync-free one): they sort
_NO_STATIC_NONZERO: set = set()


def _true_indices_static(mask: Tensor, count: int) -> Tensor:
    """_true_indices with a size known in advance: nonzero_static (one compaction of the mask),
    padded with mask.numel() (an index past the end, which fails where it is used) if count were
    larger than the mask's True entries; a stable sort of the whole mask where nonzero_static
    has no kernel for the device."""
    if mask.device.type not in _NO_STATIC_NONZERO:
        try:
            return torch.nonzero_static(mask, size=count, fill_value=mask.numel()).squeeze(1)
        except NotImplementedError:
            _NO_STATIC_NONZERO.add(mask.device.type)
    return _true_indices_sorted(mask, count)


def _true_indices_sorted(mask: Tensor, count: int) -> Tensor:
    """_true_indices by a stable sort: the True entries come first, in order."""
    return torch.argsort((~mask).to(torch.uint8), stable=True)[:count]
