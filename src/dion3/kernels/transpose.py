"""Triton batched transposed copy: dst ← (src.mT · s) for strided [B, rows, cols] views, with an
optional float32 factor s per matrix and a cast to dst's dtype on the way.

Uses: the split symmetric product (kernels/split.py) mirrors its dense block; Newton–Schulz
normalizes a tall input straight into the wide orientation (one read of the float32 momentum,
one half-precision write) and hands a tall result back contiguous. PyTorch's copy of a
transposed view walks one side with a large stride; here each program moves a square tile,
loaded along src's rows and stored along dst's rows, so both sides stay coalesced.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE = 64
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _transpose_kernel(
    src_ptr, dst_ptr, scale_ptr, rows, cols,
    stride_sb, stride_sr, stride_sc, stride_db, stride_dr, stride_dc,
    HAS_SCALE: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
):
    # dst is [B, rows, cols]; src is [B, cols, rows].
    batch = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    c = tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)
    # Read src[c, r] as a [TILE_C, TILE_R] tile (contiguous along r when src rows are).
    src = src_ptr + batch * stride_sb + c[:, None].to(tl.int64) * stride_sr + r[None, :] * stride_sc
    tile = tl.load(src, mask=(c[:, None] < cols) & (r[None, :] < rows))
    if HAS_SCALE:  # float32 math, one rounding to dst's dtype
        tile = tile.to(tl.float32) * tl.load(scale_ptr + batch)
    dst = dst_ptr + batch * stride_db + r[:, None].to(tl.int64) * stride_dr + c[None, :] * stride_dc
    tl.store(dst, tl.trans(tile).to(dst_ptr.dtype.element_ty), mask=(r[:, None] < rows) & (c[None, :] < cols))


def transpose_supported(dst: Tensor, src: Tensor) -> bool:
    return src.is_cuda and dst.device == src.device and src.dtype in SUPPORTED_DTYPES and dst.dtype in SUPPORTED_DTYPES


def transpose_into_triton(dst: Tensor, src: Tensor, scale: Optional[Tensor] = None) -> None:
    """dst [B, rows, cols] ← src.mT (· scale), src [B, cols, rows]; any strides, same device.
    scale: one factor per matrix ([B], [B, 1, 1]; float32 math); dst's dtype may differ from
    src's (one rounding)."""
    if dst.dim() != 3 or src.shape != (dst.shape[0], dst.shape[2], dst.shape[1]):
        raise ValueError(f"src must have dst.mT's shape: dst {tuple(dst.shape)}, src {tuple(src.shape)}")
    batch, rows, cols = dst.shape
    if scale is not None:
        if scale.numel() != batch:
            raise ValueError(f"scale needs one factor per matrix ({batch}), got shape {tuple(scale.shape)}")
        scale = scale.reshape(batch).to(device=dst.device, dtype=torch.float32).contiguous()
    if dst.numel() == 0:
        return
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE), batch)
    _transpose_kernel[grid](src, dst, dst if scale is None else scale, rows, cols, *src.stride(), *dst.stride(),
                            HAS_SCALE=scale is not None, TILE_R=TILE, TILE_C=TILE)
