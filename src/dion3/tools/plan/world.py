"""A pretend world of W ranks on one CPU, with a model's parameters laid out on it as meta
DTensors, so the real optimizer can build its buckets and owners without GPUs.

torch's fake process group lets this process be rank r of W: collectives are no-ops, group
creation is local, and DeviceMesh works on "cpu". Parameters are DTensors over meta tensors
(no storage), with the placements FSDP2, tensor parallelism, HSDP and expert parallelism give
them; the optimizer's state is allocated on meta too. What comes out is exactly what
dion3.distributed.build_buckets decides on rank r: which buckets, who owns which matrices.

Layouts (`--layout`, mesh axes outermost first, e.g. "fsdp=64,tp=8", "replicate=2,fsdp=32",
"ep=8,fsdp=16"); each axis does this to a parameter:
  replicate  Replicate (HSDP's replica axis; DDP when it is the only axis)
  fsdp       rows sharded: Shard(0); _StridedShard(0, tp) for column-parallel weights under tp
             (FSDP2 on top of TP, torchtitan's order); rows of each expert (Shard(1)) of a stack
  tp         column-parallel weights (q, k, v, gate, up; custom shapes): Shard(0);
             row-parallel ones (o, down): Shard(1); expert stacks: Replicate
  ep         expert stacks [E, rows, cols]: Shard(0); dense weights: Replicate
"single" plans one device without torch.distributed (plain meta tensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

AXES = ("replicate", "fsdp", "tp", "ep")
ROW_PARALLEL = ("o", "down")  # TP splits their columns (RowwiseParallel); every other weight: rows


@dataclass(frozen=True)
class Weight:
    """One parameter: name ("q", "down", a custom "RxC"), shape (2-D, or 3-D expert stack)."""

    name: str
    shape: tuple[int, ...]

    @property
    def row_parallel(self) -> bool:
        return self.name in ROW_PARALLEL


@dataclass(frozen=True)
class Layout:
    axes: tuple[tuple[str, int], ...]  # (axis name, size), outermost first; () = one device

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.axes)

    def size(self, name: str) -> int:
        return dict(self.axes).get(name, 1)

    def describe(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.axes) or "single"


def parse_layout(text: str, world: Optional[int] = None) -> Layout:
    """"fsdp=64,tp=8" → Layout; "single" → one device; a bare number W → fsdp=W."""
    text = text.strip()
    if text == "single":
        return Layout(())
    if text.isdigit():
        text = f"fsdp={text}"
    axes = []
    for item in text.split(","):
        name, _, size = item.partition("=")
        name = name.strip()
        if name not in AXES:
            raise ValueError(f"--layout: unknown axis {name!r} in {text!r}; expected axes of {AXES}, "
                             "e.g. fsdp=64,tp=8 or replicate=2,fsdp=32, or 'single'")
        if not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--layout: axis {name!r} needs a size ≥ 1, e.g. {name}=8; got {item.strip()!r}")
        if name in dict(axes):
            raise ValueError(f"--layout: axis {name!r} appears twice in {text!r}")
        axes.append((name, int(size)))
    layout = Layout(tuple(axes))
    if world is not None and layout.world_size != world:
        raise ValueError(f"--world {world} does not match --layout {text} ({layout.world_size} ranks)")
    return layout


def model_weights(matrices, experts: Optional[dict] = None) -> list[Weight]:
    """Per-layer parameter order of a Llama decoder (q, k, v, o, gate, up, down per layer) from
    a preset's MatrixShape groups; other shapes (custom) follow in their given order."""
    by_name = {m.name: m for m in matrices}
    llama = ("q,o", "k,v", "gate,up", "down")
    weights: list[Weight] = []
    if all(n in by_name for n in llama):
        layers = by_name["down"].count
        q, k, g, d = (by_name[n] for n in llama)
        for _ in range(layers):
            weights += [Weight("q", (q.rows, q.cols)), Weight("k", (k.rows, k.cols)), Weight("v", (k.rows, k.cols)),
                        Weight("o", (q.rows, q.cols)), Weight("gate", (g.rows, g.cols)),
                        Weight("up", (g.rows, g.cols)), Weight("down", (d.rows, d.cols))]
        rest = [m for m in matrices if m.name not in llama]
    else:
        rest = list(matrices)
    for m in rest:
        stack = (experts or {}).get(m.name)
        shape = (stack, m.rows, m.cols) if stack else (m.rows, m.cols)
        weights += [Weight(m.name, shape)] * m.count
    return weights


