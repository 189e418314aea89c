"""Normalize the user's `distributed_mesh` and the process groups of mesh axes.

Accepted meshes: None (single device, or DTensor parameters, each on its own mesh), a DeviceMesh
of 1-3 axes (the parameters' mesh or a sub-mesh of it, e.g. HSDP's shard sub-mesh), or a
ProcessGroup (DDP). How each parameter lies on its mesh is read by distributed/layout.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
import torch
from torch import Tensor

try:  # DTensor moved out of the private namespace in torch 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - older torch
    DeviceMesh = ()  # type: ignore


@dataclass(frozen=True)
class MeshInfo:
    group: "dist.ProcessGroup"
    world_size: int
    rank: int  # rank inside `group`
    kind: str  # "device_mesh" or "process_group"
    device_mesh: Optional["DeviceMesh"] = None


def resolve_mesh(distributed_mesh) -> Optional[MeshInfo]:
    """None → None (single device, or DTensor parameters that carry their own meshes); a
    DeviceMesh of any dimension (its group: the product of all its axes) or a ProcessGroup (DDP)
    → MeshInfo; anything else → ValueError."""
    if distributed_mesh is None:
        return None
    if isinstance(distributed_mesh, DeviceMesh):
        return axes_group(distributed_mesh, tuple(range(distributed_mesh.ndim)))
    if isinstance(distributed_mesh, dist.ProcessGroup):
        group = distributed_mesh
        return MeshInfo(group, dist.get_world_size(group), dist.get_rank(group), "process_group")
    raise ValueError(
        "distributed_mesh must be None (single device, or DTensor parameters: each one's own mesh "
        "is read), a torch DeviceMesh (1-, 2- or 3-D) or a torch.distributed ProcessGroup (DDP), "
        f"got {type(distributed_mesh).__name__}"
    )


def coordinate_of(mesh: "DeviceMesh", global_rank: int) -> tuple[int, ...]:
    """Mesh coordinate of a global rank, read from the mesh's rank tensor."""
    where = (mesh.mesh == global_rank).nonzero()
    if where.shape[0] != 1:
        raise ValueError(f"rank {global_rank} is not in {mesh}")
    return tuple(int(c) for c in where[0])


_AXIS_GROUPS: dict[tuple, tuple["DeviceMesh", MeshInfo]] = {}  # (id(mesh), axes) → (mesh, its groups)


def axes_group(mesh: "DeviceMesh", axes: tuple[int, ...]) -> Optional[MeshInfo]:
    """MeshInfo of the product of `axes` of `mesh` around this rank (None for no axes).

    One axis uses the mesh's own group; a product of axes gets process groups created on every
    rank together (dist.new_subgroups_by_enumeration), once per (mesh, axes) and kept: this is
    called at construction, in the same order on all ranks, never per step."""
    if not axes:
        return None
    key = (id(mesh), tuple(axes))  # by identity: an equal mesh made later has groups of its own
    if key not in _AXIS_GROUPS or _AXIS_GROUPS[key][0] is not mesh:
        if len(axes) == 1:
            group = mesh.get_group(axes[0])
        else:
            others = [a for a in range(mesh.ndim) if a not in axes]
            size = 1
            for a in axes:
                size *= mesh.mesh.shape[a]
            ranks = mesh.mesh.permute(*others, *axes).reshape(-1, size).tolist()
            group, _ = dist.new_subgroups_by_enumeration(ranks)
        _AXIS_GROUPS[key] = mesh, MeshInfo(group, dist.get_world_size(group), dist.get_rank(group), "device_mesh", mesh)
    return _AXIS_GROUPS[key][1]


def group_coordinates(info: MeshInfo, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The mesh coordinate of every member of info's group (the product of `axes` around this
    rank), in group-rank order: a process group orders its members by global rank, which need
    not be the mesh's order along the axes."""
    mesh = info.device_mesh
    mine = coordinate_of(mesh, dist.get_rank())
    members = []
    for index in torch.cartesian_prod(*[torch.arange(mesh.mesh.shape[a]) for a in axes]).reshape(-1, len(axes)).tolist():
        coordinate = list(mine)
        for axis, value in zip(axes, index):
            coordinate[axis] = value
        members.append((int(mesh.mesh[tuple(coordinate)]), tuple(coordinate)))
    members.sort()
    if members[info.rank][1] != mine:
        raise RuntimeError(f"process group of mesh axes {axes} of {mesh} does not order its members by global rank")
    return [coordinate for _, coordinate in members]


def is_dtensor(tensor: Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_row_span(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) that `rank` holds under torch.chunk semantics (the last ranks may hold
    fewer rows, or none): chunk = ⌈rows/W⌉ from the global shape, so no per-step sync."""
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def all_ranks_true(flags: Tensor, mesh: Optional[MeshInfo]) -> Tensor:
    """Elementwise AND of a bool tensor over the group (e.g. "this gradient is finite"); mesh
    None (DTensor parameters on their own meshes): over all ranks."""
    agreed = flags.to(torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=None if mesh is None else mesh.group)
    return agreed.bool()
