"""Triton per-matrix bookkeeping of Dion3's row selection, one program per matrix:

- the Frobenius norm of each matrix's selected rows, from the squared row norms that the fused
  momentum pass measured, and Newton–Schulz's input factor 1/(norm_scale·norm + ε);
- the inverse of the selection ("positions": each row's slot in it, −1 for rows not selected),
  which the fused post-update reads.

One launch for all of it, where PyTorch needs a gather, a sum, a square root and three
elementwise launches for the norm and factor, and a fill, an arange and a scatter for the
inverse; at small shapes each of those costs more host time than the kernel takes on the GPU.
The sum runs in float32 like the PyTorch path's, in another order (blocks of slots).

The inverse built with the norm is attached to the rows tensor (with its version counter), so
the post-update of the same selection finds it instead of launching again (attached_positions).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_SLOTS = 1024
_ATTRIBUTE = "_dion3_selection_positions"


@triton.jit
def _selection_kernel(
    rows_ptr, squares_ptr, norm_ptr, factor_ptr, position_ptr, norm_scale, eps, R, k,
    NORM: tl.constexpr, FACTOR: tl.constexpr, POSITIONS: tl.constexpr, BLOCK: tl.constexpr,
):
    matrix = tl.program_id(0).to(tl.int64)
    if NORM:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, k, BLOCK):
            slots = start + tl.arange(0, BLOCK)
            inside = slots < k
            rows = tl.load(rows_ptr + matrix * k + slots, mask=inside, other=0)
            total += tl.load(squares_ptr + matrix * R + rows, mask=inside, other=0.0)
        norm = tl.sqrt(tl.sum(total, axis=0))
        tl.store(norm_ptr + matrix, norm)
        if FACTOR:
            tl.store(factor_ptr + matrix, 1.0 / (norm * norm_scale + eps))
    if POSITIONS:
        for start in range(0, R, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            tl.store(position_ptr + matrix * R + offsets, tl.full([BLOCK], -1, tl.int32), mask=offsets < R)
        tl.debug_barrier()  # every −1 lands before any slot: no thread overwrites another's slot
        for start in range(0, k, BLOCK):
            slots = start + tl.arange(0, BLOCK)
            inside = slots < k
            rows = tl.load(rows_ptr + matrix * k + slots, mask=inside, other=0)
            tl.store(position_ptr + matrix * R + rows, slots.to(tl.int32), mask=inside)


def _version(rows: Tensor) -> Optional[int]:
    """rows' version counter (bumped by every in-place change); None for inference tensors."""
    try:
        return rows._version
    except RuntimeError:  # inference-mode tensors keep no version: nothing is attached to them
        return None


def selection_norm_supported(squares: Tensor, rows: Tensor) -> bool:
    """Layouts the kernel handles (the device is dion3.kernels' dispatch's to check)."""
    return (squares.dim() == 2 and rows.dim() == 2 and squares.dtype == torch.float32 and squares.is_contiguous()
            and rows.is_contiguous() and rows.shape[0] == squares.shape[0] and not rows.is_floating_point()
            and rows.device == squares.device)


def selection_norm_triton(
    squares: Tensor, rows: Tensor, norm_scale: Optional[float] = None, eps: float = 0.0, positions: bool = False
) -> tuple[Tensor, Optional[Tensor]]:
    """(‖selected rows‖_F per matrix, 1/(norm_scale·norm + eps) per matrix or None when
    norm_scale is None), both [N, 1, 1] float32. squares: [N, R] float32 squared row norms;
    rows: [N, k] distinct selected rows of each matrix. positions: also build the selection's
    inverse in the same launch and attach it to rows (attached_positions)."""
    if not selection_norm_supported(squares, rows):
        raise ValueError(
            f"selection_norm_triton needs float32 contiguous squares [N, R] and integer rows [N, k] on one "
            f"device, got {squares.dtype} {tuple(squares.shape)} and {rows.dtype} {tuple(rows.shape)}")
    n, r = squares.shape
    k = rows.shape[1]
    norm = torch.empty((n, 1, 1), dtype=torch.float32, device=squares.device)
    factor = None if norm_scale is None else torch.empty_like(norm)
    position = torch.empty((n, r), dtype=torch.int32, device=rows.device) if positions else None
    if n:
        _selection_kernel[(n,)](
            rows, squares, norm, norm if factor is None else factor, norm if position is None else position,
            0.0 if norm_scale is None else float(norm_scale), float(eps), r, k,
            NORM=True, FACTOR=factor is not None, POSITIONS=positions, BLOCK=BLOCK_SLOTS,
        )
    if positions and _version(rows) is not None:
        setattr(rows, _ATTRIBUTE, (_version(rows), position))
    return norm, factor


def selection_positions(rows: Tensor, R: int) -> Tensor:
    """The inverse of a row selection rows [N, k] (distinct rows of R): [N, R] int32 holding
    each row's slot in rows, −1 for rows not selected; the one attached to rows when it was
    built with the norm (and rows has not changed since), else one launch."""
    attached = attached_positions(rows, R)
    if attached is not None:
        return attached
    if rows.dim() != 2 or rows.is_floating_point():
        raise ValueError(f"rows must be an integer [N, k] tensor, got {rows.dtype} {tuple(rows.shape)}")
    rows = rows.contiguous()
    n, k = rows.shape
    position = torch.empty((n, R), dtype=torch.int32, device=rows.device)
    if n and R:
        _selection_kernel[(n,)](rows, position, position, position, position, 0.0, 0.0, R, k,
                                NORM=False, FACTOR=False, POSITIONS=True, BLOCK=BLOCK_SLOTS)
    return position


def attached_positions(rows: Tensor, R: int) -> Optional[Tensor]:
    """The inverse attached to rows by selection_norm_triton, if rows is unchanged since and it
    covers R rows per matrix; else None."""
    attached = getattr(rows, _ATTRIBUTE, None)
    if attached is None:
        return None
    version, position = attached
    return position if version == _version(rows) and position.shape == (rows.shape[0], R) else None
