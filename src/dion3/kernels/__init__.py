"""Kernel dispatch: Triton kernels on CUDA when available and worth it, PyTorch otherwise.

Symmetric products go to the Triton kernel when the tensors are on a CUDA device, Triton
imports, the dtype is fp16/bf16 and the output is at least SYMMETRIC_MIN_N wide (below that,
a launch of half-empty tiles gains nothing over cuBLAS; measured on H200, see docs/kernels.md).
The fused post-update runs whenever its inputs are on CUDA and it supports them (one launch
replaces several per parameter). DION3_KERNELS=0 in the environment, or
set_kernels_enabled(False), routes everything to the PyTorch reference (cuBLAS) path.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

from .reference import (
    MomentumRestore,
    accumulate_momentum_reference,
    finite_on_host,
    host_checks_free,
    post_update_reference,
    restore_momentum_reference,
    selection_positions_reference,
    scale_cast_reference,
    selection_norm_reference,
    snapshot_rows_reference,
    symmetric_matmul_reference,
    top_rows_reference,
    verdict_factors,
)
from .configs import uses_long_reduction_config
from .split import split_symmetric_matmul

try:  # Triton is optional: CPU-only and non-Linux installs use the reference path.
    from . import post_update as _post_update_kernel
    from . import symmetric_matmul as _symmetric_kernel
    from . import symmetric_matmul_hopper as _hopper_kernel
except ImportError:  # pragma: no cover - depends on the install
    _post_update_kernel = _symmetric_kernel = _hopper_kernel = None
try:
    from . import transpose as _transpose_kernel
except ImportError:  # pragma: no cover - depends on the install
    _transpose_kernel = None
try:
    from . import momentum as _momentum_kernel
    from . import scale as _scale_kernel
    from . import normalization as _normalization_kernel
    from . import selection as _selection_kernel
except ImportError:  # pragma: no cover - depends on the install
    _momentum_kernel = _scale_kernel = _normalization_kernel = _selection_kernel = None

SYMMETRIC_MIN_N = 1024
# Split products (kernels/split.py) for C-free products (X·Xᵀ) from this n up, when their
# diagonal launch fills the GPU SPLIT_MIN_WAVES times over. H200 sweep at commit 7d878cf
# (benchmarks/results/kernels-h200-2026-11-29.md): 8192² 1.80× cuBLAS split vs 1.61× whole,
# 32×4096×14336 1.78× vs 1.58×, 16×2048×8192 1.56× vs 1.49×; but 4096×16384 (2 waves) 1.57×
# vs 1.68×, and products with a C term lose (cuBLAS's fused C epilogue runs at ~550–600 TFLOP/s:
# 0.9·R·R − 1.7·R at 64×4096 1.78× split vs 1.88× whole).
SPLIT_MIN_N = 2048
SPLIT_MIN_WAVES = 6
_enabled = os.environ.get("DION3_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")


def set_kernels_enabled(flag: bool) -> None:
    """Turn the Triton kernels on or off for this process (off: the PyTorch/cuBLAS path)."""
    global _enabled
    _enabled = bool(flag)


def kernels_enabled() -> bool:
    """Whether Triton kernels may be used (they still need CUDA and Triton)."""
    return _enabled


def _triton_ready(device) -> bool:
    # asked several times per bucket: a torch.device is read as is (building one costs host time)
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _enabled and _symmetric_kernel is not None and kind == "cuda"


@lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    # asked for every product and launch: torch's query costs ~10 µs of host time each
    return torch.cuda.get_device_capability(device)


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _half_dot_ready(device) -> bool:
    # bf16 tensor-core dots need sm80+; older GPUs keep cuBLAS.
    return _triton_ready(device) and _capability(torch.device(device))[0] >= 8


def symmetric_kernels_available(device, n: int | None = None) -> bool:
    """Whether symmetric products on this device (with n×n outputs, when n is given) run on
    a kernel that skips the upper triangle."""
    return _half_dot_ready(device) and (n is None or n >= SYMMETRIC_MIN_N)


# Measured speed of the symmetric kernel over a dense cuBLAS product of the same shape, on the
# optimizer's sizes (H200, benchmarks/results/kernels-h200-*.md, commit 3f8ebe1: 1.4–1.7×,
# ~1.6× at n ≥ 2048). It sets where Gram NS starts to beat standard NS (ortho.choose_method).
SYMMETRIC_SPEEDUP = 1.6


def symmetric_speedup(device, n: int | None = None) -> float:
    """Expected speedup of symmetric products (n×n outputs) on this device: 1 without the kernel."""
    return SYMMETRIC_SPEEDUP if symmetric_kernels_available(device, n) else 1.0


def _symmetric_worth_it(a) -> bool:
    return (
        _half_dot_ready(a.device)
        and a.dtype in _symmetric_kernel.SUPPORTED_DTYPES
        and a.dim() in (2, 3)
        and a.shape[-2] >= SYMMETRIC_MIN_N
    )


def split_worth_it(a, has_c: bool, b=None) -> bool:
    """Whether symmetric_matmul splits this product (kernels/split.py); a is [B, n, k] or [n, k]
    on CUDA, b its partner ([B, k, n]; None: a.mT)."""
    n = a.shape[-2]
    if has_c or _transpose_kernel is None or n < SPLIT_MIN_N or n % 256:  # halves: whole 128-row tiles
        return False
    a3 = a if a.dim() == 3 else a.unsqueeze(0)
    b3 = a3.mT if b is None else (b if b.dim() == 3 else b.unsqueeze(0))
    # Where the Hopper kernel takes the whole product, keep one launch: H200 sweeps found no
    # consistent winner between it and the split (kernels-h200-2026-11-29.md, "Split products").
    if _hopper_kernel is not None and _hopper_kernel.hopper_kernel_fits(a3, b3, None, None, n):
        return False
    major = _capability(a.device)[0]
    if uses_long_reduction_config(n, a.shape[-1], has_c, major):  # the whole 4-stage product wins
        return False
    batch = a.shape[0] if a.dim() == 3 else 1
    tiles = 2 * batch * _symmetric_kernel.lower_tile_count(n // 2, 128, 128)
    return tiles >= SPLIT_MIN_WAVES * _multiprocessors(a.device)


def symmetric_matmul(a, b, c=None, alpha: float = 1.0, beta: float = 0.0, split: bool | None = None,
                     b_symmetric: bool = False):
    """D = alpha·a·b + beta·c where the caller promises D is symmetric.

    split: force (True) or forbid (False) the split product on the kernel path; None decides
    from the shape. b_symmetric: the caller also promises b is symmetric (an output of these
    kernels, which mirror their tiles, so bᵀ holds the same values): the Hopper kernel may then
    read it as bᵀ, along K like A, where that is faster (hopper_tiling.SYMMETRIC_B_ALONG_K);
    the reference path keeps b as given, so CPU results do not depend on the flag.
    """
    if not (_symmetric_worth_it(a) and b.dtype == a.dtype):
        return symmetric_matmul_reference(a, b, c, alpha, beta)
    if split is None:
        split = split_worth_it(a, c is not None and beta != 0.0, b)
    if not split:
        return _symmetric_kernel.symmetric_matmul_triton(a, b, c, alpha, beta, b_symmetric=b_symmetric)
    squeeze = a.dim() == 2
    a3, b3 = (a.unsqueeze(0), b.unsqueeze(0)) if squeeze else (a, b)
    c3 = c.unsqueeze(0) if squeeze and c is not None else c
    out = split_symmetric_matmul(a3, b3, c3, alpha, beta, _symmetric_kernel.diagonal_blocks_triton(),
                                 _transpose_kernel.transpose_into_triton)
    return out[0] if squeeze else out


def gram_with_copy(x):
    """(X·Xᵀ, a copy of X or None) for x [B, n, k] or [n, k]. Where the Hopper kernel computes
    the product, the programs that stream each block of X's rows also write them out, so a
    caller that needs a copy of X gets one without another pass over X (standard NS: cuBLAS
    adds a·X + P·X into the memory that holds a·X's X, so without a spare copy torch.baddbmm
    first copies X into its output); elsewhere the copy is None."""
    # No split check: where the Hopper kernel fits, split_worth_it declines anyway, and where it
    # does not, symmetric_matmul_hopper says so and symmetric_matmul decides.
    if _symmetric_worth_it(x) and _hopper_kernel is not None and x.is_contiguous():
        x3 = x if x.dim() == 3 else x.unsqueeze(0)
        out = torch.empty(x3.shape[0], x3.shape[1], x3.shape[1], dtype=x.dtype, device=x.device)
        copy = torch.empty_like(x3)
        if _hopper_kernel.symmetric_matmul_hopper(x3, x3.mT, None, 1.0, 0.0, out, copy_a=copy):
            return (out, copy) if x.dim() == 3 else (out[0], copy[0])
    return symmetric_matmul(x, x.mT), None


def post_update(params, update, rows, decay, step, row_scale=None, verdict=None, restore=None) -> None:
    """For each [B_i, R, C] param: param ← decay·param; param[rows] −= step·update (one rounding).
    row_scale ([N, k] or [N, k, 1], float32): a factor per row of update, so row i changes by
    step·row_scale[i]·update[i] without a scaled copy of update (NorMuon's normalization).
    verdict ([N] bool, the guard's): a matrix with False only decays. restore (a MomentumRestore,
    with verdict): then puts those matrices' momentum back (restore_momentum) — on CUDA inside the
    same launch where the layout allows, so that a step with nothing skipped launches nothing
    more for it."""
    if _triton_ready(update.device) and _post_update_kernel.fused_update_supported(params, update, row_scale):
        restored = _post_update_kernel.post_update_triton(params, update, rows, decay, step, row_scale, verdict, restore,
                                                          checked=True)
    else:
        if verdict is not None and host_checks_free(verdict.device) and bool(verdict.all()):
            verdict = restore = None  # nothing skipped (one look on the host): no factors, nothing to put back
        post_update_reference(params, update, rows, decay, step, verdict_factors(update, row_scale, verdict))
        restored = restore is None
    if not restored:
        positions, fed = restore.selected()
        restore_momentum(restore.momentum, restore.grads, verdict, restore.decay, restore.mu, fed, positions,
                         restore.unselected)


def accumulate_momentum(momentum, grads, decay: float, scores: bool, squares: bool = False):
    """momentum ← decay·momentum + grads; returns (each updated row's L1 norm if scores, its
    squared L2 norm if squares), [N, R] tensors or None (one fused pass on CUDA).
    grads: a stacked [N, R, C] tensor or per-parameter pieces."""
    pieces = [grads] if isinstance(grads, torch.Tensor) else grads
    if (
        _triton_ready(momentum.device)
        and _momentum_kernel is not None
        and _momentum_kernel.fused_accumulate_supported(momentum, pieces)
    ):
        return _momentum_kernel.accumulate_momentum_triton(momentum, pieces, decay, scores, squares)
    return accumulate_momentum_reference(momentum, grads, decay, scores, squares)


def restore_momentum(momentum, grads, keep, decay: float, mu: float = 1.0, fed=None, positions=None,
                     unselected: float = 1.0) -> None:
    """Put the momentum [N, R, C] of the matrices with keep[i] False back as it was before this
    step's accumulate_momentum (decay) and snapshot_rows (mu, on the selected rows, positions
    [N, R] ≥ 0, of the matrices whose norm fed[i] is finite; `unselected` on their other rows);
    see reference.restore_momentum_reference. No host sync: on CUDA one launch whose programs
    for kept matrices stop after reading their flag."""
    pieces = [grads] if isinstance(grads, torch.Tensor) else grads
    if (_triton_ready(momentum.device) and _momentum_kernel is not None
            and _momentum_kernel.fused_accumulate_supported(momentum, pieces)):
        return _momentum_kernel.restore_momentum_triton(momentum, pieces, keep, decay, mu, fed, positions, unselected)
    return restore_momentum_reference(momentum, grads, keep, decay, mu, fed, positions, unselected)


def selection_inverse(rows, height: int):
    """[N, height] int32: each selected row's slot in rows [N, k], −1 elsewhere (on CUDA the
    inverse the selection launch attached to rows, when it did)."""
    if _triton_ready(rows.device) and _selection_kernel is not None:
        return _selection_kernel.selection_positions(rows, height)
    return selection_positions_reference(rows, height)


def momentum_pass_measures(momentum) -> bool:
    """Whether accumulate_momentum runs the fused pass on this momentum buffer (gradients of its
    dtypes), which measures each row's squared norm at no extra cost; the PyTorch path needs
    another pass over every row for it."""
    return (_triton_ready(momentum.device) and _momentum_kernel is not None
            and _momentum_kernel.fused_accumulate_supported(momentum, []))


def selection_norm(squares, rows, norm_scale=None, eps: float = 0.0):
    """Each matrix's Frobenius norm over its selected rows, from squared row norms squares [N, R]
    (float32) and rows [N, k]; with norm_scale also 1/(norm_scale·norm + eps): (norm, factor or
    None), [N, 1, 1] float32. One launch on CUDA, which also builds the selection's inverse
    for the fused post-update of these rows (kernels/selection.py)."""
    if (_triton_ready(squares.device) and _selection_kernel is not None
            and _selection_kernel.selection_norm_supported(squares, rows)):
        return _selection_kernel.selection_norm_triton(squares, rows, norm_scale, eps, positions=True)
    return selection_norm_reference(squares, rows, norm_scale, eps)


def _selecting_kernel_ready(scores, k, squares=None) -> bool:
    return (_triton_ready(scores.device) and _selection_kernel is not None
            and _selection_kernel.top_rows_supported(scores, k, squares))


def top_rows(scores, k: int):
    """The k rows of each matrix with the largest scores [N, R], ascending [N, k] int64, ties to
    the lower row (one launch on CUDA for float32 scores; reference.top_rows_reference else)."""
    if _selecting_kernel_ready(scores, k):
        return _selection_kernel.top_rows_triton(scores, k)[0]
    return top_rows_reference(scores, k)


def select_rows(scores, squares, k: int, norm_scale=None, eps: float = 0.0):
    """top_rows and selection_norm of the rows it picks: (rows, norm, factor or None). One
    launch on CUDA, which also attaches the selection's inverse for the post-update."""
    if _selecting_kernel_ready(scores, k, squares):
        return _selection_kernel.top_rows_triton(scores, k, squares, norm_scale, eps)
    rows = top_rows_reference(scores, k)
    return (rows, *selection_norm(squares, rows, norm_scale, eps))


