"""Where each piece of a DTensor parameter lives, from its global shape, mesh and placements.

A matrix parameter is seen as a batch of matrices [*batch, rows, cols] (a 2-D weight has no
batch; a 3-D expert stack [E, out, in] has E). Every mesh axis does one of four things to it:
  Replicate                     every member of the axis holds the same data;
  Shard(d) / _StridedShard(d)   on the batch dim: splits the experts (whole matrices per rank);
                                on the row dim: splits rows (torch.chunk blocks; _StridedShard
                                rows are not contiguous in the global matrix);
  Shard(-1)                     on the column dim: splits every row into column blocks.
The placements are applied left to right (DTensor's convention) to the index range of each
tensor dim, at this rank's mesh coordinate, which gives exact global indices of every local
row, column and expert. The order of ranks on an axis is the mesh's, never the process ids'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor

from .mesh import MeshInfo, Replicate, Shard, group_coordinates

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = Shard  # type: ignore


def _sharding(placement) -> bool:
    """Shard or _StridedShard (not a subclass of Shard in every torch version)."""
    return isinstance(placement, (Shard, _StridedShard))


def split_indices(indices: Sequence[int], placement, parts: int, part: int) -> Sequence[int]:
    """The indices that part `part` of `parts` keeps when `placement` splits `indices`:
    torch.chunk blocks for Shard; for _StridedShard(split_factor=s), part `part` of each of the
    s torch.chunk blocks, concatenated (FSDP2's sharding inside TP blocks). A range stays a
    range under Shard (slicing a range costs nothing: planning a world of 1024 ranks splits
    thousands of them)."""
    def chunk(seq: Sequence[int], n: int, i: int) -> Sequence[int]:
        size = -(-len(seq) // n) if seq else 0
        return seq[i * size : (i + 1) * size] if size else seq[:0]

    if isinstance(placement, _StridedShard):
        factor = int(placement.split_factor)
        return [index for j in range(factor) for index in chunk(chunk(indices, factor, j), parts, part)]
    return chunk(indices, parts, part)



def matrix_shape(p: Tensor, flatten: bool) -> tuple[int, int]:
    """(rows, cols) of each matrix of a parameter: [rows, cols], [E, rows, cols], or flattened."""
    if flatten or p.dim() == 2:
        return p.shape[0], p.numel() // max(p.shape[0], 1)
    return p.shape[-2], p.shape[-1]

@dataclass(frozen=True)
class MatrixLayout:
    """One rank's piece of a parameter seen as [batch, rows, cols] (batch = 1 for a matrix)."""

    batch: tuple[int, ...]  # global batch (expert) indices held, in local order
    rows: tuple[int, ...]  # global row indices held, in local order
    cols: tuple[int, int]  # global column range [start, stop)

    @property
    def local_shape(self) -> tuple[int, int, int]:
        return len(self.batch), len(self.rows), self.cols[1] - self.cols[0]

    def block(self, start: int, stop: int) -> tuple["MatrixLayout", slice]:
        """This piece restricted to global rows [start, stop) of each matrix (a block of a fused
        weight, e.g. one head or the K of QKV), with rows counted from the block's start, and
        the local rows that hold them: local rows are in ascending global order under every
        placement (torch.chunk blocks, also inside _StridedShard), so a block's local rows are
        one contiguous slice and its local piece is a view."""
        inside = [i for i, r in enumerate(self.rows) if start <= r < stop]
        local = slice(inside[0], inside[-1] + 1) if inside else slice(0, 0)
        if len(inside) != local.stop - local.start:
            raise AssertionError(f"rows {self.rows} of block [{start}, {stop}) are not contiguous locally")
        return MatrixLayout(self.batch, tuple(self.rows[i] - start for i in inside), self.cols), local


@dataclass(frozen=True)
class Axes:
    """Mesh axes of a parameter by what they split."""

    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]

    @property
    def matrix(self) -> tuple[int, ...]:
        """Axes that split a matrix (rows or columns): its pieces meet over their product."""
        return tuple(sorted(self.rows + self.cols))