def placements(weight: Weight, layout: Layout) -> tuple:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = layout.size("tp")
    stack = len(weight.shape) == 3
    out = []
    for name, _ in layout.axes:
        if name == "replicate":
            out.append(Replicate())
        elif name == "fsdp":
            if stack:
                out.append(Shard(1))
            elif tp > 1 and not weight.row_parallel:
                out.append(_StridedShard(0, split_factor=tp))
            else:
                out.append(Shard(0))
        elif name == "tp":
            out.append(Replicate() if stack else Shard(1) if weight.row_parallel else Shard(0))
        else:  # ep
            out.append(Shard(0) if stack else Replicate())
    return tuple(out)


class FakeWorld:
    """Rank `rank` of a fake process group of layout.world_size ranks, with the layout's mesh.
    One at a time per process (it is the default process group); close() ends it."""

    created = 0

    def __init__(self, layout: Layout, rank: int = 0):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not layout.axes:
            raise ValueError("FakeWorld needs a distributed layout (not 'single')")
        if dist.is_initialized():
            raise RuntimeError("a process group is already initialized; dion3 plan needs its own fake one")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        self.layout, self.rank = layout, rank
        # torch interns DTensor specs by mesh equality: a mesh of a later world equal to an earlier
        # one would bring back the earlier world's (destroyed) process groups; names make it new
        FakeWorld.created += 1
        names = tuple(f"{n}.{FakeWorld.created}" for n, _ in layout.axes)
        self.mesh = init_device_mesh("cpu", tuple(s for _, s in layout.axes), mesh_dim_names=names)
        _keep_rank_tensor(self.mesh)
        self._local_shapes: dict = {}

    def parameter(self, weight: Weight, dtype: torch.dtype) -> torch.nn.Parameter:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        where = placements(weight, self.layout)
        key = (weight.shape, where)
        if key not in self._local_shapes:
            self._local_shapes[key] = compute_local_shape_and_global_offset(weight.shape, self.mesh, where)[0]
        local = torch.empty(self._local_shapes[key], dtype=dtype, device="meta")
        stride = tuple(math.prod(weight.shape[i + 1:]) for i in range(len(weight.shape)))
        tensor = DTensor.from_local(local, self.mesh, where, run_check=False, shape=torch.Size(weight.shape),
                                    stride=stride)
        return torch.nn.Parameter(tensor)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _keep_rank_tensor(mesh) -> None:
    """torch 2.13's DeviceMesh rebuilds its rank tensor from its layout on every `.mesh` read
    (about 0.3 ms at 1024 ranks), and the planner reads it once per member of every group. The
    root mesh of a plan never changes, so it keeps the tensor it built first."""
    base = type(mesh)

    class _Fixed(base):  # type: ignore[misc, valid-type]
        @property
        def mesh(self):
            kept = self.__dict__.get("_kept_rank_tensor")
            if kept is None:
                kept = self.__dict__["_kept_rank_tensor"] = base.mesh.fget(self)
            return kept

    mesh.__class__ = _Fixed


def meta_parameter(weight: Weight, dtype: torch.dtype) -> torch.nn.Parameter:
    """A plain meta parameter (the single-device plan)."""
    return torch.nn.Parameter(torch.empty(weight.shape, dtype=dtype, device="meta"))
