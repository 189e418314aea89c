"""Triton fused post-update: param ← decay·param; param[rows] ← decay·param[rows] − step·s·update,
with s an optional per-row factor of update (NorMuon's normalization folded in: O is read once).

One launch covers every matrix of a bucket: a table of data pointers (one int64 per matrix,
cached per set of parameters) replaces a Python loop over parameters. A selection's inverse (each row's position in update)
comes from kernels/selection.py: built with the selection's norm, else one more small launch. Each element is read
once, computed in fp32 and rounded once to the parameter's dtype. decay and step may be
Python floats or 0-d device tensors read inside the kernel (no host sync: capturable).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from .momentum import grad_pointer_table, one_launch_pieces
from .reference import MomentumRestore, row_scale_column
from .selection import selection_positions

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_ROWS = 4
BLOCK_COLS = 512
NUM_WARPS = 4  # H200 sweep (benchmarks/sweep_elementwise.py): within 1% of the best config

_pointer_tables: dict = {}


@triton.jit
def _scalar(value, IS_POINTER: tl.constexpr):
    if IS_POINTER:
        result = tl.load(value).to(tl.float32)
    else:
        result = value
    return result


@triton.jit
def _post_update_kernel(
    pointer_table, dtype_probe, update_ptr, position_ptr, scale_ptr, decay, step,
    verdict_ptr, momentum_ptr, grad_ptr, grad_table, fed_ptr, restore_position_ptr, mu, unselected, momentum_decay,
    piece_batch,
    R, C, k, stride_um, stride_ur,
    HAS_ROWS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_VERDICT: tl.constexpr, RESTORE: tl.constexpr,
    HAS_FED: tl.constexpr, GRAD_TABLE: tl.constexpr,
    DECAY_IS_POINTER: tl.constexpr, STEP_IS_POINTER: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # row blocks on grid axis 0 (up to 2³¹ − 1 programs; axes 1 and 2 stop at 65535)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    matrix = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = (rows[:, None] < R) & (cols[None, :] < C)
    param = tl.load(pointer_table + matrix).to(tl.pointer_type(dtype_probe.dtype.element_ty))
    offsets = rows[:, None].to(tl.int64) * C + cols[None, :]
    value = tl.load(param + offsets, mask=inside, other=0.0).to(tl.float32)
    value = value * _scalar(decay, DECAY_IS_POINTER)
    if HAS_ROWS:  # position of each row in update, −1 for rows not selected
        position = tl.load(position_ptr + matrix * R + rows, mask=rows < R, other=-1)
        row_selected = position >= 0
        update_row = matrix * k + position
        slot = position
    else:
        row_selected = rows < R
        update_row = matrix * R + rows
        slot = rows
    if HAS_VERDICT:  # the guard's verdict on this matrix: a skipped one only decays (never 0·NaN)
        good = tl.load(verdict_ptr + matrix).to(tl.int32)
        row_selected = row_selected & (tl.full([BLOCK_R], 0, tl.int32) + good != 0)
    selected = inside & row_selected[:, None]
    # update may be the matrices of a padded buffer (ortho.padding): rows apart by its strides
    update_at = matrix * stride_um + slot.to(tl.int64) * stride_ur
    change = tl.load(update_ptr + update_at[:, None] + cols[None, :], mask=selected, other=0.0).to(tl.float32)
    step_value = _scalar(step, STEP_IS_POINTER)
    if HAS_SCALE:  # one factor per row, loaded once per row and folded into the step
        factor = tl.load(scale_ptr + update_row, mask=row_selected, other=0.0).to(tl.float32)
        # a factor of 0 leaves the row as it is (post_update_reference's rule for the verdict too)
        value = value - tl.where(selected & (factor[:, None] != 0.0), (step_value * factor)[:, None] * change, 0.0)
    else:
        value = value - tl.where(selected, step_value * change, 0.0)
    tl.store(param + offsets, value.to(dtype_probe.dtype.element_ty), mask=inside)
    if RESTORE:
        # the guard's last stage for a skipped matrix, in the same launch: its momentum back to what
        # it was before the step (as momentum.restore_momentum_triton); a kept matrix reads nothing more
        if good == 0:
            at = matrix * R * C + offsets
            if GRAD_TABLE:  # gradient pieces of piece_batch matrices each, listed by address
                piece = matrix // piece_batch
                address = tl.load(grad_table + piece)
                start = address.to(tl.pointer_type(grad_ptr.dtype.element_ty)) + (matrix - piece * piece_batch) * R * C
            else:
                start = grad_ptr + matrix * R * C
            m = tl.load(momentum_ptr + at, mask=inside, other=0.0)
            g = tl.load(start + offsets, mask=inside, other=0.0).to(tl.float32)
            before = m.to(tl.float32)
            # error feedback (×mu on the selected rows, ×unselected on the others) went to matrices whose norm was finite
            if HAS_FED:
                chosen = tl.load(restore_position_ptr + matrix * R + rows, mask=rows < R, other=-1) >= 0
                fed = tl.abs(tl.full([BLOCK_R], 0.0, tl.float32) + tl.load(fed_ptr + matrix)) < float("inf")
                before = before / tl.where(fed, tl.where(chosen, mu, unselected), 1.0)[:, None]
            finite = tl.abs(g) < float("inf")  # such entries were never added (the accumulate kernel)
            old = tl.where(finite, (before - g) / momentum_decay, before)
            tl.store(momentum_ptr + at, old.to(m.dtype), mask=inside)


def _pointer_table(params: Sequence[Tensor], device: torch.device) -> Tensor:
    """int64 data pointers of every matrix, cached so that a captured step does no host copy."""
    key = tuple((p.data_ptr(), p.shape[0], p.stride(0) * p.element_size()) for p in params)
    table = _pointer_tables.get(key)
    if table is None:
        if len(_pointer_tables) > 4096:  # parameters were reallocated many times: start over
            _pointer_tables.clear()
        pointers = [base + b * stride for base, count, stride in key for b in range(count)]
        table = torch.tensor(pointers, dtype=torch.int64, device=device)
        _pointer_tables[key] = table
    return table


def fused_update_supported(params: Sequence[Tensor], update: Tensor, row_scale: Optional[Tensor] = None) -> bool:
    """Whether the kernel handles these inputs: one dtype, same [R, C], each matrix contiguous,
    update with unit column stride (a padded buffer's matrices too), float32 row factors (if
    any) on update's device."""
    if not params:
        return False
    if row_scale is not None and (row_scale.dtype != torch.float32 or row_scale.device != update.device):
        return False
    first = params[0]
    if first.dtype not in SUPPORTED_DTYPES or first.dim() != 3:
        return False
    _, rows, cols = first.shape
    return update.dim() == 3 and update.stride(-1) == 1 and all(
        p.dtype == first.dtype and p.device == update.device and p.dim() == 3
        and p.shape[1:] == (rows, cols) and p.stride(-1) == 1 and p.stride(-2) == cols
        for p in params
    )


