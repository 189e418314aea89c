"""Normalize the user's `distributed_mesh` and the process groups of mesh axes.

Accepted meshes: None (single device, or DTensor parameters, each on its own mesh), a DeviceMesh
of 1-3 axes (the parameters' mesh, a sub-mesh of it such as HSDP's shard sub-mesh, or a mesh that
parameters' meshes are sub-meshes of, such as the world mesh of FSDP2 + TP), or a ProcessGroup
(DDP). How each parameter lies on its mesh is read by distributed/layout.py.
"""
from __future__ import annotations

import itertools
import weakref
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
    into, each sorted, the groups in mesh order, read from the mesh's rank tensor: equal for equal
    meshes however many DeviceMesh objects describe them. For a sub-mesh (world["dp", "tp"] of a
    (pp, dp, tp) mesh) the rank tensor holds only this rank's slice: see world_members."""
    return _members_of(mesh.mesh, axes)


def _members_of(ranks: Tensor, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    others = [a for a in range(ranks.ndim) if a not in axes]
    size = 1
    for a in axes:
        size *= ranks.shape[a]
    groups = ranks.permute(*others, *axes).reshape(-1, size).tolist()
    return tuple(tuple(sorted(int(r) for r in members)) for members in groups)


def _root_mesh(mesh: "DeviceMesh") -> Optional["DeviceMesh"]:
    """The mesh that `mesh` was sliced or flattened from (itself when it is a root), through
    torch's private accessors (DeviceMesh._get_root_mesh; _mesh_resources.get_root_mesh on older
    releases); None when neither exists or it fails."""
    try:
        if hasattr(mesh, "_get_root_mesh"):
            return mesh._get_root_mesh()
        from torch.distributed.device_mesh import _mesh_resources

        return _mesh_resources.get_root_mesh(mesh)
    except Exception:  # a private API that changed: the caller falls back to asking every rank
        return None


def _slices(mesh: "DeviceMesh", root: "DeviceMesh") -> Optional[list[Tensor]]:
    """The rank tensors of every copy of the sub-mesh `mesh` across `root`: `mesh` fills a box of
    the root axes it varies over (several of them for a flattened axis), at fixed coordinates on
    the others; its copies are that box at every value of the fixed coordinates, each laid out as
    `mesh`. None when `mesh` is not such a box of `root`."""
    whole = root.mesh
    position = {int(r): i for i, r in enumerate(whole.reshape(-1).tolist())}
    index = [position.get(int(r), -1) for r in mesh.mesh.reshape(-1).tolist()]
    if min(index) < 0:
        return None
    coords = torch.stack(torch.unravel_index(torch.tensor(index), tuple(whole.shape)), dim=-1)
    fixed = [a for a in range(whole.ndim) if bool((coords[:, a] == coords[0, a]).all())]
    copies = 1
    for a in fixed:
        copies *= whole.shape[a]
    if copies * mesh.mesh.numel() != whole.numel():
        return None
    out = []
    for values in itertools.product(*[range(whole.shape[a]) for a in fixed]):
        moved = coords.clone()
        for a, v in zip(fixed, values):
            moved[:, a] = v
        out.append(whole[tuple(moved.T)].reshape(mesh.mesh.shape))
    return out


def world_members(mesh: "DeviceMesh", axes: tuple[int, ...]) -> Optional[tuple[tuple[int, ...], ...]]:
    """axes_members over the whole world, identical on every rank: the groups of every copy of a
    sub-mesh across its root mesh, sorted. Groups are created by a collective that all ranks must
    call with the same list, and ranks of another pipeline stage hold another slice of the root.
    Read from the root mesh, this needs no communication, so it can key the group table on every
    rank alike, whatever each rank built before. None when the root cannot be read (a torch
    without the private accessor, or a mesh that is no box of its root): axes_group then asks
    every rank for its own slice."""
    if mesh.mesh.numel() == dist.get_world_size():  # the mesh holds every rank
        return tuple(sorted(axes_members(mesh, axes)))
    root = _root_mesh(mesh)
    if root is None or root.mesh.numel() != dist.get_world_size():
        return None
    copies = _slices(mesh, root)
    if copies is None:
        return None
    return tuple(sorted({members for ranks in copies for members in _members_of(ranks, axes)}))


def within_mesh(mesh: "DeviceMesh", given: "DeviceMesh") -> bool:
    """Whether `mesh` is `given` or a sub-mesh of it: both cut from one root mesh (equal roots),
    `mesh` over a subset of `given`'s axes. Both rank tensors hold the slice around this rank, a
    box of the root over the axes each varies (several root axes for a flattened one); the box of
    `mesh` lies in that of `given` exactly when its axes are among `given`'s, so comparing the
    ranks decides. An FSDP-only layer of an FSDP2 + TP model (world["dp"]) is within the world
    mesh; a mesh from another root (another rank layout) is not, even on the same ranks. False
    when a root cannot be read (torch's private accessor changed): the caller refuses."""
    if mesh == given:
        return True
    root, given_root = _root_mesh(mesh), _root_mesh(given)
    if root is None or given_root is None or root != given_root or mesh.device_type != given.device_type:
        return False
    return set(mesh.mesh.reshape(-1).tolist()) <= set(given.mesh.reshape(-1).tolist())


def _gathered_members(local: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The union of every rank's own groups, sorted (a collective over the default group)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return tuple(sorted({tuple(m) for groups in everyone for m in groups}))


# Process groups of mesh axes by (device type, backend, members), for the life of the default
# process group they belong to (a destroyed and re-initialized default group starts an empty
# table). Each parameter of an FSDP2/TP model carries a DeviceMesh object of its own, and meshes
# made apart (two init_device_mesh calls) hold distinct groups of the same ranks: keyed by
# object, each would get or use communicators of its own. The table holds its groups and the
# default group weakly: torch.distributed keeps them alive until destroy_process_group, and
# nothing here may keep them longer (a gloo group left alive then is torn down in interpreter
# shutdown, where one of its worker threads can abort the process).
_GROUPS: "weakref.WeakValueDictionary[tuple, dist.ProcessGroup]" = weakref.WeakValueDictionary()
_GROUPS_WORLD: list = [None]  # a weak reference to the default group the table's groups belong to


def axes_group(mesh: "DeviceMesh", axes: tuple[int, ...]) -> Optional[MeshInfo]:
    """MeshInfo of the product of `axes` of `mesh` around this rank (None for no axes).

    One group per membership: one axis uses the group of the first mesh seen with those
    members (the mesh's own groups exist already); a product of axes gets process groups created
    on every rank together (dist.new_subgroups_by_enumeration, with the groups of the whole world:
    world_members) the first time its members are seen. Creating them is collective, so this is
    called at construction, in the same order on all ranks, never per step; whether a call
    creates groups depends only on the world's memberships seen before, which every rank sees
    alike. Without a readable root mesh, a sub-mesh's groups are gathered from every rank (one
    all_gather_object) the first time this rank's own slice is seen, keyed by that slice."""
    if not axes:
        return None
    axes = tuple(axes)
    world = dist.group.WORLD
    known = _GROUPS_WORLD[0]
    if known is None or known() is not world:  # a new default group: the old groups are gone
        _GROUPS.clear()
        _GROUPS_WORLD[0] = weakref.ref(world)
    if len(axes) == 1:  # the mesh's own group: nothing is created, this rank's slice suffices
        own = mesh.get_group(axes[0])
        group = _GROUPS.setdefault((mesh.device_type, dist.get_backend(own), axes_members(mesh, axes)), own)
    else:
        backend = dist.get_backend(world)
        everyone = world_members(mesh, axes)
        if everyone is None:
            key = (mesh.device_type, backend, axes_members(mesh, axes))
            if key not in _GROUPS:
                _GROUPS[key] = _created((mesh.device_type, backend, _gathered_members(key[2])))
        else:
            key = (mesh.device_type, backend, everyone)
            _created(key)
        group = _GROUPS[key]
    # the mesh is this call's own: group_coordinates reads member coordinates from it
    return MeshInfo(group, dist.get_world_size(group), dist.get_rank(group), "device_mesh", mesh)


def _created(key: tuple) -> "dist.ProcessGroup":
    """The group of `key` (device type, backend, the world's members), created the first time."""
    if key not in _GROUPS:
        _GROUPS[key], _ = dist.new_subgroups_by_enumeration([list(m) for m in key[2]])
    return _GROUPS[key]


def group_coordinates(info: MeshInfo, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The mesh coordinate of every member of info's group (the product of `axes` around this
    rank), in group-rank order: a process group orders its members by global rank, which need
    not be the mesh's order along the axes."""
    mesh = info.device_mesh
    ranks = mesh.mesh
    mine = coordinate_of(mesh, dist.get_rank())
    free = sorted(set(axes))
    # the members' global ranks: `axes` free, every other axis at this rank's coordinate (one
    # tensor index, not one per member: a plan of 1024 ranks asks this for every parameter)
    held = ranks[tuple(slice(None) if a in free else mine[a] for a in range(ranks.dim()))].reshape(-1)
    grid = torch.cartesian_prod(*[torch.arange(ranks.shape[a]) for a in free]).reshape(-1, len(free))
    members = []
    for index in grid[torch.argsort(held)].tolist():  # by global rank: the group's order
        coordinate = list(mine)
        for axis, value in zip(free, index):
            coordinate[axis] = value
        members.append(tuple(coordinate))
    if members[info.rank] != mine:
        raise RuntimeError(f"process group of mesh axes {axes} of {mesh} does not order its members by global rank")
    return members


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


def settled(tensor: Tensor) -> Tensor:
    """A DTensor with pending reductions (Partial placements) reduced (Replicate there), so that
    its local piece holds final values; anything else as it is."""
    if not isinstance(tensor, DTensor) or not any(p.is_partial() for p in tensor.placements):
        return tensor
    return tensor.redistribute(tensor.device_mesh, [Replicate() if p.is_partial() else p for p in tensor.placements])


def agree_on_pieces(ok: Tensor, params) -> Tensor:
    """ok ([P] bool, one per parameter: "its local gradient is finite") made the same on every rank
    holding a piece of each DTensor parameter: elementwise AND over every dimension of its mesh,
    one all-reduce per dimension of each mesh the parameters use. Plain tensors keep their local
    verdict (a replicated gradient is the same everywhere)."""
    by_mesh: dict[int, tuple[object, list[int]]] = {}
    for index, param in enumerate(params):
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            by_mesh.setdefault(id(mesh), (mesh, []))[1].append(index)
    if not by_mesh:
        return ok
    flags = list(ok.unbind())  # no index tensors: nothing to copy from the host inside a captured step
    for mesh, indices in by_mesh.values():
        agreed = torch.stack([flags[i] for i in indices]).to(torch.int32)
        for dim in range(mesh.ndim):
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
        for i, value in zip(indices, agreed.bool().unbind()):
            flags[i] = value
    return torch.stack(flags)
