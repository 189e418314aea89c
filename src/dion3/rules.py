"""Pure update-rule math on stacked [N, rows, cols] tensors (DESIGN §2).

One rule serves Muon, NorMuon and Dion3; they differ only in its parameters:

    Muon      fraction=None, normalize=False   (nesterov optional)
    NorMuon   fraction=None, normalize=True    (nesterov optional)
    Dion3     fraction=f,    normalize=True    (row selection with error feedback)

The step is split where the distributed layer exchanges data:
    pre_step (momentum, selection, snapshot)  →  orthogonalize  →  normalize_rows  →  apply_update
On a single device row_normalization_in_place replaces normalize_rows (row_normalization, or
one kernel on CUDA that also reads and writes the rows' variance): apply_update takes its per-row
factors, so the normalized copy of O is never written.

Bad updates are skipped per matrix, on the device and without a host sync: a matrix whose O is
not finite, or larger than any orthogonalization can be (‖O‖_F above update_bound·√min(k, C):
Newton–Schulz keeps every singular value inside its schedule's band, so a larger O is a
corrupted computation, not an update), keeps its variance, is not moved by apply_update (its
weight decay still applies) and is noted in the `skipped` tally that apply_update is given.
The bound is checked where whole matrices are (one device, or a distributed owner); a rank that
holds only some rows of a matrix sees the owner's verdict as NaN rows. A non-finite gradient entry
reaches the verdict through the momentum pass, whose rows measure NaN there (kernels.accumulate_momentum);
check_finite=True in the optimizer raises on such gradients instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .kernels import (
    MomentumRestore, accumulate_momentum, fused_row_normalization, host_checks_free, momentum_pass_measures, post_update,
    scale_cast, select_rows, selection_norm, snapshot_rows,
)
from .kernels import top_rows as _top_rows
from .ortho.coefficients import CoefficientSpec, get_schedule
from .ortho.newton_schulz import InputScaling, _resolve, input_scaling, orthogonalize_padded
from .ortho.padding import Padded, empty_padded, marked_matrices, padded_buffer_of

Grads = Union[Tensor, Sequence[Tensor]]
ADJUST_LR = ("spectral_norm", "spectral_norm_transposed", "rms_norm", None)
# Headroom over the schedule's band for rounding (half-precision outputs stay within 1.03 of
# √min(k, C) on the study's runs: benchmarks/results/nonfinite-h200-2026-12-02.md).
BOUND_MARGIN = 1.25


def update_bound(coefficients: CoefficientSpec) -> float:
    """The largest ‖O‖_F / √min(rows, cols) an orthogonalization with these Newton–Schulz
    coefficients can return: its band's upper end (every singular value lands in the band)
    times BOUND_MARGIN; inf for coefficients that state no band (custom lists)."""
    return get_schedule(coefficients).band[1] * BOUND_MARGIN


def matrices_within(norm: Tensor, ortho_shape, bound: float) -> Tensor:
    """[N] bool from the Frobenius norms (N of them, any shape) of O [N, k, C]: finite and at
    most bound·√min(k, C) (NaN and inf fail)."""
    norm = norm.reshape(-1)
    if bound == math.inf:  # (not bound·√0 = NaN for a matrix with no rows here)
        return torch.isfinite(norm)
    # one launch: NaN and inf compare false against a finite limit (launches are host time)
    return norm <= bound * math.sqrt(min(ortho_shape[-2:]))


# Dion3's selection score: each momentum row's L1 norm (the rule), or its L2 norm (ranked by the
# squared norm the momentum pass measures anyway: the same order)
ROW_SCORES = ("l1", "l2")


@dataclass(frozen=True)
class RuleConfig:
    fraction: Optional[float]  # None: every row (Muon/NorMuon); else Dion3's row fraction
    mu: float
    nesterov: bool = False
    normalize: bool = False  # NorMuon per-row normalization
    beta2: float = 0.95
    epsilon: float = 1e-8
    row_score: str = "l1"  # ROW_SCORES
    unselected_decay: float = 1.0  # Dion3: M[~S] ← this·M[~S] after the selection (matrix_step; 1: the rule)


def selected_row_count(rows: int, fraction: float) -> int:
    """k = max(1, ⌈f·rows⌉), guarding against float fuzz such as 0.3·10 = 3.0000000000000004."""
    return max(1, math.ceil(round(fraction * rows, 9)))


def lr_scale(adjust_lr: Optional[str], rows: int, cols: int) -> float:
    """Learning-rate multiplier from the full matrix shape (never the selected submatrix);
    "spectral_norm_transposed" is the spectral scale of a map stored [in, out] (Conv1D, x @ W)."""
    if adjust_lr == "spectral_norm":
        return math.sqrt(rows / cols)
    if adjust_lr == "spectral_norm_transposed":
        return math.sqrt(cols / rows)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"unknown adjust_lr {adjust_lr!r}; expected one of {ADJUST_LR}")


def _stacked(grads: Grads) -> Tensor:
    return grads if isinstance(grads, Tensor) else torch.cat(list(grads))


def row_scores(momentum: Tensor) -> Tensor:
    """L1 norm of each row, in float32 or wider (float64 momentum keeps float64): [N, R]."""
    dtype = torch.promote_types(momentum.dtype, torch.float32)
    return torch.linalg.vector_norm(momentum, ord=1, dim=-1, dtype=dtype)


def top_rows(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest scores per matrix, ascending: [N, k] int64. Among equal scores
    the lower rows win, on every device and layout (kernels.top_rows)."""
    return _top_rows(scores, k)


def gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    return x.gather(-2, rows.unsqueeze(-1).expand(*rows.shape, x.shape[-1]))


def scatter_rows(x: Tensor, rows: Tensor, values: Tensor) -> None:
    x.scatter_(-2, rows.unsqueeze(-1).expand(*rows.shape, x.shape[-1]), values)


class PreStep(NamedTuple):
    update: Tensor  # U, or (normalized) U already scaled for Newton–Schulz in its compute dtype
    rows: Optional[Tensor]  # selected rows [N, k] (Dion3), None for every row
    norm: Optional[Tensor]  # ‖U‖_F per matrix [N, 1, 1] when measured on the way, else None
    normalized: bool = False  # update is orthogonalize's normalized input (normalized=True)


def pre_step(
    momentum: Tensor, grads: Grads, cfg: RuleConfig, rows: Optional[Tensor] = None, want_norm: bool = False,
    scaling: Optional[InputScaling] = None,
) -> PreStep:
    """Update momentum in place and return U with the selected rows (and what else is known).

    Muon/NorMuon: M ← μM + G; U = M (Nesterov: U = μM + G); rows = None.
    Dion3: M ← M + G; rows = top-k rows by L1 norm, or L2 with cfg.row_score "l2" (unless given,
           e.g. chosen globally); U = M[rows] (snapshot); M[rows] ← μ·M[rows] (the other rows'
           cfg.unselected_decay is the matrix step's, after any route's selection).
    want_norm: also return each matrix's Frobenius norm of U ([N, 1, 1], float32 or wider),
    summed from per-row squares that the momentum pass measures on the way (so Newton–Schulz
    need not read U again to normalize it); None for Nesterov, whose U that pass never sees.
    Dion3 off CUDA measures the snapshot U instead (k rows, not all of them), then scales it in place.
    scaling (Dion3 only, from ortho.input_scaling for the [N, k, C] selection): the snapshot
    writes U already normalized in Newton–Schulz's compute dtype (normalized=True), sparing
    the float32 copy of U and the pass that scales it.
    """
    if cfg.fraction is None:
        measure = want_norm and not cfg.nesterov
        _, squares = accumulate_momentum(momentum, grads, cfg.mu, scores=False, squares=measure)
        update = _stacked(grads).add(momentum, alpha=cfg.mu) if cfg.nesterov else momentum
        return PreStep(update, None, _frobenius(squares))
    measure = want_norm or scaling is not None
    # The fused CUDA momentum pass measures row squares for free; elsewhere that costs a pass
    # over all R rows, against one over the k rows of the snapshot: measure U there instead.
    on_the_way = momentum_pass_measures(momentum)
    by_l2 = rows is None and cfg.row_score == "l2"
    scores, squares = accumulate_momentum(momentum, grads, 1.0, scores=rows is None and not by_l2,
                                          squares=(measure and on_the_way) or by_l2)
    if by_l2:  # rows ranked by their squared L2 norm (NaN where a gradient entry was not finite, as L1's)
        scores = squares
    k = selected_row_count(momentum.shape[-2], cfg.fraction)
    if measure and on_the_way:
        # the selection (unless given), its norm and the snapshot's factor in one launch on CUDA
        scale_args = (scaling.norm_scale, scaling.eps) if scaling else ()
        if rows is None:
            rows, norm, factor = select_rows(scores, squares, k, *scale_args)
        else:
            norm, factor = selection_norm(squares, rows, *scale_args)
        if scaling is None:
            return PreStep(snapshot_rows(momentum, rows, cfg.mu), rows, norm)
        return PreStep(_scaled_snapshot(momentum, rows, cfg.mu, factor, scaling.dtype), rows, norm, True)
    if rows is None:
        rows = top_rows(scores, k)
    if not measure:
        return PreStep(snapshot_rows(momentum, rows, cfg.mu), rows, None)
    if scaling is None:
        update = snapshot_rows(momentum, rows, cfg.mu)
        # the same row-wise sums as the momentum pass would give: no rounding difference
        squares = torch.linalg.vector_norm(update, dim=-1, dtype=torch.promote_types(update.dtype, torch.float32))
        return PreStep(update, rows, _frobenius(squares.square()))
    # (scores are non-negative: their sum is finite iff each is, unless it overflows, which then
    # only takes the path below)
    if host_checks_free(momentum.device) and (scores is None or math.isfinite(scores.sum().item())):
        # No row measured NaN (asked of the host where that is free): snapshot, its norm, then
        # the scaled copy; the arithmetic of the path below, without its gather of the rows.
        update = snapshot_rows(momentum, rows, cfg.mu)
        squares = torch.linalg.vector_norm(update, dim=-1, dtype=torch.promote_types(update.dtype, torch.float32))
        norm = _frobenius(squares.square())
        out = empty_padded(*update.shape, scaling.dtype, momentum.device)
        torch.mul(update, scaling.factor(norm), out=out.matrices)  # U·factor in NS's dtype (the snapshot's product)
        return PreStep(marked_matrices(out), rows, norm, True)
    # Elsewhere: the selected rows' norm before the snapshot, so that its factor can tell the
    # snapshot which matrices the guard will skip (a row whose gradient was not finite measures
    # NaN, reference.accumulate_momentum_reference): they get no error feedback.
    squares = torch.linalg.vector_norm(momentum.gather(-2, rows.unsqueeze(-1).expand(*rows.shape, momentum.shape[-1])),
                                       dim=-1, dtype=torch.promote_types(momentum.dtype, torch.float32)).square()
    squares = torch.where(scores.gather(-1, rows).isnan(), math.nan, squares) if scores is not None else squares
    norm = _frobenius(squares)
    return PreStep(_scaled_snapshot(momentum, rows, cfg.mu, scaling.factor(norm), scaling.dtype), rows, norm, True)


