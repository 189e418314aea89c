"""What the real optimizer decided, read off its buckets into plain numbers the cost model uses.

A `BucketPlan` describes one bucket of one rank's optimizer for every member of the bucket's
group: the piece of each matrix it holds, how many of the bucket's matrices it owns
(orthogonalizes), and its global rank. Everything here is read from the objects that
dion3.distributed.build_buckets made (owners included); nothing is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BucketPlan:
    kind: str  # "rows": rows/columns travel to owners; "replicated": DDP all-gather; "local": no exchange
    shape: tuple[int, int]  # global (rows, cols) of each matrix
    count: int  # matrices in the bucket (on every member)
    held: list[tuple[int, int]]  # per member: (rows, cols) of each matrix it holds
    owned: list[int]  # per member: matrices it orthogonalizes
    ranks: list[int]  # per member: its global rank
    row_class: list[int] = field(default_factory=list)  # per member: index of its row set
    col_group: int = 1  # members that split each row's columns (row scores are summed over them)
    row_group: int = 1  # members holding different rows at one column range (global scores gathered over them)
    chunk: int = 0  # the most rows any member holds

    @property
    def members(self) -> int:
        return len(self.held)


def describe(bucket, rank: int) -> BucketPlan:
    """BucketPlan of one bucket of the optimizer built on global rank `rank`."""
    import torch.distributed as dist

    rows, cols = (int(x) for x in bucket.shape)
    mesh = getattr(bucket, "mesh", None)
    members = getattr(bucket, "members", None)  # sharded buckets (LayoutBucket, ShardedBucket)
    if members is not None:
        if mesh is None:  # no axis splits the matrices: whole matrices here, stepped alone
            return _local(rows, cols, bucket.count, rank)
        held = [(len(m.rows), m.cols[1] - m.cols[0]) for m in members]
        col_mesh, row_mesh = getattr(bucket, "col_mesh", None), getattr(bucket, "row_mesh", None)
        return BucketPlan("rows", (rows, cols), bucket.count, held, _owned(bucket), _ranks(mesh, rank),
                          list(bucket.row_classes()), 1 if col_mesh is None else col_mesh.world_size,
                          1 if row_mesh is None else row_mesh.world_size, bucket.chunk)
    count = sum(v.shape[0] for v in bucket.views)
    if mesh is None:
        return _local(rows, cols, count, rank)
    from ...distributed import owned_matrices

    world = mesh.world_size
    return BucketPlan("replicated", (rows, cols), count, [(rows, cols)] * world,
                      [len(owned_matrices(count, world, s)) for s in range(world)],
                      list(dist.get_process_group_ranks(mesh.group)), [0] * world, 1, 1, rows)


def _local(rows: int, cols: int, count: int, rank: int) -> BucketPlan:
    return BucketPlan("local", (rows, cols), count, [(rows, cols)], [count], [rank], [0], 1, 1, rows)


def _owned(bucket) -> list[int]:
    return [len(matrices) for matrices in bucket.owners()]


def _ranks(mesh, rank: int) -> list[int]:
    import torch.distributed as dist

    return [rank] if mesh is None else list(dist.get_process_group_ranks(mesh.group))


def plans_of(optimizer, rank: int) -> list[BucketPlan]:
    """Every matrix bucket of an optimizer (its groups in order; scalar groups have none)."""
    return [describe(bucket, rank) for buckets in optimizer._buckets for bucket in buckets]


def owners_by_rank(plans: list[BucketPlan]) -> dict[int, list[int]]:
    """Global rank → matrices it owns in each bucket (a rank outside a bucket's group: 0)."""
    table: dict[int, list[int]] = {}
    for index, plan in enumerate(plans):
        for member, owned in enumerate(plan.owned):
            table.setdefault(plan.ranks[member], [0] * len(plans))[index] = owned
    return table


def same_owners(a: list[BucketPlan], b: list[BucketPlan]) -> bool:
    """Whether two ranks' optimizers agree on every bucket's shape, pieces and owners."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.count == y.count and x.held == y.held and x.owned == y.owned for x, y in zip(a, b))
