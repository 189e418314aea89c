"""Split symmetric products: the off-diagonal block on a dense GEMM, the diagonal blocks on
the symmetric kernel.

D = alpha·A·B + beta·C (D symmetric, n×n) is cut into 2×2 blocks of h = n/2:

    [ D00  D01 ]     D10 = alpha·A[h:]·B[:, :h] + beta·C10   one dense product (cuBLAS)
    [ D10  D11 ]     D01 = D10ᵀ                              one transposed copy
                     D00, D11                                one launch of the symmetric kernel

The dense product runs at cuBLAS's per-tile efficiency, which the Triton kernel does not
reach, and a quarter of D's work is done there; the kernel still skips the upper halves of
the diagonal blocks. Worth it only when the blocks fill the GPU (see kernels/__init__.py).
The pieces are passed in, so the CPU tests check this composition with PyTorch pieces.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

# diagonal(a, b, c, alpha, beta, out, panels): fill out's `panels` diagonal blocks.
Diagonal = Callable[[Tensor, Tensor, Optional[Tensor], float, float, Tensor, int], None]
# transpose_into(dst, src): dst ← src.mT, both [B, rows, cols] views.
TransposeInto = Callable[[Tensor, Tensor], None]


def diagonal_blocks_reference(a, b, c, alpha, beta, out, panels) -> None:
    """PyTorch fill of the diagonal blocks (the CPU stand-in for the kernel's panels mode)."""
    size = out.shape[-1] // panels
    for p in range(panels):
        block = slice(p * size, (p + 1) * size)
        product = torch.matmul(a[:, block], b[:, :, block]) * alpha
        if c is not None:
            product += beta * c[:, block, block]
        out[:, block, block] = product


def transpose_into_reference(dst: Tensor, src: Tensor) -> None:
    dst.copy_(src.mT)


def split_symmetric_matmul(
    a: Tensor,
    b: Tensor,
    c: Optional[Tensor],
    alpha: float,
    beta: float,
    diagonal: Diagonal = diagonal_blocks_reference,
    transpose_into: TransposeInto = transpose_into_reference,
) -> Tensor:
    """D = alpha·a·b + beta·c for a: [B, n, k], b: [B, k, n], c: [B, n, n] or None; n even."""
    batch, n, _ = a.shape
    if n % 2:
        raise ValueError(f"the split product needs an even n, got {n}")
    h = n // 2
    out = torch.empty((batch, n, n), dtype=a.dtype, device=a.device)
    lower = out[:, h:, :h]
    if c is None or beta == 0.0:
        c = None  # beta = 0: baddbmm ignores its input (here: lower's uninitialized memory)
        torch.baddbmm(lower, a[:, h:], b[:, :, :h], beta=0.0, alpha=alpha, out=lower)
    else:
        torch.baddbmm(c[:, h:, :h], a[:, h:], b[:, :, :h], beta=beta, alpha=alpha, out=lower)
    transpose_into(out[:, :h, h:], lower)
    diagonal(a, b, c, alpha, beta, out, 2)
    return out