def _scaled_snapshot(momentum: Tensor, rows: Tensor, mu: float, factor: Tensor, dtype: torch.dtype) -> Tensor:
    """The snapshot U·factor written in dtype straight into a zero-padded buffer for
    Newton–Schulz (ortho.padding: no copy of U when the selected row count is not aligned);
    returns its matrices, marked so that orthogonalize_rows finds the buffer."""
    count, k, cols = momentum.shape[0], rows.shape[-1], momentum.shape[-1]
    update = empty_padded(count, k, cols, dtype, momentum.device)
    snapshot_rows(momentum, rows, mu, factor, dtype, out=update.matrices)
    return marked_matrices(update)


def snapshot_scaling(momentum: Tensor, cfg: RuleConfig, group: dict) -> Optional[InputScaling]:
    """pre_step's scaling for a Dion3 bucket, so that its snapshot writes Newton–Schulz's
    normalized input; None for Muon/NorMuon (their U is the momentum itself, no copy to fuse
    into). group supplies the orthogonalizer and ns_coefficients."""
    if cfg.fraction is None:
        return None
    rows, cols = momentum.shape[-2:]
    return input_scaling(selected_row_count(rows, cfg.fraction), cols, momentum.device,
                         group["orthogonalizer"], group["ns_coefficients"], momentum.dtype)


