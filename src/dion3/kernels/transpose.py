"""Triton batched transposed copy: dst ← src.mT for strided [B, rows, cols] views.

The split symmetric product (kernels/split.py) mirrors its dense block with it. PyTorch's
copy_ of a transposed view walks one side with a large stride; here each program moves a
square tile, loaded along src's rows and stored along dst's rows, so both sides stay
coalesced.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

TILE = 64


@triton.jit
def _transpose_kernel(
    src_ptr, dst_ptr, rows, cols,
    stride_sb, stride_sr, stride_sc, stride_db, stride_dr, stride_dc,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):
    # dst is [B, rows, cols]; src is [B, cols, rows].
    batch = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    c = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    # Read src[c, r] as a [TILE_C, TILE_R] tile (contiguous along r when src rows are).
    src = src_ptr + batch * stride_sb + c[:, None].to(tl.int64) * stride_sr + r[None, :] * stride_sc
    tile = tl.load(src, mask=(c[:, None] < cols) & (r[None, :] < rows))
    dst = dst_ptr + batch * stride_db + r[:, None].to(tl.int64) * stride_dr + c[None, :] * stride_dc
    tl.store(dst, tl.trans(tile), mask=(r[:, None] < rows) & (c[None, :] < cols))


def transpose_into_triton(dst: Tensor, src: Tensor) -> None:
    """dst [B, rows, cols] ← src.mT, src [B, cols, rows]; any strides, same dtype and device."""
    if dst.dim() != 3 or src.shape != (dst.shape[0], dst.shape[2], dst.shape[1]) or src.dtype != dst.dtype:
        raise ValueError(f"src must be dst.mT's shape and dtype: dst {dst.dtype} {tuple(dst.shape)}, "
                         f"src {src.dtype} {tuple(src.shape)}")
    batch, rows, cols = dst.shape
    if dst.numel() == 0:
        return
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE), batch)
    _transpose_kernel[grid](src, dst, rows, cols, *src.stride(), *dst.stride(), TILE_R=TILE, TILE_C=TILE)
