"""Triton NorMuon row normalization from the row norms of O, one program per matrix: decides the
guard's verdict for its matrix (‖O‖_F finite and within the bound), reads the second moments of
its rows from the bucket's variance buffer (the selected rows for Dion3), writes their new values
back for a good matrix only and returns the per-row factors that the fused post-update applies,
in one launch where PyTorch needs gathers, about twenty elementwise ops and reductions over
[N, k] numbers, and a scatter. The pass over O itself (its row norms) stays a
PyTorch reduction, so the kernel reads only N·k numbers and its one-program-per-matrix grid
costs nothing at any size.

For each matrix, with n_i = ‖O_i‖² (float32):
    V_i ← lerp(V_i, n_i / C, 1 − β₂);  r_i = 1/(√V_i + ε)
    s_i = r_i · √(Σ n_i) / max(√(Σ n_i·r_i²), ε)
the formulas of dion3.rules.row_normalization, summed in another order (blocks of rows).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_SLOTS = 1024


@triton.jit
def _row_normalization_kernel(
    norms_ptr, variance_ptr, rows_ptr, scale_ptr, ok_ptr, weight, cols, eps, limit, R, k,
    HAS_ROWS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
):
    matrix = tl.program_id(0).to(tl.int64)
    # the guard's verdict first: ‖O‖_F from the row norms, finite and (HAS_LIMIT) within limit
    total = tl.zeros([BLOCK], dtype=tl.float32)
    # while loops, not range(0, k, BLOCK): Triton 3.6's interpreter cannot take a runtime bound
    # under NumPy 2.4 (momentum._accumulate_kernel says why); compiled, the same instructions
    start = 0 * k
    while start < k:
        slots = start + tl.arange(0, BLOCK)
        norm = tl.load(norms_ptr + matrix * k + slots, mask=slots < k, other=0.0)
        total += norm * norm
        start += BLOCK
    frobenius_sq = tl.sum(total, axis=0)
    good = frobenius_sq < float("inf")  # NaN compares false too
    if HAS_LIMIT:
        good = good & (tl.sqrt(frobenius_sq) <= limit)
    tl.store(ok_ptr + matrix, good.to(tl.int8))
    if good:
        scaled_total = tl.zeros([BLOCK], dtype=tl.float32)
        start = 0 * k
        while start < k:
            slots = start + tl.arange(0, BLOCK)
            inside = slots < k
            norm = tl.load(norms_ptr + matrix * k + slots, mask=inside, other=0.0)
            row_sq = norm * norm
            if HAS_ROWS:
                rows = tl.load(rows_ptr + matrix * k + slots, mask=inside, other=0)
            else:
                rows = slots
            old = tl.load(variance_ptr + matrix * R + rows, mask=inside, other=0.0)
            diff = row_sq / cols - old
            # torch.lerp's two forms, each exact at its end of the weight range
            new = tl.where(weight < 0.5, old + weight * diff, row_sq / cols - diff * (1.0 - weight))
            inverse_rms = 1.0 / (tl.sqrt(new) + eps)
            tl.store(variance_ptr + matrix * R + rows, new, mask=inside)
            tl.store(scale_ptr + matrix * k + slots, inverse_rms, mask=inside)
            scaled_total += row_sq * (inverse_rms * inverse_rms)
            start += BLOCK
        ratio = tl.sqrt(frobenius_sq) / tl.maximum(tl.sqrt(tl.sum(scaled_total, axis=0)), eps)
        tl.debug_barrier()  # the factors stored above, by whichever threads stored them
        start = 0 * k
        while start < k:
            slots = start + tl.arange(0, BLOCK)
            inside = slots < k
            inverse_rms = tl.load(scale_ptr + matrix * k + slots, mask=inside, other=0.0)
            tl.store(scale_ptr + matrix * k + slots, inverse_rms * ratio, mask=inside)
            start += BLOCK
    else:  # skipped: its rows keep their variance, its factors are NaN (rules.update_verdict)
        start = 0 * k
        while start < k:
            slots = start + tl.arange(0, BLOCK)
            tl.store(scale_ptr + matrix * k + slots, tl.full([BLOCK], float("nan"), tl.float32), mask=slots < k)
            start += BLOCK


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of O


def _state_fits(n: int, k: int, device, variance: Tensor, rows: Optional[Tensor]) -> bool:
    if variance.dim() != 3 or variance.shape[-1] != 1 or variance.shape[0] != n or variance.device != device:
        return False
    if variance.dtype != torch.float32 or not variance.is_contiguous():
        return False
    if rows is None:
        return variance.shape[1] == k
    return rows.shape == (n, k) and not rows.is_floating_point() and rows.is_contiguous() and rows.device == device


def row_normalization_supported(ortho: Tensor, variance: Tensor, rows: Optional[Tensor]) -> bool:
    """Whether the kernel serves O [N, k, C] (float32 or half) with a float32 contiguous
    variance [N, R, 1] and rows [N, k] (integer, contiguous) or None (k = R); the device is
    dion3.kernels' dispatch's to check."""
    return (ortho.dim() == 3 and ortho.dtype in SUPPORTED_DTYPES
            and _state_fits(ortho.shape[0], ortho.shape[1], ortho.device, variance, rows))


def row_normalization_triton(
    norms: Tensor, variance: Tensor, rows: Optional[Tensor], beta2: float, epsilon: float, cols: int,
    limit: float = math.inf,
) -> tuple[Tensor, Tensor]:
    """(Per-row factors s [N, k] float32, the guard's verdict [N] bool) from the float32 row
    norms [N, k] of O [N, k, cols]: a matrix is good where ‖O‖_F is finite and at most `limit`;
    a good matrix's variance [N, R, 1] is updated in place at rows [N, k] (None: every row,
    k = R), a skipped one keeps it and gets NaN factors."""
    if (norms.dim() != 2 or norms.dtype != torch.float32 or not norms.is_contiguous()
            or not _state_fits(norms.shape[0], norms.shape[1], norms.device, variance, rows)):
        raise ValueError(
            "row_normalization_triton needs float32 contiguous row norms [N, k], a float32 contiguous variance "
            f"[N, R, 1] and integer rows [N, k] or None, got norms {tuple(norms.shape)} {norms.dtype}, "
            f"variance {tuple(variance.shape)} {variance.dtype}")
    n, k = norms.shape
    scale = torch.empty((n, k), dtype=torch.float32, device=norms.device)
    ok = torch.ones(n, dtype=torch.int8, device=norms.device) if not k else torch.empty(n, dtype=torch.int8, device=norms.device)
    if n and k:
        _row_normalization_kernel[(n,)](
            norms, variance, norms if rows is None else rows, scale, ok, float(1.0 - beta2), float(cols), float(epsilon),
            float(limit) if limit != math.inf else 0.0, variance.shape[1], k,
            HAS_ROWS=rows is not None, HAS_LIMIT=limit != math.inf, BLOCK=BLOCK_SLOTS,
        )
    return scale, ok.view(torch.bool)