def _frobenius(row_squares: Optional[Tensor]) -> Optional[Tensor]:
    """[N, R] squared row norms → [N, 1, 1] Frobenius norms (None stays None)."""
    return None if row_squares is None else row_squares.sum(dim=-1).sqrt().view(-1, 1, 1)


def orthogonalize_rows(
    update, method: str, coefficients, norm: Optional[Tensor] = None, normalized: bool = False
) -> Tensor:
    """O = Orth(U) [N, k, C] for U (a Tensor, or the padded buffer pre_step's scaled snapshot
    wrote), left in the orthogonalizer's compute dtype (half on GPU): the normalization and the
    fused update read it directly, with no float32 copy of O. Where the shape is not aligned
    for the kernels, O is a view of the zero-padded buffer Newton–Schulz ran in (ortho.padding),
    with unit column stride. norm: ‖U‖_F per matrix when already known (pre_step's
    want_norm), else measured here; normalized: update is already Newton–Schulz's normalized
    input (pre_step with scaling)."""
    if not isinstance(update, Padded):
        update = padded_buffer_of(update) or update
    data = update.data if isinstance(update, Padded) else update
    rows, cols = (update.rows, update.cols) if isinstance(update, Padded) else update.shape[-2:]
    method = _resolve(rows, cols, data.device, method, data.dtype)
    return orthogonalize_padded(update, method, coefficients, norm=norm, normalized=normalized).matrices


def row_normalization(ortho: Tensor, variance: Tensor, beta2: float, epsilon: float,
                      bound: float = math.inf) -> tuple[Tensor, Tensor]:
    """NorMuon normalization (fp32) of O [N, k, C] with its rows' second moments V [N, k, 1],
    as per-row factors s [N, k, 1] with Ô = s·O:

    n_i = mean_j O_ij²; V ← β₂V + (1−β₂)n; Ô = O / (√V + ε); Ô ← Ô·‖O‖_F / max(‖Ô‖_F, ε).
    Returns (s in float32 or wider, new V in V's dtype) without touching the inputs; O is read
    once (for its row norms). apply_update takes s directly, so Ô is never materialized.
    A matrix whose O is not finite or above the bound (update_bound) gets NaN factors.
    """
    math_dtype = torch.promote_types(ortho.dtype, torch.float32)  # half inputs: no float copy
    row_sq = torch.linalg.vector_norm(ortho, dim=-1, keepdim=True, dtype=math_dtype).square()  # [N, k, 1]
    new_variance = torch.lerp(variance.to(math_dtype), row_sq / ortho.shape[-1], 1.0 - beta2)
    inverse_rms = 1.0 / (new_variance.sqrt() + epsilon)
    frob = row_sq.sum(dim=-2, keepdim=True).sqrt()  # ‖O‖_F, [N, 1, 1]
    scaled_frob = (row_sq * inverse_rms.square()).sum(dim=-2, keepdim=True).sqrt()  # ‖Ô‖_F before rescale
    row_scale = inverse_rms * (frob / scaled_frob.clamp_min(epsilon))
    if bound != math.inf:
        row_scale = torch.where(matrices_within(frob, ortho.shape, bound).view(-1, 1, 1), row_scale, math.nan)
    return row_scale, new_variance.to(variance.dtype)


