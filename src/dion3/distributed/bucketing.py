"""Bucketing plans for the distributed step, all derived from global shapes (no per-step sync).

Matrix parameters of a group are bucketed by (layout, global matrix shape, dtype, device).
Replicated buckets are the optimizer's ordinary stacked buckets. Sharded parameters go to
LayoutBuckets (bucket.py; ShardedBucket for plain row sharding over one axis, FSDP2's case),
whose state is stacked local buffers [N, rows held, cols held]; the per-parameter state entries
are DTensors with the parameter's placements whose local tensors are views into those buffers,
so distributed checkpoints see ordinary sharded state while the step runs batched (state.py).

Sharded parameters of num_heads / split_sizes groups go to LayoutBuckets, one entry per block
(MatrixLayout.block); each parameter owns local state of its own piece's shape (a DTensor of its
placements in the state entry), which such buckets reach through `pieces`, stacked per step.

The owners of every sharded bucket's matrices are set here, once (owners.py).
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import Tensor

from .. import blocks
from ..buckets import Bucket, add_matrix
from ..ortho import input_scaling
from ..ortho.cost import step_flops
from ..rules import selected_row_count
from .bucket import BlockCut, LayoutBucket, ShardedBucket
from .layout import Axes, MatrixLayout, classify, matrix_shape, member_layouts
from .mesh import MeshInfo, Shard, axes_group, group_coordinates, is_dtensor, local_tensor, within_mesh
from .owners import Owners, assign_owners, matrix_cost, owned_matrices, owner_bytes
from .selection import local_count
from .state import allocate_block_pieces, allocate_layout_state

__all__ = ["BlockCut", "LayoutBucket", "Owners", "ShardedBucket", "build_buckets", "owned_matrices", "owner_cost"]


def _layout_key(p: Tensor, flatten: bool) -> tuple:
    return ("layout", p.device_mesh, tuple(p.placements), tuple(p.shape), flatten)


def build_buckets(optimizer, group: dict, mesh: Optional[MeshInfo]) -> list:
    """Buckets of one matrix group, in the order of the group's parameters (the same on every
    rank). `mesh`: the optimizer's distributed_mesh (None: each DTensor parameter's own mesh).
    Replicated buckets (buckets.Bucket) use the optimizer's own state allocation; sharded ones
    are LayoutBuckets whose owners are read with bucket.owned(member) / bucket.owners()."""
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
        if not axes.matrix and not axes.batch:  # replicated DTensor: split the work like DDP
            info = axes_group(p.device_mesh, tuple(range(p.device_mesh.ndim)))
            add_matrix(buckets, ("replicate", p.device_mesh), p, local, group, info)
            continue
        sizes = _block_sizes(p, label, group)
        if len(sizes) > 1:  # one entry per block, cut as the parameter is
            _add_blocks(buckets, p, local, axes, sizes, flatten)
            continue
        fast = _row_sharded_axis(p, axes, flatten)
        if fast is not None:  # rows in torch.chunk blocks over one axis (FSDP2, HSDP)
            key = ("shard", matrix_shape(p, flatten), p.dtype, local.device, p.device_mesh, fast)
        else:
            key = (*_layout_key(p, flatten), p.dtype, local.device)
        if key not in buckets:
            info = axes_group(p.device_mesh, axes.matrix)
            kind = LayoutBucket if fast is None else ShardedBucket
            buckets[key] = kind(matrix_shape(p, flatten), info, member_layouts(p, info, axes.matrix, flatten),
                                *_axis_groups(p, axes, flatten))
        bucket = buckets[key]
        bucket.params.append(p)
        bucket.views.append(local.reshape(bucket.local.local_shape))
    sharded = [b for b in buckets.values() if isinstance(b, LayoutBucket)]
    fraction = optimizer.rule_config(group).fraction
    assign_owners(sharded, lambda b: tuple(dist.get_process_group_ranks(b.mesh.group)),
                  lambda b: owner_cost(b, group, fraction))
    owned: dict[int, dict[str, Tensor]] = {}  # per-parameter state of blocked parameters
    for bucket in sharded:
        if bucket.cuts is None:
            allocate_layout_state(bucket, group, optimizer.state)
        else:
            allocate_block_pieces(bucket, group, optimizer.state, owned)
    optimizer._allocate_buckets([b for b in buckets.values() if isinstance(b, Bucket)], group)
    return list(buckets.values())


def owner_cost(bucket: LayoutBucket, group: dict, fraction: Optional[float]) -> float:
    """Seconds one matrix of a sharded bucket costs its owner (owners.matrix_cost): the executed
    FLOPs of the orthogonalizer the step runs on its K × cols rows on this device (K: the rows
    each matrix has on its owner at the group's fraction when the optimizer is built), plus the
    bytes of those rows coming in and going back in that orthogonalizer's compute dtype.
    Parameters on the meta device (planning a run without its devices) are priced as on a GPU
    with the symmetric kernels, whose rows travel in half precision."""
    rows, cols = bucket.shape
    k = _rows_on_owner(bucket, group, fraction)
    like = bucket.views[0]
    method, coefficients = group["orthogonalizer"], group["ns_coefficients"]
    flops = step_flops(k, cols, like.device, method, coefficients, like.dtype)
    if like.device.type == "meta":
        wire = 2
    else:
        wire = input_scaling(k, cols, like.device, method, coefficients, like.dtype).dtype.itemsize
    moved = 0.0 if bucket.holder() is not None else owner_bytes(k, cols, bucket.world_size, wire)
    return matrix_cost(flops, moved)


def _rows_on_owner(bucket: LayoutBucket, group: dict, fraction: Optional[float]) -> int:
    """K: every row (Muon, NorMuon); Dion3 "global": k = ⌈f·rows⌉; "local": each row shard's
    own ⌈f·b⌉ rows, capped by what it holds (selection.local_count), summed over the row sets."""
    if fraction is None:
        return bucket.shape[0]
    if group["selection_scope"] != "local":
        return selected_row_count(bucket.shape[0], fraction)
    first = {}
    for member, row_set in enumerate(bucket.row_classes()):
        first.setdefault(row_set, member)
    return sum(local_count(bucket, fraction, member) for member in first.values())


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


def _row_sharded_axis(p: Tensor, axes: Axes, flatten: bool) -> Optional[int]:
    """The axis of plain row sharding (Shard(0) rows over one axis whose process group orders
    its members as the mesh does, nothing else sharded): a ShardedBucket; else None."""
    if axes.batch or axes.cols or len(axes.rows) != 1 or (p.dim() != 2 and not flatten):
        return None
    axis = axes.rows[0]
    if type(p.placements[axis]) is not Shard:  # _StridedShard rows are not torch.chunk blocks
        return None
    info = axes_group(p.device_mesh, (axis,))
    coords = group_coordinates(info, (axis,))
    return axis if all(c[axis] == g for g, c in enumerate(coords)) else None


def _check_mesh(p: Tensor, label: str, axes: Axes, mesh: Optional[MeshInfo]) -> None:
    """A DTensor parameter and the optimizer's distributed_mesh must agree: the distributed_mesh is
    the parameter's own mesh, or one the parameter's mesh is a sub-mesh of (the world mesh of
    FSDP2 + TP, for an FSDP-only layer on world["dp"]), or (as for HSDP's shard sub-mesh) a 1-D
    mesh whose group is the parameter's one sharded axis. Either way the parameter steps on its
    own mesh, as with distributed_mesh=None."""
    if mesh is None:
        return
    if mesh.kind != "device_mesh":
        raise ValueError(
            f"parameter {label} is a DTensor (placements {tuple(p.placements)}) but distributed_mesh is "
            "a ProcessGroup; pass distributed_mesh=None (each DTensor's own mesh is read) or its DeviceMesh"
        )
    given = mesh.device_mesh
    if within_mesh(p.device_mesh, given):
        return
    sharded = axes.matrix + axes.batch
    if given.ndim == 1 and len(sharded) == 1 and p.device_mesh.get_group(sharded[0]) == given.get_group():
        return
    raise ValueError(
        f"parameter {label} lives on {p.device_mesh} with placements {tuple(p.placements)}, which is neither "
        f"the distributed_mesh {given} nor a sub-mesh of it (cut from the same root mesh over some of its axes), "
        "and the distributed_mesh is no 1-D sub-mesh of its one sharded axis; pass "
        "distributed_mesh=None to read each parameter's own mesh and placements"
    )
