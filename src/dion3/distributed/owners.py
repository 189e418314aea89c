"""Which member of a sharded bucket's group orthogonalizes each of its matrices.

Every member of the group computes the same mapping from the same inputs (the buckets are
built in the same order on every rank, from global shapes): no communication. A bucket's
matrices are owned in member order, so a sender's rows, which it keeps in matrix order, are
already grouped by owner for the all-to-all.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional


class Owners:
    """The owner mapping of a sharded bucket: which matrices each member of the bucket's group
    orthogonalizes. Senders and receivers both ask it, so they agree; `first_owner` is set once
    at construction by spread_owners."""

    first_owner: int
    count: int
    world_size: int

    def holder(self) -> Optional[int]:
        """The one member that orthogonalizes every matrix (its rows never travel), or None."""
        return None

    def owned(self, member: int) -> range:
        """Matrices `member` orthogonalizes: all of them for the holder, if any, else blocks of
        ⌈N/W⌉ for members first_owner, first_owner + 1, ... in member order, so the
        all-to-all's matrix order stays its member order. A subset of the bucket's matrices
        (entries without gradients this step) starts early enough to still fit in the members."""
        return self.owners()[member]

    def owners(self) -> tuple[range, ...]:
        """owned(member) for every member, built once per distinct mapping (asked for by every
        bucket's plan each step; W ranges each)."""
        return _owner_ranges(self.holder(), self.first_owner, self.count, self.world_size)


@lru_cache(maxsize=4096)
def _owner_ranges(holder: Optional[int], first_owner: int, count: int, world_size: int) -> tuple[range, ...]:
    if holder is not None:
        return tuple(range(0, count) if member == holder else range(0, 0) for member in range(world_size))
    first = min(first_owner, world_size - owners_used(count, world_size))
    return tuple(range(0, 0) if member < first else owned_matrices(count, world_size, member - first)
                 for member in range(world_size))


def owned_matrices(count: int, world_size: int, rank: int) -> range:
    """Matrices of a bucket that `rank` orthogonalizes: contiguous blocks of ⌈N/W⌉."""
    block = -(-count // world_size)
    return range(min(rank * block, count), min((rank + 1) * block, count))


def owners_used(count: int, world_size: int) -> int:
    """How many members get a (non-empty) block of ⌈N/W⌉ of `count` matrices."""
    return -(-count // -(-count // world_size)) if count else 0


def spread_owners(buckets: list, members_of) -> None:
    """Buckets of fewer matrices than members (TP layouts have few same-shape matrices; FSDP2
    over more ranks than a model has layers) would all be owned by the first members: start
    each bucket's owners where the previous bucket over the same members stopped, without
    wrapping around (the order in which the same buckets are built is the same on every rank,
    so every member agrees). members_of(bucket): the global ranks of its group, which match
    buckets over the same members (each parameter's mesh is an object of its own)."""
    next_owner: dict[tuple[int, ...], int] = {}
    for bucket in buckets:
        if bucket.mesh is None or bucket.holder() is not None:
            continue
        world, used = bucket.world_size, owners_used(bucket.count, bucket.world_size)
        members = members_of(bucket)
        bucket.first_owner = next_owner.get(members, 0) % (world - used + 1)
        next_owner[members] = bucket.first_owner + used
