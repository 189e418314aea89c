"""Bucket types shared by the single-device optimizer (optim/) and the distributed step
(distributed/): both import from here, neither imports the other's internals.

A bucket holds same-shape matrices of one parameter group, stepped as one batch: one stacked
momentum buffer [N, rows, cols] (and one per-row variance buffer [N, rows, 1] in float32), with
a view per parameter into each.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Bucket:
    """Same-shape matrices of one group, orthogonalized together."""

    shape: tuple[int, int]  # (rows, cols) of each matrix
    params: list[Tensor] = field(default_factory=list)
    views: list[Tensor] = field(default_factory=list)  # each param as [B_i, rows, cols]
    momentum: Optional[Tensor] = None  # [N, rows, cols]
    variance: Optional[Tensor] = None  # [N, rows, 1] float32 (NorMuon / Dion3)
    mesh: Optional[object] = None  # distributed: the group that replicates it (DDP); None: stepped alone


def matrix_view(tensor: Tensor, flatten: bool) -> Tensor:
    """A parameter (or its gradient) as a batch of matrices [B, rows, cols]."""
    if flatten:
        return tensor.reshape(1, tensor.shape[0], -1)
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor


def bucket_subset(bucket, keep: list[int]):
    """A temporary bucket (same type as `bucket`) of the parameters `keep`, holding copies of
    their state, and the spans of that state in `bucket`."""
    offsets = [0]
    for view in bucket.views:
        offsets.append(offsets[-1] + view.shape[0])
    spans = [slice(offsets[i], offsets[i + 1]) for i in keep]
    sub = copy.copy(bucket)
    sub.params = [bucket.params[i] for i in keep]
    sub.views = [bucket.views[i] for i in keep]
    sub.momentum = torch.cat([bucket.momentum[s] for s in spans])
    if bucket.variance is not None:
        sub.variance = torch.cat([bucket.variance[s] for s in spans])
    if hasattr(sub, "slot_cache"):  # plans cached for the whole bucket do not fit the subset
        sub.slot_cache = {}
    return sub, spans


def write_back_subset(bucket, sub, spans: list[slice]) -> None:
    """Copy a stepped bucket_subset's state back into `bucket`."""
    start = 0
    for span in spans:
        stop = start + span.stop - span.start
        bucket.momentum[span].copy_(sub.momentum[start:stop])
        if bucket.variance is not None:
            bucket.variance[span].copy_(sub.variance[start:stop])
        start = stop
