"""The order in which the symmetric kernels (Triton and Hopper Gluon) walk the output tiles that
touch the lower triangle: shared by both, so they agree on tiles and grid sizes."""
from __future__ import annotations

from functools import lru_cache

import triton
import triton.language as tl


@triton.jit
def _tile_coordinates(t, RATIO: tl.constexpr):
    """Map a linear tile index to (row block i, column block j) over the tiles that touch the
    lower triangle, in row-block order. With block_n = RATIO·block_m, row block i holds
    i // RATIO + 1 tiles, so groups of RATIO row blocks hold RATIO·(p+1) tiles and the first p
    groups RATIO·p·(p+1)/2; invert that with a square root, then fix float rounding.
    (Banded orders that walk a few row blocks column by column, for L2 reuse, were measured on
    the H200 and gained nothing consistent: docs/kernels.md, "Tried and rejected".)"""
    p = ((tl.sqrt(8.0 * t.to(tl.float32) / RATIO + 1.0) - 1.0) * 0.5).to(tl.int32)
    p = tl.where(RATIO * p * (p + 1) // 2 > t, p - 1, p)
    p = tl.where(RATIO * (p + 1) * (p + 2) // 2 <= t, p + 1, p)
    rem = t - RATIO * p * (p + 1) // 2
    return RATIO * p + rem // (p + 1), rem % (p + 1)


@lru_cache(maxsize=256)  # asked for on every launch (and by the dispatch rules) with few distinct sizes
def lower_tile_count(n: int, block_m: int, block_n: int) -> int:
    """Number of block_m×block_n output tiles that touch the lower triangle of an n×n output."""
    ratio = block_n // block_m
    return sum(i // ratio + 1 for i in range(triton.cdiv(n, block_m)))
