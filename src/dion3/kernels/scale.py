"""Triton scale-and-cast: out = (x · s) in the output dtype, with s one float32 per matrix or per
row. Used to normalize the input of Newton–Schulz (s per matrix, fp32 → bf16/fp16) and for
NorMuon's per-row scaling (s per row). One read and one write: PyTorch's mixed-dtype broadcast
multiply takes a generic, unvectorized path that ran at about a third of the copy bandwidth
(H200 profile recorded in commit 5ab6a50; benchmarks/results/step-h200-2026-12-01.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# H200 sweep (benchmarks/sweep_elementwise.py): 1×2048/8 warps 2% over 4×1024/4 warps.
BLOCK_ROWS = 1
BLOCK_COLS = 2048
NUM_WARPS = 8


@triton.jit
def _scale_cast_kernel(
    x_ptr, scale_ptr, out_ptr, n_rows, R, C, stride_om, stride_or,
    PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_inside = rows < n_rows
    inside = row_inside[:, None] & (cols[None, :] < C)
    scale = tl.load(scale_ptr + (rows if PER_ROW else rows // R), mask=row_inside, other=0.0)
    offsets = rows[:, None] * C + cols[None, :]
    value = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32) * scale[:, None]
    # out may be the matrices of a padded buffer (ortho.padding): rows R apart by its strides
    out_rows = (rows // R) * stride_om + (rows % R) * stride_or
    tl.store(out_ptr + out_rows[:, None] + cols[None, :], value.to(out_ptr.dtype.element_ty), mask=inside)


def scale_cast_supported(x: Tensor, scale: Tensor, out_dtype: torch.dtype, out: Optional[Tensor] = None) -> bool:
    """Shapes and dtypes the kernel handles (the device is dion3.kernels' dispatch's to check)."""
    if out is not None and (out.shape != x.shape or out.dtype != out_dtype or out.stride(-1) != 1):
        return False
    return (
        x.dim() == 3
        and x.is_contiguous()
        and x.dtype in SUPPORTED_DTYPES
        and out_dtype in SUPPORTED_DTYPES
        and scale.shape in ((x.shape[0], 1, 1), (x.shape[0], x.shape[1], 1))
    )


def scale_cast_triton(x: Tensor, scale: Tensor, out_dtype: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
    """x [N, R, C] (contiguous) times scale [N, 1, 1] or [N, R, 1], computed in float32, written
    into out (any [N, R, C] view with unit column stride, e.g. a padded buffer's matrices) or a
    new tensor."""
    n, rows, cols = x.shape
    if out is None:
        out = torch.empty((n, rows, cols), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    per_row = scale.shape[1] == rows and rows != 1
    grid = (triton.cdiv(n * rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _scale_cast_kernel[grid](
        x, scale.float().contiguous(), out, n * rows, rows, cols, out.stride(0), out.stride(1),
        PER_ROW=per_row, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=NUM_WARPS,
    )
    return out
