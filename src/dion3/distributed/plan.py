"""Bucketing plans for the distributed step, all derived from global shapes (no per-step sync).

Matrix parameters of a group are bucketed by (layout, global matrix shape, dtype, device).
Replicated buckets are the optimizer's ordinary stacked buckets. Row-sharded buckets keep their
state in local stacked buffers padded to ⌈rows/W⌉ rows per rank ([N, chunk, cols]); padding rows
stay zero forever. The per-parameter state entries are DTensors with the parameter's placements
whose local tensors are views into those buffers, so distributed checkpoints see ordinary
sharded state while the step runs batched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..buckets import Bucket, matrix_view
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


def build_buckets(optimizer, group: dict, mesh: MeshInfo) -> list:
    """Buckets of one matrix group; replicated ones use the optimizer's own state allocation."""
    buckets: dict[tuple, object] = {}
    for index, p in enumerate(group["params"]):
        label = optimizer._param_label(group, index)
        local = local_tensor(p.detach())
        if is_row_sharded(p, mesh, label):
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
        else:
            view = matrix_view(local, group["flatten"])
            key = ("replicate", tuple(view.shape[1:]), p.dtype, local.device)
            bucket = buckets.setdefault(key, Bucket(shape=key[1]))
        bucket.params.append(p)
        bucket.views.append(view)
    for bucket in buckets.values():
        if isinstance(bucket, ShardedBucket):
            allocate_sharded_state(bucket, group, optimizer.state)
        else:
            optimizer._allocate_bucket_state(bucket, group)
    return list(buckets.values())


def allocate_sharded_state(bucket: ShardedBucket, group: dict, state: dict) -> None:
    rows, cols = bucket.shape
    like = bucket.views[0]
    bucket.momentum = torch.zeros((bucket.count, bucket.chunk, cols), dtype=like.dtype, device=like.device)
    wants_variance = group["algorithm"] != "muon"
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