def _restore_layout(restore: MomentumRestore, total: int, R: int, C: int) -> Optional[tuple]:
    """(gradient pointer or probe, its pointer table or None, matrices per piece) when the fused
    post-update can also restore: momentum [total, R, C] contiguous and gradients of that shape as
    one contiguous tensor or same-shape aligned pieces (momentum.grad_pointer_table); else None.
    Asked on every step of every bucket: the pieces are walked once (one_launch_pieces), the
    rest is read off the first."""
    momentum, grads = restore.momentum, restore.grads
    pieces = [grads] if isinstance(grads, Tensor) else grads
    first = pieces[0] if len(pieces) else None
    if (first is None or momentum.shape != (total, R, C) or not momentum.is_contiguous()
            or momentum.dtype not in SUPPORTED_DTYPES or first.dtype not in SUPPORTED_DTYPES
            or first.device != momentum.device):
        return None
    if len(pieces) == 1:
        return (first, None, total) if first.shape == (total, R, C) and first.is_contiguous() else None
    # one_launch_pieces: every piece of the first one's shape and dtype, contiguous and aligned
    if first.shape[1:] != (R, C) or first.shape[0] * len(pieces) != total or not one_launch_pieces(pieces):
        return None
    table = grad_pointer_table(pieces)
    return None if table is None else (first, table, first.shape[0])


