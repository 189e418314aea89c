"""Bucket types shared by the single-device optimizer (optim/) and the distributed step
(distributed/): both import from here, neither imports the other's internals.

A bucket holds same-shape matrices of one parameter group, stepped as one batch: one stacked
momentum buffer [N, rows, cols] (and one per-row variance buffer [N, rows, 1] in float32), with
a view per entry into each. An entry is a parameter's matrices, or one block of them when the
group sets `num_heads` / `split_sizes` (dion3.blocks): a parameter split into blocks appears
once per block. Buckets of uneven blocks keep their state in parameter-shaped tensors instead
(`pieces`), stacked for each step and written back (bucket_subset / write_back_subset).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from . import blocks

try:  # DTensor moved out of the private namespace in torch 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore


@dataclass
class Bucket:
    """Same-shape matrices of one group, orthogonalized together."""

    shape: tuple[int, int]  # (rows, cols) of each matrix
    params: list[Tensor] = field(default_factory=list)  # the parameter of each entry
    views: list[Tensor] = field(default_factory=list)  # each entry as [B_i, rows, cols], a view of its param
    blocks: list[blocks.Block] = field(default_factory=list)  # where each entry lies in its param's matrices
    momentum: Optional[Tensor] = None  # [N, rows, cols]; None: stacked from `pieces` at each step
    variance: Optional[Tensor] = None  # [N, rows, 1] float32 (NorMuon / Dion3)
    # Buckets of uneven blocks: each entry's state, as views of its parameter-shaped state
    # ({"momentum": [...], "variance": [...]}); None when momentum/variance hold the state.
    pieces: Optional[dict[str, list[Tensor]]] = None
    mesh: Optional[object] = None  # distributed: the group that replicates it (DDP); None: stepped alone

    def grads(self, flatten: bool) -> list[Tensor]:
        """Each entry's gradient as [B_i, rows, cols] (local shard of a DTensor gradient)."""
        return [block.cut(matrix_view(_local(p.grad), flatten)) for p, block in zip(self.params, self.blocks)]


class SkipTally:
    """The skipped-update counter of one device: `count` (0-d int64) and the verdicts ([N] bool,
    True: stepped) that this step's buckets noted with `add`; `flush` counts them at the end of the
    step in one reduction and one add, where counting each bucket at once would launch three ops
    per bucket (host time in eager steps of small models). No host sync."""

    def __init__(self, device: torch.device):
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self._verdicts: list[Tensor] = []

    def add(self, ok: Tensor) -> None:
        self._verdicts.append(ok.reshape(-1))

    def flush(self) -> None:
        if not self._verdicts:
            return
        verdicts = self._verdicts[0] if len(self._verdicts) == 1 else torch.cat(self._verdicts)
        self.count.add_(verdicts.logical_not().sum())
        self._verdicts.clear()


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def matrix_view(tensor: Tensor, flatten: bool) -> Tensor:
    """A parameter (or its gradient) as a batch of matrices [B, rows, cols]."""
    if flatten:
        return tensor.reshape(1, tensor.shape[0], -1)
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor


MOMENTUM_DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def momentum_dtype(group: dict, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a matrix group's momentum: its `momentum_dtype` ("float32", "bfloat16"), or
    the parameter's dtype when None (groups saved before the option existed lack the key)."""
    return MOMENTUM_DTYPES[group.get("momentum_dtype")] or param_dtype


def variance_shape(param: Tensor, flatten: bool) -> tuple[int, ...]:
    """Shape of a parameter's per-row second moment: one value per matrix row."""
    return (param.shape[0], 1) if flatten else (*param.shape[:-1], 1)


def add_matrix(buckets: dict, key_prefix: tuple, param: Tensor, local: Tensor, group: dict, mesh=None) -> None:
    """Put the entries of one matrix parameter (local: its local tensor) into `buckets`, keyed by
    (*key_prefix, entry shape, dtype, device); new buckets get `mesh`."""
    matrices = matrix_view(local.detach(), group["flatten"])
    # .get: groups restored from checkpoints of versions without block options lack the keys
    sizes = blocks.block_sizes(matrices.shape[-2], group.get("num_heads"), group.get("split_sizes"))
    for block in blocks.blocks_of(matrices, sizes):
        view = block.cut(matrices)
        key = (*key_prefix, tuple(view.shape[1:]), param.dtype, local.device)
        bucket = buckets.setdefault(key, Bucket(shape=key[-3], mesh=mesh))
        bucket.params.append(param)
        bucket.views.append(view)
        bucket.blocks.append(block)


def bucket_subset(bucket, keep: list[int]):
    """A temporary bucket (same type as `bucket`) of the entries `keep`, holding stacked copies
    of their state, and the state tensors those copies came from (views into `bucket`'s buffers,
    or its `pieces` of parameter-shaped state)."""
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
    for name in ("params", "views", "blocks", "cuts"):
        if getattr(bucket, name, None):
            setattr(sub, name, [getattr(bucket, name)[i] for i in keep])
    if getattr(bucket, "owner_of", None):  # sharded buckets: each kept matrix keeps its owner
        starts = [0]
        for view in bucket.views:
            starts.append(starts[-1] + view.shape[0])
        sub.owner_of = tuple(o for i in keep for o in bucket.owner_of[starts[i] : starts[i + 1]])
    sub.momentum = torch.cat(sources["momentum"])
    sub.variance = torch.cat(sources["variance"]) if "variance" in sources else None
    if hasattr(sub, "pieces"):
        sub.pieces = None
    # Plans cached for the whole bucket do not fit a proper subset; a subset of every entry
    # (a bucket of blocks stepped through `pieces`) shares the bucket's cache across steps.
    if hasattr(sub, "slot_cache") and len(keep) != len(bucket.params):
        sub.slot_cache = {}
    return sub, sources


def write_back_subset(bucket, sub, sources: dict) -> None:
    """Copy a stepped bucket_subset's state back where it came from."""
    for key, targets in sources.items():
        stepped = torch.split(getattr(sub, key), [t.shape[0] for t in targets])
        torch._foreach_copy_(targets, list(stepped))