def finite_matrices(row_scale: Tensor) -> Tensor:
    """[N] bool: every per-row factor of matrix i is finite. A non-finite entry of O makes every
    factor of its matrix NaN (‖O‖_F is not finite), and so does an O above the bound
    (row_normalization), so this is O's verdict too."""
    return torch.isfinite(row_scale.flatten(1)).all(dim=1)


def row_normalization_in_place(
    ortho: Tensor, variance: Tensor, rows: Optional[Tensor], beta2: float, epsilon: float, bound: float = math.inf
) -> tuple[Tensor, Tensor]:
    """row_normalization of O [N, k, C] against the rows `rows` [N, k] (None: every row) of a
    bucket's second moments V [N, R, 1], writing their new values into V: (the factors s, the
    guard's verdict [N] bool). A matrix whose O is not finite or above the bound keeps its old V
    and gets NaN factors (apply_update then skips it). On CUDA s is [N, k] float32 from the fused
    kernel, which takes O's row norms and does the rest, the verdict included, in one launch;
    else [N, k, 1] as row_normalization gives them."""
    if ortho.shape[0] and ortho.shape[1]:
        limit = bound * math.sqrt(min(ortho.shape[-2:])) if bound != math.inf else math.inf
        fused = fused_row_normalization(ortho, variance, rows, beta2, epsilon, limit)
        if fused is not None:
            return fused
    old = variance.clone() if rows is None else gather_rows(variance, rows)  # [N, R or k, 1]: small
    row_scale, new = row_normalization(ortho, old, beta2, epsilon, bound)
    ok = finite_matrices(row_scale)
    kept = torch.where(ok.view(-1, 1, 1), new, old)
    if rows is None:
        variance.copy_(kept)
    else:
        scatter_rows(variance, rows, kept)
    return row_scale, ok


def normalize_rows(ortho: Tensor, variance: Tensor, beta2: float, epsilon: float,
                   bound: float = math.inf) -> tuple[Tensor, Tensor]:
    """row_normalization applied: (Ô in O's dtype, new V in V's dtype), for callers that need
    the scaled rows themselves (the distributed step sends them between ranks). A matrix whose
    O is not finite keeps its old V and gets Ô entirely NaN, so that every rank holding some of
    its rows skips them (apply_update), not only the ranks that hold the bad rows. So does a
    matrix whose O is above the bound (update_bound: only the owner of the whole matrix can tell)."""
    row_scale, new_variance = row_normalization(ortho, variance, beta2, epsilon, bound)
    new_variance = torch.where(finite_matrices(row_scale).view(-1, 1, 1), new_variance, variance)
    # fp32 math, written straight into O's dtype (no float32 temporary for half O)
    return scale_cast(ortho, row_scale, ortho.dtype), new_variance


def poison_nonfinite(ortho: Tensor, bound: float = math.inf) -> Tensor:
    """O [N, k, C] with every entry of a matrix that has a non-finite one, or whose norm is above
    the bound (update_bound), set to NaN (in place): Muon's owner does this before it sends O's
    rows out, for the reason normalize_rows gives."""
    ok = matrices_within(frobenius_norms(ortho), ortho.shape, bound)
    return ortho.mul_(torch.where(ok, 1.0, math.nan).to(ortho.dtype).view(-1, 1, 1))


def frobenius_norms(x: Tensor) -> Tensor:
    """[N] Frobenius norms of x [N, k, C], accumulated in float32 or wider (NaN/inf where an entry is)."""
    return torch.linalg.vector_norm(x, dim=(-2, -1), dtype=torch.promote_types(x.dtype, torch.float32))


