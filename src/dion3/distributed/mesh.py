"""Normalize the user's `distributed_mesh` and classify how each parameter is laid out on it.

Accepted meshes: None (single device), a 1-D DeviceMesh (FSDP2; for HSDP pass the shard
sub-mesh, e.g. mesh["shard"]), or a ProcessGroup (DDP). A parameter is either replicated on
the group (plain tensor, or DTensor with Replicate placements) or row-sharded (DTensor with
Shard(0) on the mesh's dimension and Replicate on every other dimension).
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
    """None → None (single device); 1-D DeviceMesh or ProcessGroup → MeshInfo; else ValueError."""
    if distributed_mesh is None:
        return None
    if isinstance(distributed_mesh, DeviceMesh):
        if distributed_mesh.ndim != 1:
            raise ValueError(
                f"distributed_mesh must be a 1-D DeviceMesh, got a {distributed_mesh.ndim}-D mesh "
                f"(dims {distributed_mesh.mesh_dim_names}); for HSDP pass the shard sub-mesh, e.g. mesh['shard']"
            )
        group = distributed_mesh.get_group()
        return MeshInfo(group, dist.get_world_size(group), dist.get_rank(group), "device_mesh", distributed_mesh)
    if isinstance(distributed_mesh, dist.ProcessGroup):
        group = distributed_mesh
        return MeshInfo(group, dist.get_world_size(group), dist.get_rank(group), "process_group")
    raise ValueError(
        "distributed_mesh must be None (single device), a 1-D torch DeviceMesh (FSDP2; the shard "
        f"sub-mesh for HSDP) or a torch.distributed ProcessGroup (DDP), got {type(distributed_mesh).__name__}"
    )


def is_dtensor(tensor: Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_row_sharded(param: Tensor, mesh: MeshInfo, label: str) -> bool:
    """True for Shard(0) on the optimizer's mesh, False for replicated; ValueError otherwise."""
    if not isinstance(param, DTensor):
        return False
    if mesh.kind != "device_mesh":
        raise ValueError(
            f"parameter {label} is a DTensor but distributed_mesh is a ProcessGroup; pass the "
            "DeviceMesh the parameter is sharded on (FSDP2: the mesh given to fully_shard)"
        )
    sharded_dims = []
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"parameter {label} has placement {placement} on mesh dim {dim}; expected Shard(0) or Replicate()")
        if placement.dim != 0:
            raise ValueError(
                f"parameter {label} is sharded on tensor dim {placement.dim} ({placement}); only row "
                "sharding Shard(0) is supported: use fully_shard's default placement, or put the "
                "parameter in an 'adamw'/'lion' group"
            )
        sharded_dims.append(dim)
    if not sharded_dims:
        return False
    mesh_groups = [param.device_mesh.get_group(d) for d in sharded_dims]
    if len(sharded_dims) > 1 or mesh_groups[0] is not mesh.group and mesh_groups[0] != mesh.group:
        raise ValueError(
            f"parameter {label} is sharded over mesh dims {sharded_dims} of {param.device_mesh}, which "
            "is not the distributed_mesh given to the optimizer; pass the (shard sub-)mesh used by fully_shard"
        )
    return True


def local_row_span(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) that `rank` holds under torch.chunk semantics (the last ranks may hold
    fewer rows, or none): chunk = ⌈rows/W⌉ from the global shape, so no per-step sync."""
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def all_ranks_true(flags: Tensor, mesh: MeshInfo) -> Tensor:
    """Elementwise AND of a bool tensor over the group (e.g. "this gradient is finite")."""
    agreed = flags.to(torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.group)
    return agreed.bool()
