"""Which rows of a row-sharded bucket each rank contributes, and how many go to whom.

A `RowPlan` says, for every rank s and matrix i of the bucket, how many rows s contributes
(counts[s, i]); and which of this rank's padded rows they are (flat indices into [N·chunk]).
Muon/NorMuon contribute every real row; Dion3 "local" contributes each rank's own top
⌈f·chunk⌉ real rows; Dion3 "global" contributes this rank's share of the exact top-k of the
whole matrix, found from an all-gather of one score per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import rules
from .exchange import owner_slots
from .plan import ShardedBucket


class SplitSizes:
    """The all-to-all split sizes of a plan from its `counts` (counts[s][i]: rows of matrix i
    that member s sends) and `owners` (the bucket's owner mapping: the matrices each member
    owns, consecutive in member order, so a sender's rows are grouped by owner already)."""

    counts: list[list[int]]
    owners: tuple[range, ...]

    def send_counts(self, rank: int) -> list[int]:
        """Rows this rank sends to each owner."""
        return [sum(self.counts[rank][i] for i in mine) for mine in self.owners]

    def recv_counts(self, rank: int) -> list[int]:
        """Rows this rank receives from each member, for the matrices it owns."""
        return [sum(row[i] for i in self.owners[rank]) for row in self.counts]


@dataclass
class RowPlan(SplitSizes):
    counts: list[list[int]]  # counts[s][i]: rows of matrix i that rank s contributes
    rows: Optional[Tensor]  # this rank's contributed rows, flat in [N·chunk]; None = all real rows
    slots: Tensor  # owner side: where each received row goes in [n·K] (exchange.owner_slots)
    owners: tuple[range, ...]  # the matrices each rank owns (ShardedBucket.owned)

    def per_matrix(self) -> int:
        """K: rows each matrix has on its owner (the same for every matrix of the bucket)."""
        return sum(row[0] for row in self.counts)



def _static_slots(bucket: ShardedBucket, key, counts: list[list[int]]) -> Tensor:
    """Owner slots for split sizes fixed by the bucket's shape: built once, kept on the bucket
    (a host-to-device copy every step would stall the host on GPU)."""
    if key not in bucket.slot_cache:
        mine = bucket.owned(bucket.rank)
        owned = torch.tensor([[row[i] for i in mine] for row in counts], dtype=torch.long)
        per_matrix = sum(row[0] for row in counts)
        bucket.slot_cache[key] = owner_slots(owned, per_matrix).to(bucket.momentum.device)
    return bucket.slot_cache[key]


def all_rows_plan(bucket: ShardedBucket) -> RowPlan:
    counts = [[bucket.rows_of(s)] * bucket.count for s in range(bucket.world_size)]
    return RowPlan(counts, None, _static_slots(bucket, "all", counts), bucket.owners())


def local_select_count(bucket: ShardedBucket, fraction: float, rank: int) -> int:
    """⌈f·chunk⌉ rows per rank, capped by the rows the rank actually holds (never padding)."""
    return min(rules.selected_row_count(bucket.chunk, fraction), bucket.rows_of(rank))


def local_plan(bucket: ShardedBucket, scores: Tensor, fraction: float) -> RowPlan:
    """Each rank's own top rows by L1 norm (scores: [N, local rows], from the momentum pass);
    counts are static, so no host sync is needed."""
    counts = [[local_select_count(bucket, fraction, s)] * bucket.count for s in range(bucket.world_size)]
    # keyed by the counts, not the fraction: a fraction schedule gives many fractions but few
    # counts, and a captured step must find the slots of its k without a host copy
    slots = _static_slots(bucket, ("local", tuple(row[0] for row in counts)), counts)
    k = counts[bucket.rank][0]
    if k == 0:
        return RowPlan(counts, scores.new_empty((0,), dtype=torch.long), slots, bucket.owners())
    rows = rules.top_rows(scores, k)
    return RowPlan(counts, _flatten_rows(rows, bucket.chunk), slots, bucket.owners())


def padded_scores(bucket: ShardedBucket, scores: Tensor) -> Tensor:
    """[N, chunk] float32 scores of this rank's rows (scores: [N, local rows] L1 norms);
    padding rows score −1 (real scores are ≥ 0)."""
    padded = scores.new_full((bucket.count, bucket.chunk), -1.0, dtype=torch.float32)
    padded[:, : bucket.local_rows] = scores
    return padded


def global_plan(bucket: ShardedBucket, gathered_scores: Tensor, fraction: float) -> RowPlan:
    """Exact top-k of every whole matrix (k from the TRUE row count) from all ranks' scores
    [W, N, chunk]; every rank computes the same selection. One host sync for the split sizes."""
    rows, world, chunk = bucket.shape[0], bucket.world_size, bucket.chunk
    whole = gathered_scores.permute(1, 0, 2).reshape(bucket.count, world * chunk)[:, :rows]
    selected = rules.top_rows(whole, rules.selected_row_count(rows, fraction))  # [N, k] global rows
    owner = torch.div(selected, chunk, rounding_mode="floor")
    counts = torch.zeros((world, bucket.count), dtype=torch.long, device=selected.device)
    counts.scatter_add_(0, owner.mT, torch.ones_like(owner.mT))
    owned = bucket.owned(bucket.rank)
    slots = owner_slots(counts[:, owned.start : owned.stop], selected.shape[1])
    mine = owner == bucket.rank
    local = selected - bucket.rank * chunk + torch.arange(bucket.count, device=selected.device)[:, None] * chunk
    return RowPlan(counts.tolist(), local[mine], slots, bucket.owners())


def _flatten_rows(rows: Tensor, chunk: int) -> Tensor:
    offsets = torch.arange(rows.shape[0], device=rows.device)[:, None] * chunk
    return (rows + offsets).reshape(-1)


# ---------------------------------------------------------------- general layouts (LayoutBucket)
@dataclass
class PiecePlan(SplitSizes):
    """Which rows of a LayoutBucket's matrices each member sends to their owners, and where the
    owner puts them. Members send rows restricted to the columns they hold, so a row split over
    column shards arrives in pieces that land in the same slot, side by side."""

    counts: list[list[int]]  # counts[s][i]: rows of matrix i that member s sends
    rows: Optional[Tensor]  # this rank's sent rows, flat in [N·rows held]; None = all rows
    slots: list[Tensor]  # per member s: the owner-side row slot in [n_owned·K] of each row s sends it
    per_matrix: int  # K: rows of each matrix on its owner
    owners: tuple[range, ...]  # the matrices each member owns (LayoutBucket.owned)


def _member_rows(bucket, device, group: str = "members") -> list[Tensor]:
    """The global row indices of every member of the bucket's group (`group="row_members"`: of
    its row group) as device tensors, built once per bucket."""
    if group not in bucket.slot_cache:
        bucket.slot_cache[group] = [
            torch.tensor(m.rows, dtype=torch.long, device=device) for m in getattr(bucket, group)]
    return bucket.slot_cache[group]


def piece_all_rows_plan(bucket) -> PiecePlan:
    """Muon/NorMuon: every member sends all its rows; the owner holds whole matrices (K = rows)."""
    if "all" not in bucket.slot_cache:
        rows, count = bucket.shape[0], bucket.count
        device = bucket.momentum.device
        owned = len(bucket.owned(bucket.rank))
        base = torch.arange(owned, device=device)[:, None] * rows
        slots = [(base + held).reshape(-1) for held in _member_rows(bucket, device)]
        counts = [[len(m.rows)] * count for m in bucket.members]
        bucket.slot_cache["all"] = PiecePlan(counts, None, slots, rows, bucket.owners())
    return bucket.slot_cache["all"]


def piece_local_count(bucket, fraction: float, member: int) -> int:
    """"local" scope on a general layout: ⌈f·b⌉ rows (b = bucket.chunk, the most rows any member
    holds), capped by the rows this member holds; the same rule as the row-sharded path."""
    held = len(bucket.members[member].rows)
    return min(rules.selected_row_count(bucket.chunk, fraction), held) if bucket.chunk else 0


def piece_local_plan(bucket, scores: Tensor, fraction: float) -> PiecePlan:
    """Each row shard's own top rows by full-row L1 score (scores: [N, rows held], already summed
    over the column shards, so the members of a row shard pick the same rows); static counts,
    no host sync. On the owner, row shard q's rows fill slots [offset_q, offset_q + k_q)."""
    count, device = bucket.count, bucket.momentum.device
    counts_key = ("local_counts", fraction)  # a per-member loop: not redone every step
    if counts_key not in bucket.slot_cache:
        bucket.slot_cache[counts_key] = [piece_local_count(bucket, fraction, s) for s in range(bucket.world_size)]
    ks = bucket.slot_cache[counts_key]
    key = ("local", tuple(ks))  # slots by the counts, as local_plan: few entries under a fraction schedule
    if key not in bucket.slot_cache:
        classes = bucket.row_classes()
        first = {q: s for s, q in reversed(list(enumerate(classes)))}
        offsets, total = {}, 0
        for q in sorted(first):
            offsets[q], total = total, total + ks[first[q]]
        owned = len(bucket.owned(bucket.rank))
        base = torch.arange(owned, device=device)[:, None] * total
        slots = [(base + offsets[q] + torch.arange(k, device=device)).reshape(-1) for q, k in zip(classes, ks)]
        bucket.slot_cache[key] = ([[k] * count for k in ks], slots, total)
    counts, slots, total = bucket.slot_cache[key]
    k = counts[bucket.rank][0]
    if k == 0:
        return PiecePlan(counts, scores.new_empty((0,), dtype=torch.long), slots, total, bucket.owners())
    return PiecePlan(counts, _flatten_rows(rules.top_rows(scores, k), scores.shape[1]), slots, total, bucket.owners())


def piece_padded_scores(bucket, scores: Tensor) -> Tensor:
    """[N, b] float32 full-row scores of this rank's rows, b = the most rows any member holds
    (bucket.chunk; every row set is held by some member of the row group); padding scores −1
    (real scores are ≥ 0)."""
    padded = scores.new_full((bucket.count, bucket.chunk), -1.0, dtype=torch.float32)
    padded[:, : scores.shape[1]] = scores
    return padded


def piece_global_plan(bucket, gathered: Tensor, fraction: float) -> PiecePlan:
    """Exact top-k rows of every whole matrix (k from the true row count) from the full-row
    scores [R, N, b] of the row group's members (bucket.row_members: every row once; the other
    column shards hold the same summed scores, so every member computes the same selection).
    One host sync for the split sizes. On the owner, matrix rows are in ascending global order."""
    rows, count, device = bucket.shape[0], bucket.count, gathered.device
    held = _member_rows(bucket, device)
    whole = gathered.new_full((count, rows), -1.0)
    for r, index in enumerate(_member_rows(bucket, device, "row_members")):
        whole[:, index] = gathered[r, :, : index.numel()]
    k = rules.selected_row_count(rows, fraction)
    selected = torch.zeros((count, rows), dtype=torch.bool, device=device)
    selected.scatter_(1, rules.top_rows(whole, k), True)
    slot = selected.cumsum(1) - 1  # position of each selected row among its matrix's k
    masks = [selected[:, r] for r in held]  # [N, rows held by s]
    counts = torch.stack([m.sum(1) for m in masks]).tolist()
    mine = bucket.owned(bucket.rank)
    base = torch.arange(len(mine), device=device)[:, None] * k
    slots = [(base + slot[mine.start : mine.stop][:, r])[m[mine.start : mine.stop]] for r, m in zip(held, masks)]
    local_rows = masks[bucket.rank].reshape(-1).nonzero().squeeze(1)
    return PiecePlan(counts, local_rows, slots, k, bucket.owners())
