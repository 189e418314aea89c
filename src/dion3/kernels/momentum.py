"""Triton fused momentum accumulation: M ← decay·M + G and, optionally, each updated row's L1
norm (Dion3's selection score) and squared L2 norm (summed into the Frobenius norm that
Newton–Schulz normalizes by) in the same pass — one read of M and G and one write of M, where
the PyTorch path needs separate passes for scaling, adding, scoring and the norm.

One launch per parameter (gradients are separate tensors and may be replaced between steps,
so no pointer table is cached for them); inside a captured graph the launches cost nothing.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One row per program, 8 warps: 4.7–6% faster momentum pass than 4×512/4 warps on H200, the
# snapshot unchanged (benchmarks/sweep_elementwise.py; results/elementwise-h200-2026-11-29.md).
BLOCK_ROWS = 1
BLOCK_COLS = 1024
NUM_WARPS = 8


@triton.jit
def _accumulate_kernel(
    momentum_ptr, grad_ptr, scores_ptr, squares_ptr, decay, n_rows, C,
    HAS_DECAY: tl.constexpr, SCORES: tl.constexpr, SQUARES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < n_rows
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    total_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        inside = row_inside[:, None] & (cols[None, :] < C)
        offsets = rows[:, None] * C + cols[None, :]
        m = tl.load(momentum_ptr + offsets, mask=inside, other=0.0)
        g = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        value = m.to(tl.float32)
        if HAS_DECAY:
            value = value * decay
        stored = (value + g).to(m.dtype)
        tl.store(momentum_ptr + offsets, stored, mask=inside)
        # measure what was stored: the selection and the norm see the rounded momentum
        if SCORES:
            total += tl.sum(tl.abs(stored.to(tl.float32)), axis=1)
        if SQUARES:
            total_sq += tl.sum(stored.to(tl.float32) * stored.to(tl.float32), axis=1)
    if SCORES:
        tl.store(scores_ptr + rows, total, mask=row_inside)
    if SQUARES:
        tl.store(squares_ptr + rows, total_sq, mask=row_inside)


def fused_accumulate_supported(momentum: Tensor, grads: Sequence[Tensor]) -> bool:
    return (
        momentum.is_cuda
        and momentum.is_contiguous()
        and momentum.dtype in SUPPORTED_DTYPES
        and all(g.dtype in SUPPORTED_DTYPES and g.device == momentum.device for g in grads)
    )


def accumulate_momentum_triton(
    momentum: Tensor, grads: Sequence[Tensor], decay: float, scores: bool, squares: bool = False
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """momentum [N, R, C] (contiguous) ← decay·momentum + concat(grads); grads are [B_i, R, C].
    Returns (L1 norm of each updated row if scores, its squared L2 norm if squares), [N, R] float32."""
    n, rows, cols = momentum.shape
    wanted = lambda flag: torch.empty((n, rows), dtype=torch.float32, device=momentum.device) if flag else None  # noqa: E731
    out_scores, out_squares = wanted(scores), wanted(squares)
    flat_m = momentum.view(n * rows, cols)
    # placeholder pointers for outputs not asked for
    flat_s = out_scores.view(n * rows) if scores else flat_m
    flat_q = out_squares.view(n * rows) if squares else flat_m
    offset = 0
    for grad in grads:
        count = grad.shape[0] * rows
        grad = grad if grad.is_contiguous() else grad.contiguous()
        grid = (triton.cdiv(count, BLOCK_ROWS),)
        _accumulate_kernel[grid](
            flat_m[offset:], grad, flat_s[offset:], flat_q[offset:], float(decay), count, cols,
            HAS_DECAY=decay != 1.0, SCORES=scores, SQUARES=squares, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS,
            num_warps=NUM_WARPS,
        )
        offset += count
    return out_scores, out_squares


@triton.jit
def _snapshot_kernel(
    momentum_ptr, rows_ptr, out_ptr, scale_ptr, mu, R, C, k,
    SCALED: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # row blocks on grid axis 0 (up to 2³¹ − 1 programs; axes 1 and 2 stop at 65535)
    slots = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    matrix = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot_inside = slots < k
    rows = tl.load(rows_ptr + matrix * k + slots, mask=slot_inside, other=0)
    inside = slot_inside[:, None] & (cols[None, :] < C)
    source = (matrix * R + rows[:, None]) * C + cols[None, :]
    value = tl.load(momentum_ptr + source, mask=inside, other=0.0)
    copied = value
    if SCALED:  # float32 math, one rounding to the output dtype
        if PER_ROW:
            factor = tl.load(scale_ptr + matrix * k + slots, mask=slot_inside, other=0.0)
            copied = value.to(tl.float32) * factor[:, None]
        else:
            copied = value.to(tl.float32) * tl.load(scale_ptr + matrix)
    tl.store(out_ptr + (matrix * k + slots[:, None]) * C + cols[None, :], copied.to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(momentum_ptr + source, (value.to(tl.float32) * mu).to(value.dtype), mask=inside)


def snapshot_rows_triton(
    momentum: Tensor, rows: Tensor, mu: float, scale: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None
) -> Tensor:
    """U = momentum[rows] and momentum[rows] ← mu·momentum[rows], in one pass over the rows.
    scale ([N, 1, 1] one per matrix, or [N, k, 1] one per selected row; float32 math) and
    out_dtype: write U·scale in out_dtype instead (Dion3 writes Newton–Schulz's normalized
    half-precision input directly)."""
    n, r, c = momentum.shape
    k = rows.shape[-1]
    out = torch.empty((n, k, c), dtype=out_dtype or momentum.dtype, device=momentum.device)
    per_row = scale is not None and scale.numel() == n * k and k > 1
    scale_arg = out if scale is None else scale.reshape(-1).to(torch.float32).contiguous()
    grid = (triton.cdiv(k, BLOCK_ROWS), n, triton.cdiv(c, BLOCK_COLS))
    _snapshot_kernel[grid](momentum, rows.contiguous(), out, scale_arg, float(mu), r, c, k,
                          SCALED=scale is not None, PER_ROW=per_row, BLOCK_K=BLOCK_ROWS, BLOCK_C=BLOCK_COLS,
                          num_warps=NUM_WARPS)
    return out
