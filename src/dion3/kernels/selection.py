"""Triton per-matrix summary of Dion3's row selection: from the squared row norms that the fused
momentum pass measured, each matrix's Frobenius norm over its selected rows and Newton–Schulz's
input factor 1/(norm_scale·norm + ε), in one launch of one program per matrix. PyTorch needs a
gather, a sum, a square root and three elementwise launches for the same [N] numbers; at small
shapes each of those costs more host time than the whole kernel takes on the GPU.

The sum runs in float32 like the PyTorch path's, in another order (blocks of slots).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_SLOTS = 256


@triton.jit
def _selection_norm_kernel(
    rows_ptr, squares_ptr, norm_ptr, factor_ptr, norm_scale, eps, R, k,
    FACTOR: tl.constexpr, BLOCK: tl.constexpr,
):
    matrix = tl.program_id(0).to(tl.int64)
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


def selection_norm_supported(squares: Tensor, rows: Tensor) -> bool:
    """Layouts the kernel handles (the device is dion3.kernels' dispatch's to check)."""
    return (squares.dim() == 2 and rows.dim() == 2 and squares.dtype == torch.float32 and squares.is_contiguous()
            and rows.is_contiguous() and rows.shape[0] == squares.shape[0] and not rows.is_floating_point()
            and rows.device == squares.device)


def selection_norm_triton(
    squares: Tensor, rows: Tensor, norm_scale: Optional[float] = None, eps: float = 0.0
) -> tuple[Tensor, Optional[Tensor]]:
    """(‖selected rows‖_F per matrix, 1/(norm_scale·norm + eps) per matrix or None when
    norm_scale is None), both [N, 1, 1] float32. squares: [N, R] float32 squared row norms;
    rows: [N, k] selected rows."""
    if not selection_norm_supported(squares, rows):
        raise ValueError(
            f"selection_norm_triton needs float32 contiguous squares [N, R] and integer rows [N, k] on one "
            f"device, got {squares.dtype} {tuple(squares.shape)} and {rows.dtype} {tuple(rows.shape)}")
    n, r = squares.shape
    k = rows.shape[1]
    norm = torch.empty((n, 1, 1), dtype=torch.float32, device=squares.device)
    factor = None if norm_scale is None else torch.empty_like(norm)
    if n == 0:
        return norm, factor
    _selection_norm_kernel[(n,)](
        rows, squares, norm, norm if factor is None else factor,
        0.0 if norm_scale is None else float(norm_scale), float(eps), r, k,
        FACTOR=factor is not None, BLOCK=BLOCK_SLOTS,
    )
    return norm, factor
