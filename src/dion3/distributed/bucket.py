"""The bucket type of the distributed step's sharded matrices, below the planner that builds
buckets (bucketing.py), the state they own (state.py) and the pipeline that steps them.

A LayoutBucket holds same-layout matrices of one group (any mix of row, column, strided and
expert sharding): each rank holds a block of rows (any index set) and a column range of each
matrix, described for every member of the matrix axes' group by `members`. FSDP2's row
sharding (rows in torch.chunk blocks over one axis) is the configuration ShardedBucket names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Optional

from torch import Tensor

from .layout import MatrixLayout
from .mesh import MeshInfo, local_tensor
from .owners import Owners


class BlockCut(NamedTuple):
    """Where a LayoutBucket entry that is a block of a fused weight lies in its parameter."""

    whole: tuple[int, int, int]  # the parameter's local piece as [B, rows held, cols held]
    rows: slice  # the local rows of that piece that hold the block
    param_rows: int  # the rows of each of the parameter's (global) matrices


@dataclass
class LayoutBucket(Owners):
    """Same-layout matrices of one group, stepped together over the group of the axes that
    split them (`mesh`).

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
    owner_of: tuple[int, ...] = ()  # the member that orthogonalizes each matrix (owners.assign_owners)
    # Blocks of fused weights (num_heads / split_sizes groups): per entry, the parameter's whole
    # local piece shape [B, rows, cols] and the slice of its local rows that hold the block;
    # None: every entry is a whole parameter. Such buckets step through `pieces` (views of each
    # block's rows of the parameter-shaped state), stacked per step like the replicated ones.
    cuts: Optional[list[BlockCut]] = None
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
        """The most rows any member holds (⌈rows/W⌉ under FSDP2): the block that "local"
        selection takes ⌈f·chunk⌉ rows of, and the width of the gathered scores."""
        return max(len(m.rows) for m in self.members)

    @cached_property
    def whole_rows(self) -> bool:
        """Every member holds whole rows (no axis splits the columns): the owner places each
        received row with one indexed copy instead of one per member."""
        return all(m.cols == (0, self.shape[1]) for m in self.members)

    def row_classes(self) -> list[int]:
        """Per member: the index of its row set among the distinct row sets (members of one
        class differ only in columns and send the same rows)."""
        seen: dict[tuple, int] = {}
        return [seen.setdefault(m.rows, len(seen)) for m in self.members]


class ShardedBucket(LayoutBucket):
    """A LayoutBucket of plain row sharding (FSDP2 Shard(0), HSDP's shard axis): rows in
    torch.chunk blocks over one mesh axis, whole rows on every member. The planner builds one
    for such parameters and the pipeline steps it as any LayoutBucket; the type names the
    configuration (its row span on each member is local_row_span of the global shape)."""
