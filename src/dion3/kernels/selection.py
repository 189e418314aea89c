"""Triton per-matrix bookkeeping of Dion3's row selection, one program per matrix:

- the selection itself: the k rows with the largest scores, ascending, ties to the lower row
  (where PyTorch needs a topk and a sort, the two costliest launches of an eager step on the
  host: ~33 and ~65 µs against ~25 for a batched GEMM on the H200 machine);
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
def _score_bits(scores_ptr, matrix, R, offsets):
    """The scores at offsets as int32 bit patterns that order like the scores: −0 as +0, NaN as
    +inf (as reference.top_rows_reference), −1 past R (never counted)."""
    bits = tl.load(scores_ptr + matrix * R + offsets, mask=offsets < R, other=0.0).to(tl.int32, bitcast=True)
    return tl.where(offsets < R, tl.minimum(bits & 0x7FFFFFFF, 0x7F800000), -1)


@triton.jit
def _select_top_rows(scores_ptr, rows_ptr, matrix, R, k, BLOCK: tl.constexpr):
    """Write the k rows with the largest scores of one matrix to rows_ptr, ascending; among equal
    scores the lower rows first. Scores are non-negative floats, which order like their bit
    patterns: a bitwise binary search finds the k-th largest pattern, then one pass writes
    the rows above it and the first of the rows equal to it."""
    kth = tl.full([], 0, tl.int32)
    step = tl.full([], 1 << 30, tl.int32)
    for _ in range(31):  # the largest pattern t with at least k scores ≥ t, one bit at a time
        candidate = kth | step
        count = tl.full([], 0, tl.int32)
        # while loops, not range(0, R, BLOCK): Triton 3.6's interpreter cannot take a runtime
        # bound under NumPy 2.4 (momentum._accumulate_kernel says why); compiled, the same instructions
        start = 0 * R
        while start < R:
            offsets = start + tl.arange(0, BLOCK)
            bits = _score_bits(scores_ptr, matrix, R, offsets)
            count += tl.sum((bits >= candidate).to(tl.int32), axis=0)
            start += BLOCK
        kth = tl.where(count >= k, candidate, kth)
        step = step >> 1
    above = tl.full([], 0, tl.int32)
    start = 0 * R
    while start < R:
        offsets = start + tl.arange(0, BLOCK)
        bits = _score_bits(scores_ptr, matrix, R, offsets)
        above += tl.sum((bits > kth).to(tl.int32), axis=0)
        start += BLOCK
    ties_wanted = k - above
    ties_seen = tl.full([], 0, tl.int32)
    written = tl.full([], 0, tl.int32)
    start = 0 * R
    while start < R:
        offsets = start + tl.arange(0, BLOCK)
        bits = _score_bits(scores_ptr, matrix, R, offsets)
        tie = (bits == kth).to(tl.int32)
        chosen = ((bits > kth) | ((tie == 1) & (tl.cumsum(tie, axis=0) - tie + ties_seen < ties_wanted))).to(tl.int32)
        slots = tl.cumsum(chosen, axis=0) - chosen + written
        tl.store(rows_ptr + matrix * k + slots, offsets.to(tl.int64), mask=chosen == 1)
        ties_seen += tl.sum(tie, axis=0)
        written += tl.sum(chosen, axis=0)
        start += BLOCK


@triton.jit
def _selection_kernel(
    scores_ptr, rows_ptr, squares_ptr, norm_ptr, factor_ptr, position_ptr, norm_scale, eps, R, k,
    SELECT: tl.constexpr, NORM: tl.constexpr, FACTOR: tl.constexpr, POSITIONS: tl.constexpr, BLOCK: tl.constexpr,
):
    matrix = tl.program_id(0).to(tl.int64)
    if SELECT:
        _select_top_rows(scores_ptr, rows_ptr, matrix, R, k, BLOCK)
        tl.debug_barrier()  # the rows stored above, by whichever threads stored them
    if NORM:
        total = tl.zeros([BLOCK], dtype=tl.float32)
        start = 0 * k  # while loops for Triton 3.6's interpreter, as in _select_top_rows
        while start < k:
            slots = start + tl.arange(0, BLOCK)
            inside = slots < k
            rows = tl.load(rows_ptr + matrix * k + slots, mask=inside, other=0)
            total += tl.load(squares_ptr + matrix * R + rows, mask=inside, other=0.0)
            start += BLOCK
        norm = tl.sqrt(tl.sum(total, axis=0))
        tl.store(norm_ptr + matrix, norm)
        if FACTOR:
            tl.store(factor_ptr + matrix, 1.0 / (norm * norm_scale + eps))
    if POSITIONS:
        start = 0 * R
        while start < R:
            offsets = start + tl.arange(0, BLOCK)
            tl.store(position_ptr + matrix * R + offsets, tl.full([BLOCK], -1, tl.int32), mask=offsets < R)
            start += BLOCK
        tl.debug_barrier()  # every −1 lands before any slot: no thread overwrites another's slot
        start = 0 * k
        while start < k:
            slots = start + tl.arange(0, BLOCK)
            inside = slots < k
            rows = tl.load(rows_ptr + matrix * k + slots, mask=inside, other=0)
            tl.store(position_ptr + matrix * R + rows, slots.to(tl.int32), mask=inside)
            start += BLOCK


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


def _launch(scores: Optional[Tensor], rows: Tensor, squares: Optional[Tensor], norm_scale: Optional[float],
            eps: float, positions: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """One launch over the N matrices of rows [N, k]: select rows first (scores given: written
    into rows), then the norm (squares given) and the inverse (positions, attached to rows)."""
    n, k = rows.shape
    r = (scores if scores is not None else squares).shape[1]
    norm = torch.empty((n, 1, 1), dtype=torch.float32, device=rows.device) if squares is not None else None
    factor = torch.empty_like(norm) if norm is not None and norm_scale is not None else None
    position = torch.empty((n, r), dtype=torch.int32, device=rows.device) if positions else None
    if n:
        anything = rows  # placeholder pointer for what this launch leaves out
        _selection_kernel[(n,)](
            anything if scores is None else scores, rows, anything if squares is None else squares,
            anything if norm is None else norm, anything if factor is None else factor,
            anything if position is None else position,
            0.0 if norm_scale is None else float(norm_scale), float(eps), r, k,
            SELECT=scores is not None, NORM=norm is not None, FACTOR=factor is not None, POSITIONS=positions,
            BLOCK=BLOCK_SLOTS,
        )
    if positions and _version(rows) is not None:
        setattr(rows, _ATTRIBUTE, (_version(rows), position))
    return norm, factor


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
    return _launch(None, rows, squares, norm_scale, eps, positions)


def top_rows_supported(scores: Tensor, k: int, squares: Optional[Tensor] = None) -> bool:
    """Layouts the selecting launch handles: float32 contiguous scores [N, R] (non-negative),
    1 ≤ k ≤ R < 2³¹, squares (if any) like scores (the device is the dispatch's to check)."""
    return (scores.dim() == 2 and scores.dtype == torch.float32 and scores.is_contiguous()
            and 1 <= k <= scores.shape[1] < 2**31
            and (squares is None or (squares.shape == scores.shape and squares.dtype == torch.float32
                                     and squares.is_contiguous() and squares.device == scores.device)))


def top_rows_triton(
    scores: Tensor, k: int, squares: Optional[Tensor] = None, norm_scale: Optional[float] = None, eps: float = 0.0,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(rows, norm, factor): the k rows of each matrix with the largest non-negative scores
    [N, R] (float32), ascending, ties to the lower row ([N, k] int64, as
    reference.top_rows_reference picks them); with squares [N, R] also the selection's norm and
    factor as selection_norm_triton gives them, and its inverse attached to rows. One launch."""
    if not top_rows_supported(scores, k, squares):
        raise ValueError(f"top_rows_triton needs float32 contiguous scores [N, R] and 1 ≤ k ≤ R, got "
                         f"{scores.dtype} {tuple(scores.shape)}, k={k}")
    rows = torch.empty((scores.shape[0], k), dtype=torch.int64, device=scores.device)
    norm, factor = _launch(scores, rows, squares, norm_scale, eps, positions=squares is not None)
    return rows, norm, factor


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
        _selection_kernel[(n,)](rows, rows, rows, rows, rows, position, 0.0, 0.0, R, k,
                                SELECT=False, NORM=False, FACTOR=False, POSITIONS=True, BLOCK=BLOCK_SLOTS)
    return position


def attached_positions(rows: Tensor, R: int) -> Optional[Tensor]:
    """The inverse attached to rows by selection_norm_triton, if rows is unchanged since and it
    covers R rows per matrix; else None."""
    attached = getattr(rows, _ATTRIBUTE, None)
    if attached is None:
        return None
    version, position = attached
    return position if version == _version(rows) and position.shape == (rows.shape[0], R) else None
