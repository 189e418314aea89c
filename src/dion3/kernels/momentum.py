"""Triton fused momentum accumulation: M ← decay·M + G and, optionally, each updated row's L1
norm (Dion3's selection score) and squared L2 norm (summed into the Frobenius norm that
Newton–Schulz normalizes by) in the same pass — one read of M and G and one write of M, where
the PyTorch path needs separate passes for scaling, adding, scoring and the norm. Entries whose
gradient is not finite keep their momentum, and their rows measure NaN (reference.py's rule).

One launch per call when the gradient pieces share shape and dtype and are contiguous and
16-byte aligned (the usual bucket): a device table of the pieces' data pointers, cached by
(device, dtype, addresses) in a small bounded cache, tells each row where its gradient lives.
A replaced gradient has a new address, hence a new key and table; while a CUDA graph is being
captured a missing table cannot be copied to the device, so that call (and any other bucket:
a single piece, mixed shapes or dtypes, strided or unaligned pieces) launches once per piece.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# One row per program, 8 warps: 4.7–6% faster momentum pass than 4×512/4 warps on H200, the
# snapshot unchanged (benchmarks/sweep_elementwise.py; results/kernels-h200-2026-11-29.md).
BLOCK_ROWS = 1
BLOCK_COLS = 1024
NUM_WARPS = 8

# Pointer tables of gradient buckets, (device, dtype, data_ptrs) → int64 device tensor, least
# recently used first. A table holds addresses only: a new gradient allocated at a recycled
# address is read correctly through the old table, and one at a new address gets a new key.
POINTER_TABLE_LIMIT = 64
_pointer_tables: "OrderedDict[tuple, Tensor]" = OrderedDict()
# Tables a captured CUDA graph reads: never evicted (the graph's replays would read freed memory).
_graph_tables: dict = {}


@triton.jit
def _accumulate_kernel(
    momentum_ptr, grad_ptr, grad_table, scores_ptr, squares_ptr, decay, n_rows, piece_rows, C,
    HAS_DECAY: tl.constexpr, SCORES: tl.constexpr, SQUARES: tl.constexpr, POINTER_TABLE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < n_rows
    if POINTER_TABLE:
        # grad_ptr is the first piece, read only for its element type; grad_table holds each
        # piece's address, piece_rows rows apiece. The launcher checked that every piece is
        # 16-byte aligned: said of the pointers (a hint on the int64 addresses does not reach
        # them), it lets Triton vectorize the gradient loads as for a pointer argument.
        piece = rows // piece_rows
        address = tl.load(grad_table + piece, mask=row_inside, other=0)
        piece_start = tl.multiple_of(address.to(tl.pointer_type(grad_ptr.dtype.element_ty)), 16)
        grad_rows = piece_start + (rows - piece * piece_rows) * C
    else:
        grad_rows = grad_ptr + rows * C
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    total_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    # while, not `for start in range(0, C, BLOCK_C)`: Triton 3.6's interpreter takes a runtime
    # loop bound through int() of a 1-element array, which NumPy 2.4 refuses (triton-lang/triton
    # #9171). Compiled, both give the same instructions; 0 * C counts in C's type, as range would.
    start = 0 * C
    while start < C:
        cols = start + tl.arange(0, BLOCK_C)
        inside = row_inside[:, None] & (cols[None, :] < C)
        offsets = rows[:, None] * C + cols[None, :]
        m = tl.load(momentum_ptr + offsets, mask=inside, other=0.0)
        g = tl.load(grad_rows[:, None] + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        value = m.to(tl.float32)
        if HAS_DECAY:
            value = value * decay
        # a gradient entry that is not finite never enters the momentum (the guard skips its matrix)
        finite = tl.abs(g) < float("inf")
        bad += tl.sum((inside & (finite == 0)).to(tl.int32), axis=1)
        stored = tl.where(finite, value + g, m.to(tl.float32)).to(m.dtype)
        tl.store(momentum_ptr + offsets, stored, mask=inside)
        # measure what was stored: the selection and the norm see the rounded momentum
        if SCORES:
            total += tl.sum(tl.abs(stored.to(tl.float32)), axis=1)
        if SQUARES:
            total_sq += tl.sum(stored.to(tl.float32) * stored.to(tl.float32), axis=1)
        start += BLOCK_C
    # a row whose gradient was not finite measures NaN: selected first, and its matrix's norm is NaN
    if SCORES:
        tl.store(scores_ptr + rows, tl.where(bad > 0, float("nan"), total), mask=row_inside)
    if SQUARES:
        tl.store(squares_ptr + rows, tl.where(bad > 0, float("nan"), total_sq), mask=row_inside)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of device is capturing a CUDA graph (never on CPU, where
    torch.cuda cannot be asked: the interpreter tests patch this function)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def one_launch_pieces(grads: Sequence[Tensor]) -> bool:
    """Whether one launch can read every piece through a pointer table: 2+ pieces of one shape
    and dtype, each contiguous and 16-byte aligned (the kernel promises aligned rows to Triton)."""
    if len(grads) < 2:
        return False
    first = grads[0]
    return first.numel() > 0 and all(
        g.shape == first.shape and g.dtype == first.dtype and g.is_contiguous() and g.data_ptr() % 16 == 0
        for g in grads
    )


def grad_pointer_table(grads: Sequence[Tensor]) -> Optional[Tensor]:
    """The cached device table of the pieces' data pointers, or None when it is not cached and
    the stream is capturing a graph (a host-to-device copy cannot be captured)."""
    first = grads[0]
    key = (first.device, first.dtype, tuple(g.data_ptr() for g in grads))
    capturing = _capturing(first.device)
    table = _graph_tables.get(key)
    if table is None:
        table = _pointer_tables.get(key)
        if table is not None:
            _pointer_tables.move_to_end(key)  # most recently used last: eviction drops the stalest
        else:
            if capturing:
                return None
            table = torch.tensor(key[2], dtype=torch.int64, device=first.device)
            _pointer_tables[key] = table
            while len(_pointer_tables) > POINTER_TABLE_LIMIT:
                _pointer_tables.popitem(last=False)
        if capturing:  # the graph keeps reading this table: keep it alive
            _graph_tables[key] = _pointer_tables.pop(key)
    return table


def fused_accumulate_supported(momentum: Tensor, grads: Sequence[Tensor]) -> bool:
    """Layouts and dtypes the kernels handle (the device is dion3.kernels' dispatch's to check)."""
    return (
        momentum.is_contiguous()
        and momentum.dtype in SUPPORTED_DTYPES
        and all(g.dtype in SUPPORTED_DTYPES and g.device == momentum.device for g in grads)
    )


def _launch_accumulate(
    momentum_rows, grad, table, scores_rows, squares_rows, decay, count, piece_rows, cols, scores, squares
) -> None:
    """One launch over count rows of cols entries from momentum_rows (contiguous; its pointer is
    the first row): from grad itself (table None) or from the pieces listed in table (grad: the
    first piece, giving the element type)."""
    _accumulate_kernel[(triton.cdiv(count, BLOCK_ROWS),)](
        momentum_rows, grad, grad if table is None else table, scores_rows, squares_rows, float(decay),
        count, piece_rows, cols,
        HAS_DECAY=decay != 1.0, SCORES=scores, SQUARES=squares, POINTER_TABLE=table is not None,
        BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=NUM_WARPS,
    )


def accumulate_momentum_triton(
    momentum: Tensor, grads: Sequence[Tensor], decay: float, scores: bool, squares: bool = False
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """momentum [N, R, C] (contiguous) ← decay·momentum + concat(grads); grads are [B_i, R, C].
    Returns (L1 norm of each updated row if scores, its squared L2 norm if squares), [N, R] float32.
    One launch for same-shape, same-dtype, contiguous pieces, else one per piece (module docstring)."""
    n, rows, cols = momentum.shape
    if sum(g.shape[0] for g in grads) != n or any(g.shape[1:] != (rows, cols) for g in grads):
        shapes = [tuple(g.shape) for g in grads]
        raise ValueError(f"gradients of shapes {shapes} do not fill momentum {tuple(momentum.shape)}")
    wanted = lambda flag: torch.empty((n, rows), dtype=torch.float32, device=momentum.device) if flag else None  # noqa: E731
    out_scores, out_squares = wanted(scores), wanted(squares)
    table = grad_pointer_table(grads) if one_launch_pieces(grads) else None
    if table is not None:  # the tensors themselves (no views to dispatch); momentum: placeholder pointer
        piece_rows = grads[0].shape[0] * rows
        _launch_accumulate(momentum, grads[0], table, momentum if out_scores is None else out_scores,
                           momentum if out_squares is None else out_squares, decay, n * rows, piece_rows, cols,
                           scores, squares)
        return out_scores, out_squares
    flat_m = momentum.view(n * rows, cols)
    # placeholder pointers for outputs not asked for
    flat_s = out_scores.view(n * rows) if scores else flat_m
    flat_q = out_squares.view(n * rows) if squares else flat_m
    offset = 0
    for grad in grads:
        count = grad.shape[0] * rows
        grad = grad if grad.is_contiguous() else grad.contiguous()
        _launch_accumulate(flat_m[offset:], grad, None, flat_s[offset:], flat_q[offset:], decay, count, count, cols,
                           scores, squares)
        offset += count
    return out_scores, out_squares


@triton.jit
def _snapshot_kernel(
    momentum_ptr, rows_ptr, out_ptr, scale_ptr, mu, R, C, k, stride_om, stride_or,
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
    feedback = inside
    if SCALED:  # float32 math, one rounding to the output dtype
        if PER_ROW:
            factor = tl.load(scale_ptr + matrix * k + slots, mask=slot_inside, other=0.0)
        else:
            factor = tl.full([BLOCK_K], 0.0, tl.float32) + tl.load(scale_ptr + matrix)
        copied = value.to(tl.float32) * factor[:, None]
        # a factor that is not finite marks a matrix the guard skips: its momentum stays as it is
        feedback = inside & (tl.abs(factor) < float("inf"))[:, None]
    out_rows = matrix * stride_om + slots.to(tl.int64) * stride_or
    tl.store(out_ptr + out_rows[:, None] + cols[None, :], copied.to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(momentum_ptr + source, (value.to(tl.float32) * mu).to(value.dtype), mask=feedback)


def snapshot_rows_triton(
    momentum: Tensor, rows: Tensor, mu: float, scale: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """U = momentum[rows] and momentum[rows] ← mu·momentum[rows], in one pass over the rows.
    scale ([N, 1, 1] one per matrix, or [N, k, 1] one per selected row; float32 math) and
    out_dtype: write U·scale in out_dtype instead (Dion3 writes Newton–Schulz's normalized
    half-precision input directly); rows whose factor is not finite keep their momentum.
    out: an [N, k, C] view with unit column stride to write U into (a padded buffer's matrices)."""
    n, r, c = momentum.shape
    k = rows.shape[-1]
    dtype = out_dtype or momentum.dtype
    if out is None:
        out = torch.empty((n, k, c), dtype=dtype, device=momentum.device)
    elif out.shape != (n, k, c) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {dtype} [N, k, C] = {(n, k, c)} view with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    per_row = scale is not None and scale.numel() == n * k and k > 1
    if scale is None:
        scale_arg = out  # placeholder pointer
    elif scale.dtype == torch.float32 and scale.is_contiguous():
        scale_arg = scale  # read flat: no view to dispatch
    else:
        scale_arg = scale.reshape(-1).to(torch.float32).contiguous()
    grid = (triton.cdiv(k, BLOCK_ROWS), n, triton.cdiv(c, BLOCK_COLS))
    _snapshot_kernel[grid](momentum, rows.contiguous(), out, scale_arg, float(mu), r, c, k, out.stride(0), out.stride(1),
                          SCALED=scale is not None, PER_ROW=per_row, BLOCK_K=BLOCK_ROWS, BLOCK_C=BLOCK_COLS,
                          num_warps=NUM_WARPS)
    return out


@triton.jit
def _restore_kernel(
    momentum_ptr, grad_ptr, grad_table, keep_ptr, fed_ptr, position_ptr, mu, unselected, decay, n_rows, piece_rows,
    R, C,
    HAS_POSITIONS: tl.constexpr, POINTER_TABLE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < n_rows
    matrix = rows // R
    # keep: nonzero for matrices that stepped (nothing to undo), zero for those the guard skipped
    undo = row_inside & (tl.load(keep_ptr + matrix, mask=row_inside, other=1) == 0)
    if tl.max(undo.to(tl.int32), axis=0) > 0:  # almost every program stops here
        # error feedback (×mu on the selected rows, ×unselected on the others) went to matrices whose norm was finite
        if HAS_POSITIONS:
            selected = tl.load(position_ptr + rows, mask=undo, other=-1) >= 0
            fed = tl.abs(tl.load(fed_ptr + matrix, mask=undo, other=float("nan"))) < float("inf")
            divisor = tl.where(fed, tl.where(selected, mu, unselected), 1.0)
        else:
            divisor = tl.full([BLOCK_R], 1.0, tl.float32)
        if POINTER_TABLE:
            piece = rows // piece_rows
            address = tl.load(grad_table + piece, mask=row_inside, other=0)
            piece_start = tl.multiple_of(address.to(tl.pointer_type(grad_ptr.dtype.element_ty)), 16)
            grad_rows = piece_start + (rows - piece * piece_rows) * C
        else:
            grad_rows = grad_ptr + rows * C
        start = 0 * C  # a while loop for Triton 3.6's interpreter, as in _accumulate_kernel
        while start < C:
            cols = start + tl.arange(0, BLOCK_C)
            inside = undo[:, None] & (cols[None, :] < C)
            offsets = rows[:, None] * C + cols[None, :]
            m = tl.load(momentum_ptr + offsets, mask=inside, other=0.0)
            g = tl.load(grad_rows[:, None] + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            before = m.to(tl.float32) / divisor[:, None]
            finite = tl.abs(g) < float("inf")  # such entries were never added (accumulate kernel)
            old = tl.where(finite, (before - g) / decay, before)
            tl.store(momentum_ptr + offsets, old.to(m.dtype), mask=inside)
            start += BLOCK_C


RESTORE_BLOCK_ROWS = 8


def restore_momentum_triton(
    momentum: Tensor, grads: Sequence[Tensor], keep: Tensor, decay: float, mu: float = 1.0,
    fed: Optional[Tensor] = None, positions: Optional[Tensor] = None, unselected: float = 1.0,
) -> None:
    """Undo this step's momentum arithmetic on the matrices with keep[i] False (see
    reference.restore_momentum_reference): one launch, whose programs for kept matrices only
    read their flag. keep [N] bool; fed [N] float32 (finite: error feedback was applied);
    positions [N, R] int32 (≥ 0 at the selected rows), both or neither; unselected: the
    factor the other rows of a fed matrix got."""
    n, rows, cols = momentum.shape
    keep_arg = keep.view(torch.int8) if keep.dtype == torch.bool else keep  # a view: no launch
    has_positions = positions is not None
    position_arg = positions if has_positions else keep_arg
    fed_arg = fed.reshape(-1) if has_positions else keep_arg
    table = grad_pointer_table(grads) if one_launch_pieces(grads) else None

    def launch(flat_m, grad, table_arg, count, piece_rows, first) -> None:
        _restore_kernel[(triton.cdiv(count, RESTORE_BLOCK_ROWS),)](
            flat_m, grad, grad if table_arg is None else table_arg, keep_arg[first:],
            fed_arg[first:] if has_positions else keep_arg, position_arg.reshape(-1)[first * rows:] if has_positions
            else keep_arg, float(mu), float(unselected), float(decay), count, piece_rows, rows, cols,
            HAS_POSITIONS=has_positions, POINTER_TABLE=table_arg is not None,
            BLOCK_R=RESTORE_BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=4,
        )

    if table is not None:
        launch(momentum, grads[0], table, n * rows, grads[0].shape[0] * rows, 0)
        return
    flat_m = momentum.view(n * rows, cols)
    first = 0
    for grad in grads:
        count = grad.shape[0]
        launch(flat_m[first * rows:], grad if grad.is_contiguous() else grad.contiguous(), None, count * rows,
               count * rows, first)
        first += count
