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


def axes_members(mesh: "DeviceMesh", axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The global ranks of every group that the product of `axes` of `mesh` splits the mesh
    into, each sorted, the groups in mesh order: the same on every rank (read from the rank
    tensor), and equal for equal meshes however many DeviceMesh objects describe them."""
    others = [a for a in range(mesh.ndim) if a not in axes]
    size = 1
    for a in axes:
        size *= mesh.mesh.shape[a]
    ranks = mesh.mesh.permute(*others, *axes).reshape(-1, size).tolist()
    return tuple(tuple(sorted(int(r) for r in members)) for members in ranks)


# Process groups of mesh axes by (device type, backend, axes_members), for the life of the default
# process group they belong to (a destroyed and re-initialized default group starts an empty
# table). Each parameter of an FSDP2/TP model carries a DeviceMesh object of its own, and meshes
# made apart (two init_device_mesh calls) hold distinct groups of the same ranks: keyed by
# object, each would get or use communicators of its own.
_GROUPS: dict[tuple, "dist.ProcessGroup"] = {}
_GROUPS_WORLD: list = [None]  # the default group the table's groups belong to


def axes_group(mesh: "DeviceMesh", axes: tuple[int, ...]) -> Optional[MeshInfo]:
    """MeshInfo of the product of `axes` of `mesh` around this rank (None for no axes).

    One group per membership: one axis uses the group of the first mesh seen with those
    members (the mesh's own groups exist already); a product of axes gets process groups created
    on every rank together (dist.new_subgroups_by_enumeration) the first time its members are
    seen. Creating them is collective, so this is called at construction, in the same order on
    all ranks, never per step; whether a call creates groups depends only on the meshes and axes
    seen before, which every rank sees alike."""
    if not axes:
        return None
    axes = tuple(axes)
    world = dist.group.WORLD
    if _GROUPS_WORLD[0] is not world:  # a new default group: the old groups are gone
        _GROUPS.clear()
        _GROUPS_WORLD[0] = world
    members = axes_members(mesh, axes)
    if len(axes) == 1:
        own = mesh.get_group(axes[0])
        group = _GROUPS.setdefault((mesh.device_type, dist.get_backend(own), members), own)
    else:
        key = (mesh.device_type, dist.get_backend(world), members)
        if key not in _GROUPS:
            _GROUPS[key], _ = dist.new_subgroups_by_enumeration([list(m) for m in members])
        group = _GROUPS[key]
    # the mesh is this call's own: group_coordinates reads member coordinates from it
    return MeshInfo(group, dist.get_world_size(group), dist.get_rank(group), "device_mesh", mesh)


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