def fused_row_normalization(ortho, variance, rows, beta2: float, epsilon: float, limit: float = float("inf")):
    """(NorMuon's per-row factors [N, k] float32, the guard's verdict [N] bool) for O [N, k, C]:
    a matrix is good where ‖O‖_F is finite and at most `limit`; the variance buffer [N, R, 1] is
    updated in place at rows [N, k] (None: all rows) for the good matrices only, the others get
    NaN factors. O's row norms, then one launch for the rest. None where the kernel does not run
    (the caller then takes the PyTorch path, dion3.rules.row_normalization)."""
    if not (_triton_ready(ortho.device) and _normalization_kernel is not None
            and _normalization_kernel.row_normalization_supported(ortho, variance, rows)):
        return None
    norms = torch.linalg.vector_norm(ortho, dim=-1, dtype=torch.float32)
    return _normalization_kernel.row_normalization_triton(norms, variance, rows, beta2, epsilon, ortho.shape[-1], limit)


def snapshot_rows(momentum, rows, mu, scale=None, out_dtype=None, out=None):
    """Dion3's snapshot with error feedback: return U = momentum[rows] and scale those rows of
    momentum by mu (one pass over the selected rows on CUDA). rows: [N, k] int64.
    scale ([N, 1, 1] per matrix or [N, k, 1] per selected row) and out_dtype: return U·scale
    in out_dtype. A row whose factor is not finite (a matrix the guard skips) keeps its
    momentum: no error feedback where no update will be applied. out: write U there (an
    [N, k, C] view with unit column stride, e.g. the matrices of a padded buffer) and return it."""
    if (_triton_ready(momentum.device) and _momentum_kernel is not None
            and _momentum_kernel.fused_accumulate_supported(momentum, [])
            and (out_dtype is None or out_dtype in _momentum_kernel.SUPPORTED_DTYPES)):
        return _momentum_kernel.snapshot_rows_triton(momentum, rows, mu, scale, out_dtype, out)
    return snapshot_rows_reference(momentum, rows, mu, scale, out_dtype, out)


