"""Which member of a sharded bucket's group orthogonalizes each of its matrices: balanced by
cost, not by count.

A matrix's cost to its owner is the time of its orthogonalization, FLOPs at a matmul rate,
plus the time of the bytes it makes the owner move (the other members' rows in, the result
back), at a link rate (matrix_cost). Within a bucket every matrix costs the same (one shape,
one k); across buckets costs differ by orders of magnitude (a Llama-8B gate matrix is 14× a k
matrix under Muon). Owners are assigned by longest processing time first (lpt_assign) over all
matrices of all buckets that share a group of members, the heaviest first, each to the member
with the least load so far.

Every member of a group computes the same mapping from the same inputs (the buckets are built
in the same order on every rank, from global shapes, and the costs are the same floating-point
expressions): no communication. A bucket's matrices are then owned in member order (owner_of
is non-decreasing; the matrices of a bucket are interchangeable), so a sender's rows, which it
keeps in matrix order, are already grouped by owner for the all-to-all.
"""
from __future__ import annotations

import heapq
from functools import lru_cache
from typing import Callable, Hashable, Optional, Sequence

from ..ortho.cost import H200_MATMUL_FLOPS

# The rates that weigh FLOPs against bytes (only their ratio matters for the assignment): an
# H200's measured bf16 dense matmul rate and one direction of its NVLink 4 (450 GB/s nominal).
MATMUL_FLOPS_PER_S = H200_MATMUL_FLOPS
LINK_BYTES_PER_S = 450e9


class Owners:
    """The owner mapping of a sharded bucket: owner_of[i] is the member that orthogonalizes
    matrix i (non-decreasing in i), set once at construction by assign_owners. Senders and
    receivers both ask it, so they agree. A subset of the bucket's matrices (entries without
    gradients this step) keeps each matrix's owner (buckets.bucket_subset)."""

    owner_of: tuple[int, ...] = ()
    world_size: int

    def holder(self) -> Optional[int]:
        """The one member that orthogonalizes every matrix (its rows never travel), or None."""
        return None

    def owned(self, member: int) -> range:
        """The matrices `member` orthogonalizes: a contiguous range, in member order."""
        return self.owners()[member]

    def owners(self) -> tuple[range, ...]:
        """owned(member) for every member, built once per distinct mapping (asked for by every
        bucket's plan each step; W ranges each)."""
        return owner_ranges(tuple(self.owner_of), self.world_size)


@lru_cache(maxsize=4096)
def owner_ranges(owner_of: tuple[int, ...], world_size: int) -> tuple[range, ...]:
    """Each member's contiguous range of matrices, from a non-decreasing owner per matrix."""
    counts = [0] * world_size
    for owner in owner_of:
        counts[owner] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def lpt_assign(costs: Sequence[float], ranks: int, loads: Optional[Sequence[float]] = None) -> list[int]:
    """Longest processing time first: the owner (0 ≤ owner < ranks) of each item. Items are
    taken by cost, largest first, ties in index order; each goes to the rank with the least
    load so far, ties to the lowest rank. `loads`: work the ranks hold already (default none).
    Deterministic: the same inputs give the same owners on every rank. Its largest load is at
    most 4/3 − 1/(3·ranks) times the optimum (Graham, 1969)."""
    if ranks < 1:
        raise ValueError(f"ranks must be ≥ 1, got {ranks}")
    start = [0.0] * ranks if loads is None else [float(x) for x in loads]
    if len(start) != ranks:
        raise ValueError(f"loads has {len(start)} entries for {ranks} ranks")
    heap = [(load, rank) for rank, load in enumerate(start)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[item] = rank
        heapq.heappush(heap, (load + costs[item], rank))
    return owners


def owner_bytes(rows_on_owner: int, cols: int, world_size: int, wire_bytes: int) -> float:
    """Bytes the owner of one matrix moves: the rows the other members hold come in, and the
    result goes back (an even share of the rows per member; nothing for one member)."""
    return 2.0 * rows_on_owner * cols * wire_bytes * (world_size - 1) / world_size


def matrix_cost(flops: float, moved_bytes: float) -> float:
    """Seconds one matrix costs its owner: its orthogonalization's executed FLOPs
    (dion3.ortho.cost) at the matmul rate plus the bytes it moves at the link rate."""
    return flops / MATMUL_FLOPS_PER_S + moved_bytes / LINK_BYTES_PER_S


def assign_owners(buckets: Sequence, members_of: Callable[[object], Hashable],
                  cost_of: Callable[[object], float]) -> None:
    """Set bucket.owner_of for every bucket (count, world_size, mesh, holder()): LPT over the
    matrices of all buckets whose groups have the same members (members_of(bucket): e.g. the
    global ranks of its group; each parameter's mesh is an object of its own), each matrix of
    a bucket costing cost_of(bucket). A bucket with a holder keeps every matrix on it (its load
    counts); a bucket without a group (mesh None) is its only member's."""
    by_members: dict[Hashable, list] = {}
    for bucket in buckets:
        if bucket.mesh is None:
            bucket.owner_of = (0,) * bucket.count
        else:
            by_members.setdefault(members_of(bucket), []).append(bucket)
    for same in by_members.values():
        world = same[0].world_size
        loads = [0.0] * world
        spread = []
        for bucket in same:
            holder = bucket.holder()
            if holder is None:
                spread.append(bucket)
                continue
            bucket.owner_of = (holder,) * bucket.count
            loads[holder] += cost_of(bucket) * bucket.count
        costs = [(bucket, cost_of(bucket)) for bucket in spread]
        items = [cost for bucket, cost in costs for _ in range(bucket.count)]
        owners = iter(lpt_assign(items, world, loads))
        for bucket in spread:
            bucket.owner_of = tuple(sorted(next(owners) for _ in range(bucket.count)))


def owned_matrices(count: int, world_size: int, rank: int) -> range:
    """Replicated (DDP) buckets: the matrices `rank` orthogonalizes, contiguous blocks of ⌈N/W⌉
    (the all-gather of the results needs equal blocks)."""
    block = -(-count // world_size)
    return range(min(rank * block, count), min((rank + 1) * block, count))