def post_update_triton(
    params: Sequence[Tensor],
    update: Tensor,
    rows: Optional[Tensor],
    decay: Union[Tensor, float],
    step: Union[Tensor, float],
    row_scale: Optional[Tensor] = None,
    verdict: Optional[Tensor] = None,
    restore: Optional[MomentumRestore] = None,
    checked: bool = False,
) -> bool:
    """In place, as post_update_reference, in one launch (see fused_update_supported). verdict ([N]
    bool, the guard's): matrices with False only decay. restore (needs verdict): their momentum is
    put back in the same launch too, where its layout allows (_restore_layout). Returns whether
    it was (if not, the caller restores it). checked: the caller has asked fused_update_supported
    already (the dispatch does, on every bucket of every step: not twice)."""
    if not checked and not fused_update_supported(params, update, row_scale):
        raise ValueError(
            "post_update_triton needs same-dtype, same-shape params with contiguous matrices "
            "and float32 row_scale on update's device"
        )
    if restore is not None and verdict is None:
        raise ValueError("post_update_triton: restore needs the guard's verdict")
    _, R, C = params[0].shape
    total = sum(p.shape[0] for p in params)
    k = R if rows is None else rows.shape[1]
    if update.shape != (total, k, C):
        raise ValueError(f"update must have shape {(total, k, C)}, got {tuple(update.shape)}")
    # [N·k] factors in update's row order, read flat; placeholder if None
    if row_scale is None:
        scale = update
    elif row_scale.is_contiguous() and tuple(row_scale.shape) in ((total, k), (total, k, 1)):
        scale = row_scale  # no view to dispatch
    else:
        scale = row_scale_column(row_scale, update).reshape(-1).contiguous()
    if total == 0 or R == 0 or C == 0:
        return True  # nothing to update, nothing to restore
    position = update  # placeholder pointer when rows is None
    if rows is not None:
        if rows.shape != (total, k):
            raise ValueError(f"rows must have shape {(total, k)}, got {tuple(rows.shape)}")
        position = selection_positions(rows, R)
    layout = _restore_layout(restore, total, R, C) if restore is not None else None
    if verdict is not None:  # read flat, one byte per matrix (contiguous already: no copy then)
        verdict = verdict.reshape(-1).contiguous()
        if verdict.shape[0] != total:
            raise ValueError(f"verdict must have one entry per matrix ({total}), got {verdict.shape[0]}")
    verdict_arg = update if verdict is None else (verdict.view(torch.int8) if verdict.dtype == torch.bool else verdict)
    if layout is None:
        momentum = grad = table = fed = restore_positions = update  # placeholder pointers
        batch, momentum_decay, mu, unselected = 1, 1.0, 1.0, 1.0
    else:
        grad, table, batch = layout
        momentum, momentum_decay, mu = restore.momentum, float(restore.decay), float(restore.mu)
        unselected = float(restore.unselected)
        table = grad if table is None else table
        restore_positions, fed = restore.selected()
        has_fed = fed is not None and restore_positions is not None
        fed = fed.reshape(-1) if has_fed else update
        restore_positions = restore_positions if has_fed else update
    decay_is_pointer = isinstance(decay, Tensor)
    step_is_pointer = isinstance(step, Tensor)
    grid = (triton.cdiv(R, BLOCK_ROWS), total, triton.cdiv(C, BLOCK_COLS))
    _post_update_kernel[grid](
        _pointer_table(params, update.device), params[0], update, position, scale,
        decay if decay_is_pointer else float(decay), step if step_is_pointer else float(step),
        verdict_arg, momentum, grad, table, fed, restore_positions, mu, unselected, momentum_decay, batch,
        R, C, k, update.stride(0), update.stride(1),
        HAS_ROWS=rows is not None, HAS_SCALE=row_scale is not None, HAS_VERDICT=verdict is not None,
        RESTORE=layout is not None, HAS_FED=layout is not None and has_fed, GRAD_TABLE=layout is not None and table is not grad,
        DECAY_IS_POINTER=decay_is_pointer, STEP_IS_POINTER=step_is_pointer,
        BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=NUM_WARPS,
    )
    return restore is None or layout is not None