def matrix_dims(ndim: int, flatten: bool) -> tuple[Optional[int], int, int]:
    """(batch dim or None, row dim, col dim) of a parameter's tensor dims; flatten: rows are dim 0,
    columns everything after (only dim 0 may be sharded then)."""
    if ndim == 2 or flatten:
        return None, 0, 1
    return 0, ndim - 2, ndim - 1


def classify(param: Tensor, label: str, flatten: bool) -> Axes:
    """The axes of a DTensor parameter by role; ValueError naming the parameter for layouts the
    optimizer cannot step exactly."""
    batch_dim, row_dim, col_dim = matrix_dims(param.dim(), flatten)
    roles: dict[str, list[int]] = {"batch": [], "rows": [], "cols": []}
    placements = tuple(param.placements)
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if not _sharding(placement):  # Partial (pending reduction) or an unknown placement
            raise ValueError(
                f"parameter {label} has placements {placements}: {placement} on mesh dim {axis} is not "
                "Replicate, Shard or _StridedShard; step the optimizer on reduced parameters (Partial "
                "placements are gradients in flight, not weights)"
            )
        dim = placement.dim % param.dim()
        if flatten and param.dim() > 2 and dim != 0:
            raise ValueError(
                f"parameter {label} has placements {placements}: with flatten=True only dim 0 may be "
                f"sharded (dim {dim} is); shard dim 0, or read a 3-D expert stack with stacked=True instead"
            )
        role = "batch" if dim == batch_dim else "rows" if dim == row_dim else "cols" if dim == col_dim else None
        if role is None or (role == "batch" and param.dim() != 3):
            raise ValueError(
                f"parameter {label} has placements {placements}: sharding dim {dim} of its "
                f"{param.dim()}-D tensor is supported only on the experts of a 3-D stack (dim 0), the rows "
                f"(dim {row_dim}) or the columns (dim {col_dim}); reshape it or keep that dim replicated"
            )
        if role == "cols" and isinstance(placement, _StridedShard):
            raise ValueError(
                f"parameter {label} has placements {placements}: strided column sharding {placement} "
                "splits rows into non-contiguous column pieces, which is not supported; shard "
                "columns with Shard(1) only"
            )
        roles[role].append(axis)
    return Axes(tuple(roles["batch"]), tuple(roles["rows"]), tuple(roles["cols"]))


def matrix_layout(shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int],
                  coordinate: Sequence[int], flatten: bool) -> MatrixLayout:
    """The global batch/row/column indices that the rank at `coordinate` holds."""
    batch_dim, row_dim, col_dim = matrix_dims(len(shape), flatten)
    batch = range(_prod(shape[:-2])) if batch_dim is not None else range(1)
    rows = range(shape[row_dim])
    cols_total = shape[col_dim] if batch_dim is not None or len(shape) == 2 else _prod(shape[1:])
    cols = range(cols_total)
    for axis, placement in enumerate(placements):
        if not _sharding(placement):
            continue
        dim = placement.dim % len(shape)
        parts, part = mesh_shape[axis], coordinate[axis]
        if dim == batch_dim:
            batch = split_indices(batch, placement, parts, part)
        elif dim == row_dim:
            rows = split_indices(rows, placement, parts, part)
        else:
            cols = split_indices(cols, placement, parts, part)
    # Shard on columns keeps ranges (strided column sharding is refused in matrix_axes)
    contiguous = cols.step == 1 if isinstance(cols, range) else list(cols) == list(range(cols[0], cols[0] + len(cols)))
    if cols and not contiguous:
        raise AssertionError(f"non-contiguous columns {list(cols)}")
    start = cols[0] if cols else 0
    return MatrixLayout(tuple(batch), tuple(rows), (start, start + len(cols)))


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def member_layouts(param: Tensor, info: Optional[MeshInfo], axes: tuple[int, ...], flatten: bool) -> list[MatrixLayout]:
    """The layout of every member of `info`'s group, in group-rank order ([own] if None)."""
    mesh = param.device_mesh
    coords = [tuple(mesh.get_coordinate())] if info is None else group_coordinates(info, axes)
    shape, placements, mesh_shape = tuple(param.shape), tuple(param.placements), tuple(mesh.mesh.shape)
    return [matrix_layout(shape, placements, mesh_shape, c, flatten) for c in coords]
