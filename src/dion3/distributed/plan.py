"""Bucketing plans for the distributed step, all derived from global shapes (no per-step sync).

Matrix parameters of a group are bucketed by (layout, global matrix shape, dtype, device).
Replicated buckets are the optimizer's ordinary stacked buckets. Row-sharded buckets keep their
state in local stacked buffers padded to ⌈rows/W⌉ rows per rank ([N, chunk, cols]); padding rows
stay zero forever. The per-parameter state entries are DTensors with the parameter's placements
whose local tensors are views into those buffers, so distributed checkpoints see ordinary
sharded state while the step runs batched (allocated by state.py).

Sharded parameters of num_heads / split_sizes groups go to LayoutBuckets, one entry per block
(MatrixLayout.block); each parameter owns local state of its own piece's shape (a DTensor of its
placements in the state entry), which such buckets reach through `pieces`, stacked per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import NamedTuple, Optional

import torch.distributed as dist
from torch import Tensor

from .. import blocks
from ..buckets import Bucket, add_matrix
from .layout import Axes, MatrixLayout, classify, matrix_shape, member_layouts
from .mesh import MeshInfo, Shard, axes_group, group_coordinates, is_dtensor, local_row_span, local_tensor
from .state import allocate_block_pieces, allocate_layout_state, allocate_sharded_state


class Owners:
    """The owner mapping of the sharded bucket types (ShardedBucket, LayoutBucket): which
    matrices each member of the bucket's group orthogonalizes. Senders and receivers both ask
    it, so they agree; `first_owner` is set once at construction by _spread_owners."""

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


@dataclass
class ShardedBucket(Owners):
    """Same-shape row-sharded matrices of one group; each rank holds rows [start, stop) of each."""

    shape: tuple[int, int]  # global (rows, cols)
    world_size: int
    rank: int
    params: list[Tensor] = field(default_factory=list)
    views: list[Tensor] = field(default_factory=list)  # local shard of each param as [1, local_rows, cols]
    momentum: Optional[Tensor] = None  # [N, chunk, cols], rows ≥ local_rows are zero padding
    variance: Optional[Tensor] = None  # [N, chunk, 1] float32 (NorMuon / Dion3)
    slot_cache: dict = field(default_factory=dict)  # owner slots of plans with static split sizes
    mesh: Optional[MeshInfo] = None  # the row-sharding axis' group (rank = mesh coordinate)
    first_owner: int = 0  # owners are consecutive members from here (spreads small buckets)

    @property
    def chunk(self) -> int:
        return -(-self.shape[0] // self.world_size)

    def rows_of(self, rank: int) -> int:
        start, stop = local_row_span(self.shape[0], self.world_size, rank)
        return stop - start

    @property
    def local_rows(self) -> int:
        return self.rows_of(self.rank)

    @property
    def count(self) -> int:
        return len(self.params)


def owned_matrices(count: int, world_size: int, rank: int) -> range:
    """Matrices of a bucket that `rank` orthogonalizes: contiguous blocks of ⌈N/W⌉."""
    block = -(-count // world_size)
    return range(min(rank * block, count), min((rank + 1) * block, count))


def owners_used(count: int, world_size: int) -> int:
    """How many members get a (non-empty) block of ⌈N/W⌉ of `count` matrices."""
    return -(-count // -(-count // world_size)) if count else 0


class BlockCut(NamedTuple):
    """Where a LayoutBucket entry that is a block of a fused weight lies in its parameter."""

    whole: tuple[int, int, int]  # the parameter's local piece as [B, rows held, cols held]
    rows: slice  # the local rows of that piece that hold the block
    param_rows: int  # the rows of each of the parameter's (global) matrices


@dataclass
class LayoutBucket(Owners):
    """Same-layout matrices of one group in the general case (any mix of row, column, strided
    and expert sharding): each rank holds a block of rows (any index set) and a column range of
    each matrix, described for every member of the matrix axes' group by `members`.

    A "matrix" of the bucket is one matrix of one parameter (an expert of a 3-D stack counts as
    one), or one block of its rows (`cuts`); all entries of a bucket share their global matrix
    shape, mesh and member pieces, so every member holds the same matrices of the bucket, each
    cut the same way."""

    shape: tuple[int, int]  # global (rows, cols) of each matrix
    mesh: Optional[MeshInfo]  # group over the axes that split rows or columns; None: whole matrices here
    members: list[MatrixLayout]  # every group member's piece, in group-rank order
    col_mesh: Optional[MeshInfo] = None  # group over the column axes: sums partial row scores
    # Group over the row axes around this rank (None: no axis splits rows), and its members'
    # pieces in its group-rank order: they hold every row once, at this rank's columns, so
    # global selection gathers full-row scores over it (one copy per row set, not one per
    # column shard as over `mesh`).
    row_mesh: Optional[MeshInfo] = None
    row_members: list[MatrixLayout] = field(default_factory=list)
    params: list[Tensor] = field(default_factory=list)
    views: list[Tensor] = field(default_factory=list)  # local piece of each param as [B, rows held, cols held]
    momentum: Optional[Tensor] = None  # [N, rows held, cols held]
    variance: Optional[Tensor] = None  # [N, rows held, 1] float32 (NorMuon / Dion3)
    slot_cache: dict = field(default_factory=dict)  # static plans and index tensors, built once
    first_owner: int = 0  # owners are consecutive members from here (spreads small buckets)
    # Blocks of fused weights (num_heads / split_sizes groups): per entry, the parameter's whole
    # local piece shape [B, rows, cols] and the slice of its local rows that hold the block;
    # None: every entry is a whole parameter. Such buckets step through `pieces` (views of each
    # block's rows of the parameter-shaped state), stacked per step like the replicated ones.
    cuts: Optional[list["BlockCut"]] = None
    pieces: Optional[dict[str, list[Tensor]]] = None

    def grads(self) -> list[Tensor]:
        """Each entry's local gradient as [B, rows held, cols held] (its block's rows of it)."""
        if self.cuts is None:
            return [local_tensor(p.grad).reshape(v.shape) for p, v in zip(self.params, self.views)]
        return [local_tensor(p.grad).reshape(cut.whole)[:, cut.rows] for p, cut in zip(self.params, self.cuts)]

    def holder(self) -> Optional[int]:
        """The member holding every row and column of the matrices, for buckets of blocks (a
        block of a fused weight that lies on one rank: its rows then never travel; whole
        parameters are spread over the members as usual), else None."""
        if self.cuts is None or self.mesh is None:
            return None
        whole = [s for s, m in enumerate(self.members)
                 if len(m.rows) == self.shape[0] and m.cols == (0, self.shape[1])]
        return whole[0] if whole else None

    @property
    def rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.rank

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def local(self) -> MatrixLayout:
        return self.members[self.rank]

    @property
    def count(self) -> int:
        return sum(v.shape[0] for v in self.views)

    @cached_property  # members are fixed when the bucket is built
    def chunk(self) -> int:
        """The most rows any member holds (ShardedBucket's ⌈rows/W⌉): the block that "local"
        selection takes ⌈f·chunk⌉ rows of, and the width of the gathered scores."""
        return max(len(m.rows) for m in self.members)

    def row_classes(self) -> list[int]:
        """Per member: the index of its row set among the distinct row sets (members of one
        class differ only in columns and send the same rows)."""
        seen: dict[tuple, int] = {}
        return [seen.setdefault(m.rows, len(seen)) for m in self.members]


def _layout_key(p: Tensor, flatten: bool) -> tuple:
    return ("layout", p.device_mesh, tuple(p.placements), tuple(p.shape), flatten)


def build_buckets(optimizer, group: dict, mesh: Optional[MeshInfo]) -> list:
    """Buckets of one matrix group. `mesh`: the optimizer's distributed_mesh (None: each DTensor
    parameter's own mesh). Replicated buckets use the optimizer's own state allocation."""
    buckets: dict[tuple, object] = {}
    for index, p in enumerate(group["params"]):
        label = optimizer._param_label(group, index)
        local = local_tensor(p.detach())
        flatten = group["flatten"]
        if not is_dtensor(p):  # one entry per block of a num_heads/split_sizes group
            add_matrix(buckets, ("replicate",), p, local, group, mesh)
            continue
        axes = classify(p, label, flatten)
        _check_mesh(p, label, axes, mesh)
        fast = _row_sharded_axis(p, axes, flatten)
        if not axes.matrix and not axes.batch:  # replicated DTensor: split the work like DDP
            info = axes_group(p.device_mesh, tuple(range(p.device_mesh.ndim)))
            add_matrix(buckets, ("replicate", p.device_mesh), p, local, group, info)
            continue
        sizes = _block_sizes(p, label, group)
        if len(sizes) > 1:  # one general-path entry per block, cut as the parameter is
            _add_blocks(buckets, p, local, axes, sizes, flatten)
            continue
        if fast is not None:  # rows in torch.chunk blocks over one axis (FSDP2, HSDP)
            info = axes_group(p.device_mesh, (fast,))
            shape = (p.shape[0], p.numel() // max(p.shape[0], 1))
            key = ("shard", shape, p.dtype, local.device, p.device_mesh, fast)
            bucket = buckets.setdefault(key, ShardedBucket(shape, info.world_size, info.rank, mesh=info))
            view = local.reshape(1, local.shape[0], shape[1])
        else:
            key = (*_layout_key(p, flatten), p.dtype, local.device)
            if key not in buckets:
                info = axes_group(p.device_mesh, axes.matrix)
                buckets[key] = LayoutBucket(
                    matrix_shape(p, flatten), info, member_layouts(p, info, axes.matrix, flatten),
                    *_axis_groups(p, axes, flatten))
            bucket = buckets[key]
            view = local.reshape(bucket.local.local_shape)
        bucket.params.append(p)
        bucket.views.append(view)
    _spread_owners([b for b in buckets.values() if isinstance(b, Owners)])
    owned: dict[int, dict[str, Tensor]] = {}  # per-parameter state of blocked parameters
    for bucket in buckets.values():
        if isinstance(bucket, ShardedBucket):
            allocate_sharded_state(bucket, group, optimizer.state)
        elif isinstance(bucket, LayoutBucket) and bucket.cuts is None:
            allocate_layout_state(bucket, group, optimizer.state)
        elif isinstance(bucket, LayoutBucket):
            allocate_block_pieces(bucket, group, optimizer.state, owned)
    optimizer._allocate_buckets([b for b in buckets.values() if isinstance(b, Bucket)], group)
    return list(buckets.values())


def _block_sizes(p: Tensor, label: str, group: dict) -> tuple[int, ...]:
    """Row counts of the blocks of a sharded parameter's matrices ((rows,): no split)."""
    rows = matrix_shape(p, group["flatten"])[0]
    try:  # .get: groups restored from checkpoints of versions without block options lack the keys
        return blocks.block_sizes(rows, group.get("num_heads"), group.get("split_sizes"))
    except ValueError as error:
        raise ValueError(f"parameter {label} {error}") from None


def _add_blocks(buckets: dict, p: Tensor, local: Tensor, axes: Axes, sizes: tuple[int, ...], flatten: bool) -> None:
    """One LayoutBucket entry per block of a sharded parameter: each member's piece of the block
    is its piece of the parameter restricted to the block's rows (MatrixLayout.block), and its
    local view is a slice of the parameter's local rows. Blocks cut the same way on every member
    (and of the same shape) share a bucket, whichever parameter they come from."""
    info = axes_group(p.device_mesh, axes.matrix)
    whole = member_layouts(p, info, axes.matrix, flatten)
    col_mesh, row_mesh, row_whole = _axis_groups(p, axes, flatten)
    rank = 0 if info is None else info.rank
    cols = matrix_shape(p, flatten)[1]
    matrices = local.reshape(whole[rank].local_shape)
    for start, stop in blocks.row_ranges(sizes):
        cut = [m.block(start, stop) for m in whole]
        members = [piece for piece, _ in cut]
        key = ("block", p.device_mesh, axes, (stop - start, cols), tuple(members), flatten, p.dtype, local.device)
        if key not in buckets:
            buckets[key] = LayoutBucket((stop - start, cols), info, members, col_mesh, row_mesh,
                                        [m.block(start, stop)[0] for m in row_whole], cuts=[])
        bucket = buckets[key]
        rows = cut[rank][1]
        bucket.params.append(p)
        bucket.views.append(matrices[:, rows])
        bucket.cuts.append(BlockCut(whole[rank].local_shape, rows, sum(sizes)))


def _axis_groups(p: Tensor, axes: Axes, flatten: bool) -> tuple[Optional[MeshInfo], Optional[MeshInfo], list[MatrixLayout]]:
    """A LayoutBucket's column group, row group and the row group's member pieces (built at
    construction, in parameter order, so every rank creates the same process groups)."""
    col_mesh = axes_group(p.device_mesh, axes.cols)
    row_mesh = axes_group(p.device_mesh, axes.rows)
    return col_mesh, row_mesh, member_layouts(p, row_mesh, axes.rows, flatten)


def _spread_owners(buckets: list[Owners]) -> None:
    """Buckets of fewer matrices than members (TP layouts have few same-shape matrices; FSDP2
    over more ranks than a model has layers) would all be owned by the first members: start
    each bucket's owners where the previous bucket over the same members stopped, whatever its
    type, without wrapping around (the order in which the same buckets are built is the same on
    every rank, so every member agrees). Buckets are matched by the global ranks of their group,
    not by group object: each parameter's mesh is an object of its own."""
    next_owner: dict[tuple[int, ...], int] = {}
    for bucket in buckets:
        if bucket.mesh is None or bucket.holder() is not None:
            continue
        world, used = bucket.world_size, owners_used(bucket.count, bucket.world_size)
        members = tuple(dist.get_process_group_ranks(bucket.mesh.group))
        bucket.first_owner = next_owner.get(members, 0) % (world - used + 1)
        next_owner[members] = bucket.first_owner + used


def _row_sharded_axis(p: Tensor, axes: Axes, flatten: bool) -> Optional[int]:
    """The axis of the fast row-sharded path (plain Shard(0) rows over one axis whose process
    group orders its members as the mesh does, nothing else sharded), else None."""
    if axes.batch or axes.cols or len(axes.rows) != 1 or (p.dim() != 2 and not flatten):
        return None
    axis = axes.rows[0]
    if type(p.placements[axis]) is not Shard:  # _StridedShard rows are not torch.chunk blocks
        return None
    info = axes_group(p.device_mesh, (axis,))
    coords = group_coordinates(info, (axis,))
    return axis if all(c[axis] == g for g, c in enumerate(coords)) else None


def _check_mesh(p: Tensor, label: str, axes: Axes, mesh: Optional[MeshInfo]) -> None:
    """A DTensor parameter and the optimizer's distributed_mesh must agree: the parameter's own
    mesh, or (as for HSDP's shard sub-mesh) a 1-D mesh whose group is its one sharded axis."""
    if mesh is None:
        return
    if mesh.kind != "device_mesh":
        raise ValueError(
            f"parameter {label} is a DTensor (placements {tuple(p.placements)}) but distributed_mesh is "
            "a ProcessGroup; pass distributed_mesh=None (each DTensor's own mesh is read) or its DeviceMesh"
        )
    given = mesh.device_mesh
    if given == p.device_mesh:
        return
    sharded = axes.matrix + axes.batch
    if given.ndim == 1 and len(sharded) == 1 and p.device_mesh.get_group(sharded[0]) == given.get_group():
        return
    raise ValueError(
        f"parameter {label} lives on {p.device_mesh} with placements {tuple(p.placements)}, which is not "
        f"the distributed_mesh {given} (nor a 1-D sub-mesh of its one sharded axis); pass "
        "distributed_mesh=None to read each parameter's own mesh and placements"
    )