def update_verdict(update: Tensor, row_scale: Optional[Tensor], bound: float = math.inf) -> Tensor:
    """[N] bool: matrix good. With per-row factors, their finiteness (row_normalization makes
    every factor of a bad matrix NaN); without (Muon), update is O itself, finite and within
    the bound where bound is given. The post-update only decays the others (kernels.post_update)."""
    if row_scale is None:
        return matrices_within(frobenius_norms(update), update.shape, bound)
    return finite_matrices(row_scale)


def guard(ortho: Tensor, variance: Optional[Tensor], rows: Optional[Tensor], cfg: RuleConfig,
          bound: float) -> tuple[Optional[Tensor], Tensor]:
    """The normalize-and-guard stage on whole matrices O [N, k, C]: (per-row factors or None,
    [N] bool: matrix good). NorMuon/Dion3 (cfg.normalize): row_normalization_in_place against
    the variance buffer at `rows`, whose new values are written for the good matrices only;
    Muon/Dion2: good means finite and within the bound."""
    if cfg.normalize:
        return row_normalization_in_place(ortho, variance, rows, cfg.beta2, cfg.epsilon, bound)
    return None, update_verdict(ortho, None, bound)


def apply_update(
    params: Sequence[Tensor],
    update: Tensor,
    rows: Optional[Tensor],
    lr: Union[float, Tensor],
    weight_decay: float,
    scale: float,
    row_scale: Optional[Tensor] = None,
    skipped=None,
    bound: float = math.inf,
    ok: Optional[Tensor] = None,
    restore: Optional[MomentumRestore] = None,
) -> None:
    """X ← (1 − lr·λ)·X everywhere, then X[rows] ← X[rows] − lr·scale·update, rounded once.

    params: [B_i, R, C] views whose batches concatenate to update's N. row_scale [N, k, 1]
    (from row_normalization) multiplies each row of update inside the same pass.
    A matrix whose update (or row_scale) is not finite is only decayed (update_verdict), and
    noted in `skipped` (the device's buckets.SkipTally, which counts at the end of the step); so is
    one above `bound` (update_bound) when update is whole matrices of O (Muon on one device).
    ok ([N] bool, the guard's verdict when already known) skips only those matrices instead.
    restore (momentum_restore's): the skipped matrices' momentum goes back too, in the same
    launch where kernels.post_update can (the guard's last stage).
    """
    if isinstance(lr, Tensor) and lr.device != update.device:  # e.g. a CPU lr tensor, CUDA params
        lr = lr.to(update.device)
    if isinstance(weight_decay, Tensor) and weight_decay.device != update.device:
        weight_decay = weight_decay.to(update.device)
    decay = 1.0 - lr * weight_decay
    step = lr * scale
    if ok is None:
        ok = update_verdict(update, row_scale, bound)
    if skipped is not None:
        skipped.add(ok)
    post_update(params, update, rows, decay, step, row_scale, verdict=ok, restore=restore)


def decay_of(cfg: RuleConfig) -> float:
    """The factor the momentum pass applies to the momentum before adding the gradient."""
    return 1.0 if cfg.fraction is not None else cfg.mu


def momentum_restore(momentum: Tensor, grads: Grads, cfg: RuleConfig,
                     selection: Optional[Callable[[], tuple]] = None) -> MomentumRestore:
    """What the guard's last stage needs to put the momentum of every matrix it skipped back to
    what it was before the step (apply_update's restore, kernels.post_update): Dion3's error
    feedback (μ on the selected rows, unselected_decay on the others) undone where its snapshot
    applied it (selection, the route's: () → (positions [N, R] ≥ 0, the selection's inverse; norm
    [N], finite where the snapshot fed back), asked only where a restoration may run), then the
    step's accumulation. Matrices that stepped are left alone; no host sync."""
    selecting = cfg.fraction is not None
    return MomentumRestore(momentum, grads, decay_of(cfg), cfg.mu if selecting else 1.0,
                           selection if selecting else None, cfg.unselected_decay if selecting else 1.0)
