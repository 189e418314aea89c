"""Optimizer state of sharded buckets (bucket.py): local stacked buffers (or per-parameter pieces for
per-block groups) whose per-parameter state entries are DTensors with the parameter's
placements, so distributed checkpoints see ordinary sharded state while the step runs batched
and reshard it between layouts."""
from __future__ import annotations

import torch
from torch import Tensor

from ..algorithms import NORMALIZING_ALGORITHMS
from ..buckets import momentum_dtype, variance_shape
from .bucket import LayoutBucket
from .layout import MatrixLayout, classify, matrix_shape, member_layouts
from .mesh import DTensor, Replicate, axes_group, local_tensor


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _variance_target(buffer: Tensor, p: Tensor, local_shape, flatten: bool) -> tuple:
    """(buffer, its local shape, global shape, placements) of a parameter's per-row variance:
    one value per row, so the axes that split columns replicate it."""
    col_dim = p.dim() - 1 if not flatten else 1
    per_row = tuple(Replicate() if _splits_dim(pl, col_dim, p.dim()) else pl for pl in p.placements)
    global_shape = variance_shape(p, flatten)
    return buffer, (*local_shape[: len(global_shape) - 1], 1), global_shape, per_row


def _install_state(entry: dict, p: Tensor, targets: dict, load) -> None:
    """entry[key] = a DTensor with the given placements viewing each target (saved state copied
    in first by load(target, saved, key)); keys without a target are dropped."""
    for key, (target, shape_here, global_shape, placements) in targets.items():
        if key in entry:
            load(target, entry[key], key)
        entry[key] = DTensor.from_local(
            target.view(shape_here), p.device_mesh, placements, run_check=False,
            shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape),
        )
    for key in list(entry):
        if key not in targets:
            del entry[key]


def allocate_layout_state(bucket: LayoutBucket, group: dict, state: dict) -> None:
    """Stacked local state [N, rows held, cols held] with per-parameter DTensor views carrying
    the parameter's placements (the variance, one value per row, is replicated over the column
    axes), so distributed checkpoints reshard it between layouts."""
    like = bucket.views[0]
    batch, rows, cols = bucket.local.local_shape
    bucket.momentum = torch.zeros((bucket.count, rows, cols), dtype=momentum_dtype(group, like.dtype), device=like.device)
    wants_variance = group["algorithm"] in NORMALIZING_ALGORITHMS
    if wants_variance:
        bucket.variance = torch.zeros((bucket.count, rows, 1), dtype=torch.float32, device=like.device)
    offset = 0
    for p, view in zip(bucket.params, bucket.views):
        span = slice(offset, offset + view.shape[0])
        offset += view.shape[0]
        local_shape = local_tensor(p).shape
        targets = {"momentum": (bucket.momentum[span], local_shape, p.shape, tuple(p.placements))}
        if wants_variance:
            targets["variance"] = _variance_target(bucket.variance[span], p, local_shape, group["flatten"])
        _install_state(state[p], p, targets, lambda target, saved, key: _load_piece(target, saved, bucket, key, p))


def _splits_dim(placement, dim: int, ndim: int) -> bool:
    return hasattr(placement, "dim") and not isinstance(placement, Replicate) and placement.dim % ndim == dim


def _load_piece(target: Tensor, loaded: Tensor, bucket: LayoutBucket, key: str, param: Tensor) -> None:
    load_piece(target, loaded, bucket.local, bucket.shape, key, param)


def load_piece(target: Tensor, loaded: Tensor, piece: MatrixLayout, shape: tuple[int, int], key: str,
               param: Tensor) -> None:
    """Copy saved state into this rank's piece: a DTensor contributes its local tensor, a plain
    tensor of the global shape the experts, rows and columns this rank holds."""
    rows, cols = shape
    last = cols if key == "momentum" else 1
    if isinstance(loaded, DTensor):
        values = local_tensor(loaded)
    elif loaded.numel() % (rows * last) == 0:
        whole = loaded.reshape(-1, rows, last)
        index = torch.tensor(piece.rows, dtype=torch.long, device=whole.device)
        values = whole[list(piece.batch)].index_select(1, index)
        values = values[..., piece.cols[0] : piece.cols[1]] if key == "momentum" else values
    else:
        values = loaded
    if values.numel() != target.numel():
        raise ValueError(
            f"state {key!r} of parameter with shape {tuple(param.shape)} has shape {tuple(loaded.shape)}; "
            "the state dict does not match these parameters"
        )
    target.copy_(values.reshape(target.shape))


def allocate_block_pieces(bucket: LayoutBucket, group: dict, state: dict, owned: dict) -> None:
    """State of a bucket of blocks: each parameter owns local state of its own piece's shape,
    kept in its state entry as a DTensor of its placements (distributed checkpoints see ordinary
    sharded state); the bucket's `pieces` view each entry's block rows of it."""
    bucket.pieces = {}
    for p, cut in zip(bucket.params, bucket.cuts):
        if id(p) not in owned:
            owned[id(p)] = _param_piece_state(p, cut.whole, group, state)
        for key, local in owned[id(p)].items():
            bucket.pieces.setdefault(key, []).append(local[:, cut.rows])


def _param_piece_state(p: Tensor, whole: tuple[int, int, int], group: dict, state: dict) -> dict[str, Tensor]:
    """{key: local state tensor [B, rows held, cols held or 1]} of one sharded parameter, loaded
    from its state entry when present; the entry gets DTensors viewing them."""
    like = local_tensor(p)
    local_shape = like.shape
    matrix_axes = classify(p, "", group["flatten"]).matrix
    info = axes_group(p.device_mesh, matrix_axes)
    piece = member_layouts(p, info, matrix_axes, group["flatten"])[0 if info is None else info.rank]
    shape = matrix_shape(p, group["flatten"])
    fresh = {"momentum": (torch.zeros(whole, dtype=momentum_dtype(group, like.dtype), device=like.device), local_shape, p.shape,
                          tuple(p.placements))}
    if group["algorithm"] in NORMALIZING_ALGORITHMS:
        variance = torch.zeros((*whole[:2], 1), dtype=torch.float32, device=like.device)
        fresh["variance"] = _variance_target(variance, p, local_shape, group["flatten"])
    _install_state(state[p], p, fresh, lambda target, saved, key: load_piece(target, saved, piece, shape, key, p))
    return {key: target for key, (target, *_rest) in fresh.items()}