def _transposed_view(x) -> bool:
    """x is a [B, R, C] view of a contiguous [B, C, R] tensor (x.mT of it), with R, C > 1."""
    return x.dim() == 3 and x.shape[-1] > 1 and x.shape[-2] > 1 and not x.is_contiguous() and x.mT.is_contiguous()


def _tile_transpose_ready(x, out_dtype) -> bool:
    return (_triton_ready(x.device) and _transpose_kernel is not None and _transposed_view(x)
            and x.dtype in _transpose_kernel.SUPPORTED_DTYPES and out_dtype in _transpose_kernel.SUPPORTED_DTYPES)


def scale_cast(x, scale, out_dtype, out=None):
    """x · scale written contiguous in out_dtype (scale: [N, 1, 1] per matrix or [N, R, 1] per
    row), one pass on CUDA, also for a transposed view x (Newton–Schulz normalizing a tall input
    into the wide orientation). A new tensor, or out (an [N, R, C] view with unit column stride
    in out_dtype, e.g. the matrices of a padded buffer): the caller's x is never modified."""
    if _triton_ready(x.device) and _scale_kernel is not None and _scale_kernel.scale_cast_supported(x, scale, out_dtype, out):
        return _scale_kernel.scale_cast_triton(x, scale, out_dtype, out)
    if _tile_transpose_ready(x, out_dtype) and scale.shape == (x.shape[0], 1, 1):
        if out is None:
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        _transpose_kernel.transpose_into_triton(out, x.mT, scale)
        return out
    return scale_cast_reference(x, scale, out_dtype, out)


