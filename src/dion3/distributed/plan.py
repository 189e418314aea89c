"""Bucketing plans for the distributed step, all derived from global shapes (no per-step sync).

Matrix parameters of a group are bucketed by (layout, global matrix shape, dtype, device).
Replicated buckets are the optimizer's ordinary stacked buckets. Row-sharded buckets keep their
state in local stacked buffers padded to ⌈rows/W⌉ rows per rank ([N, chunk, cols]); padding rows
stay zero forever. The per-parameter state entries are DTensors with the parameter's placements
whose local tensors are views into those buffers, so distributed checkpoints see ordinary
sharded state while the step runs batched.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .mesh import DTensor, MeshInfo, is_row_sharded, local_row_span, local_tensor


@dataclass
class ShardedBucket:
    """Same-shape row-sharded matrices of one group; each rank holds rows [start, stop) of each."""

    shape: tuple[int, int]  # global (rows, cols)
    world_size: int
    rank: int
    params: list[Tensor] = field(default_factory=list)
    views: list[Tensor] = field(default_factory=list)  # local shard of each param as [1, local_rows, cols]
    momentum: Optional[Tensor] = None  # [N, chunk, cols], rows ≥ local_rows are zero padding
    variance: Optional[Tensor] = None  # [N, chunk, 1] float32 (NorMuon / Dion3)
    slot_cache: dict = field(default_factory=dict)  # owner slots of plans with static split sizes

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


def bucket_subset(bucket, keep: list[int]):
    """A temporary bucket (same type: Bucket or a distributed ShardedBucket) of the entries
    `keep`, holding stacked copies of their state, and the state tensors those copies came from
    (views into `bucket`'s buffers, or its `pieces` of parameter-shaped state)."""
    if getattr(bucket, "pieces", None) is not None:
        sources = {key: [pieces[i] for i in keep] for key, pieces in bucket.pieces.items()}
    else:
        offsets = [0]
        for view in bucket.views:
            offsets.append(offsets[-1] + view.shape[0])
        spans = [slice(offsets[i], offsets[i + 1]) for i in keep]
        sources = {"momentum": [bucket.momentum[s] for s in spans]}
        if bucket.variance is not None:
            sources["variance"] = [bucket.variance[s] for s in spans]
    sub = copy.copy(bucket)
    for name in ("params", "views", "blocks"):
        if hasattr(bucket, name):
            setattr(sub, name, [getattr(bucket, name)[i] for i in keep])
    sub.momentum = torch.cat(sources["momentum"])
    sub.variance = torch.cat(sources["variance"]) if "variance" in sources else None
    if hasattr(sub, "pieces"):
        sub.pieces = None
    if hasattr(sub, "slot_cache"):  # plans cached for the whole bucket do not fit the subset
        sub.slot_cache = {}
    return sub, sources


def write_back_subset(bucket, sub, sources: dict) -> None:
    """Copy a stepped bucket_subset's state back where it came from."""
    for key, targets in sources.items():
        stepped = torch.split(getattr(sub, key), [t.shape[0] for t in targets])
        torch._foreach_copy_(targets, list(stepped))


def build_buckets(optimizer, group: dict, mesh: MeshInfo) -> list:
    """Buckets of one matrix group; replicated ones use the optimizer's own state allocation."""
    from ..optim.base import Bucket, add_matrix  # deferred: optim.base imports this package

    buckets: dict[tuple, object] = {}
    for index, p in enumerate(group["params"]):
        label = optimizer._param_label(group, index)
        local = local_tensor(p.detach())
        if is_row_sharded(p, mesh, label):
            if group.get("num_heads") is not None or group.get("split_sizes") is not None:
                raise ValueError(
                    f"parameter {label} is row-sharded ({tuple(p.placements)}) and its group sets "
                    "num_heads/split_sizes: per-block orthogonalization of sharded parameters is not "
                    "supported yet; keep the parameter replicated (DDP) or put it in a group without "
                    "num_heads/split_sizes"
                )
            if p.dim() != 2 and not group["flatten"]:
                raise ValueError(
                    f"parameter {label} is a row-sharded {p.dim()}-D tensor: sharding dim 0 of a batch of "
                    "matrices splits the batch, not rows; pass flatten=True or keep it replicated"
                )
            shape = (p.shape[0], p.numel() // max(p.shape[0], 1))
            key = ("shard", shape, p.dtype, local.device)
            bucket = buckets.setdefault(key, ShardedBucket(shape, mesh.world_size, mesh.rank))
            view = local.reshape(1, local.shape[0], shape[1])
            if view.shape[1] != bucket.local_rows:
                raise ValueError(
                    f"parameter {label} holds {view.shape[1]} rows on rank {mesh.rank}, but torch.chunk "
                    f"row sharding of {shape[0]} rows over {mesh.world_size} ranks gives {bucket.local_rows}"
                )
            bucket.params.append(p)
            bucket.views.append(view)
        else:  # one entry per block of a num_heads/split_sizes group
            add_matrix(buckets, ("replicate",), p, local, group)
    for bucket in buckets.values():
        if isinstance(bucket, ShardedBucket):
            allocate_sharded_state(bucket, group, optimizer.state)
    optimizer._allocate_buckets([b for b in buckets.values() if isinstance(b, Bucket)], group)
    return list(buckets.values())


def allocate_sharded_state(bucket: ShardedBucket, group: dict, state: dict) -> None:
    rows, cols = bucket.shape
    like = bucket.views[0]
    bucket.momentum = torch.zeros((bucket.count, bucket.chunk, cols), dtype=like.dtype, device=like.device)
    from ..optim.validation import NORMALIZING_ALGORITHMS  # deferred, as in build_buckets

    wants_variance = group["algorithm"] in NORMALIZING_ALGORITHMS
    if wants_variance:
        bucket.variance = torch.zeros((bucket.count, bucket.chunk, 1), dtype=torch.float32, device=like.device)
    start, stop = local_row_span(rows, bucket.world_size, bucket.rank)
    for i, p in enumerate(bucket.params):
        targets = {"momentum": (bucket.momentum[i, : stop - start], p.shape)}
        if wants_variance:
            targets["variance"] = (bucket.variance[i, : stop - start], (rows, 1))
        entry = state[p]
        for key, (target, global_shape) in targets.items():
            if key in entry:
                _load_rows(target, entry[key], start, stop, key, p)
            local_shape = (stop - start, *global_shape[1:])
            entry[key] = DTensor.from_local(
                target.view(local_shape), p.device_mesh, p.placements, run_check=False,
                shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape),
            )
        for key in list(entry):
            if key not in targets:
                del entry[key]


def _load_rows(target: Tensor, loaded: Tensor, start: int, stop: int, key: str, param: Tensor) -> None:
    """Copy saved state into this rank's rows: a DTensor contributes its local shard, a plain
    tensor of the global shape contributes rows [start, stop)."""
    rows = local_tensor(loaded) if isinstance(loaded, DTensor) else loaded.reshape(loaded.shape[0], -1)[start:stop]
    if rows.numel() != target.numel():
        raise ValueError(
            f"state {key!r} of parameter with shape {tuple(param.shape)} has shape {tuple(loaded.shape)}; "
            "the state dict does not match these parameters"
        )
    target.copy_(rows.reshape(target.shape))


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
