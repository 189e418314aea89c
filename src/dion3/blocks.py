"""Per-block orthogonalization: the rows of a matrix split into blocks that are stepped as
separate matrices (DESIGN §5, "Per-block orthogonalization").

A group's `num_heads=H` splits the rows of each matrix into H equal heads; `split_sizes=(q, k, v)`
splits them into uneven blocks (fused QKV of grouped-query attention, gate/up). Each block gets
exactly the update a separate parameter of the block's shape would get: its own row selection,
error feedback, orthogonalization, per-row normalization and lr scale.

This module holds the block arithmetic only (sizes, row ranges, cutting a [B, rows, cols] batch
into blocks); it imports nothing else of dion3, so every layout's bucketing can use it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from torch import Tensor


def option_error(num_heads: Any, split_sizes: Any) -> Optional[str]:
    """Why a group's num_heads / split_sizes cannot be used (whatever the parameters), or None."""
    if num_heads is not None and split_sizes is not None:
        return "num_heads and split_sizes are both set; give at most one of them"
    if num_heads is not None and not _positive_int(num_heads):
        return f"num_heads must be a positive integer or None, got {num_heads!r}"
    if split_sizes is not None:
        if isinstance(split_sizes, (str, bytes)) or not isinstance(split_sizes, Sequence) or not split_sizes:
            return f"split_sizes must be a non-empty sequence of positive integers or None, got {split_sizes!r}"
        if not all(_positive_int(s) for s in split_sizes):
            return f"split_sizes must hold positive integers, got {tuple(split_sizes)!r}"
    return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def block_sizes(rows: int, num_heads: Optional[int] = None, split_sizes: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The row count of each block of a matrix with `rows` rows: (rows,) without a split.
    ValueError (without the parameter's name: the caller adds it) when the split does not fit."""
    if split_sizes is not None:
        sizes = tuple(int(s) for s in split_sizes)
        if sum(sizes) != rows:
            raise ValueError(f"has {rows} rows, but split_sizes={sizes} sum to {sum(sizes)}")
        return sizes
    if num_heads is not None and num_heads > 1:
        if rows % num_heads:
            raise ValueError(f"has {rows} rows, which num_heads={num_heads} does not split into equal heads")
        return (rows // num_heads,) * num_heads
    return (rows,)


def row_ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) of each block, in order."""
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) of every matrix of a [B, rows, cols] batch, as `heads` equal heads
    folded into the batch: the block is the [B·heads, (stop − start)/heads, cols] tensor."""

    start: int
    stop: int
    heads: int = 1

    def cut(self, matrices: Tensor) -> Tensor:
        """This block of matrices [B, rows, cols]: a view of it (the caller checked that one
        exists for parameters; for gradients a copy is acceptable and made when needed)."""
        whole = self.start == 0 and self.stop == matrices.shape[-2]
        part = matrices if whole else matrices[:, self.start : self.stop]
        if self.heads == 1:
            return part
        return part.reshape(part.shape[0] * self.heads, (self.stop - self.start) // self.heads, part.shape[-1])


def blocks_of(matrices: Tensor, sizes: Sequence[int]) -> list[Block]:
    """The entries a [B, rows, cols] parameter contributes to the buckets: one Block for equal
    heads when folding them into the batch is a view of the parameter (its state then stays one
    span of a bucket buffer), else one Block per row range."""
    rows = matrices.shape[-2]
    if len(sizes) == 1:
        return [Block(0, rows)]
    if len(set(sizes)) == 1:
        try:
            matrices.view(matrices.shape[0] * len(sizes), sizes[0], matrices.shape[-1])
            return [Block(0, rows, len(sizes))]
        except RuntimeError:  # strides that do not fold (rare): one entry per head
            pass
    return [Block(start, stop) for start, stop in row_ranges(sizes)]