def copy_into(out, x) -> None:
    """out ← x for [B, R, C] tensors of any strides (x may be a transposed view, e.g. a tall
    matrix copied into a padded wide buffer), casting to out's dtype; tile-wise on CUDA for a
    transposed x, so both sides stay coalesced."""
    if _tile_transpose_ready(x, out.dtype):
        _transpose_kernel.transpose_into_triton(out, x.mT)
    else:
        out.copy_(x)


def contiguous_cast(x, out_dtype):
    """x as a contiguous tensor in out_dtype (x itself when it already is one). A transposed
    view (a tall Newton–Schulz result) is copied tile-wise on CUDA: both sides coalesced."""
    if x.dtype == out_dtype and x.is_contiguous():
        return x
    if _tile_transpose_ready(x, out_dtype):
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        _transpose_kernel.transpose_into_triton(out, x.mT)
        return out
    return x.to(out_dtype).contiguous()


__all__ = [
    "MomentumRestore",
    "accumulate_momentum",
    "contiguous_cast",
    "copy_into",
    "fused_row_normalization",
    "finite_on_host",
    "gram_with_copy",
    "host_checks_free",
    "scale_cast",
    "select_rows",
    "selection_norm",
    "snapshot_rows",
    "symmetric_matmul",
    "post_update",
    "restore_momentum",
    "selection_inverse",
    "symmetric_kernels_available",
    "top_rows",
    "symmetric_speedup",
    "set_kernels_enabled",
    "kernels_enabled",
    "momentum_pass_measures",
    "SYMMETRIC_MIN_N",
]
