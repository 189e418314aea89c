"""PyTorch reference paths for every kernel: used on CPU, for small shapes, and in tests."""
from __future__ import annotations

import itertools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor


def symmetric_matmul_reference(
    a: Tensor, b: Tensor, c: Optional[Tensor] = None, alpha: float = 1.0, beta: float = 0.0
) -> Tensor:
    """D = alpha·a·b + beta·c for batched [..., n, k] @ [..., k, n]; the result is symmetric
    by the caller's promise, so only the full product is computed here."""
    if c is None or beta == 0.0:
        # bmm for equal batches: the product torch.matmul runs, without its expand and reshape
        # dispatches (host time is most of a small product's cost)
        batched = a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0]
        out = torch.bmm(a, b) if batched else torch.matmul(a, b)
        return out if alpha == 1.0 else out.mul_(alpha)
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha) if a.dim() == 3 else torch.addmm(
        c, a, b, beta=beta, alpha=alpha
    )


# Off inside the tests' CPU stand-in for graph capture (tests/graph_standin.py), which runs the
# sync-free path a GPU takes.
HOST_CHECKS = True


def host_checks_free(device: torch.device) -> bool:
    """Whether reading a tensor's values on the host costs nothing (CPU tensors: no device to
    wait for, and no graph being captured). There the guard's masks and restorations run only
    for the matrices that need them; elsewhere they run sync-free on every step."""
    return HOST_CHECKS and device.type == "cpu"


def row_scale_column(row_scale: Optional[Tensor], update: Tensor) -> Optional[Tensor]:
    """row_scale ([N, k] or [N, k, 1]) as an [N, k, 1] column matching update [N, k, C]."""
    if row_scale is None:
        return None
    if tuple(row_scale.shape) not in (tuple(update.shape[:2]), tuple(update.shape[:2]) + (1,)):
        raise ValueError(
            f"row_scale must have shape {tuple(update.shape[:2])} or {tuple(update.shape[:2]) + (1,)} "
            f"(one factor per row of update), got {tuple(row_scale.shape)}"
        )
    if not row_scale.is_floating_point():
        raise ValueError(f"row_scale must be a floating-point tensor, got {row_scale.dtype}")
    return row_scale.reshape(*update.shape[:2], 1)


def post_update_reference(
    params: Sequence[Tensor],
    update: Tensor,
    rows: Optional[Tensor],
    decay: Union[Tensor, float],
    step: Union[Tensor, float],
    row_scale: Optional[Tensor] = None,
) -> None:
    """In place, for each param [B_i, R, C] and its slice of update [N, k, C] / rows [N, k]:
    param ← decay·param, then param[rows] ← param[rows] − step·update (k = R when rows is None).
    With row_scale ([N, k] or [N, k, 1], one factor per row of update) the change of row i is
    step·row_scale[i]·update[i] (NorMuon's normalization, without a scaled copy of update).
    Computed in float32 and rounded once to the param's dtype.

    One decay call for all params. Whole matrices (rows None) change by one add_ or addcmul_
    per param (the change rounded inside the param's rounding); selected rows take one product
    for the whole change, then index_add_ per matrix (several times faster on CPU than gather, sub and scatter, and
    the same arithmetic: decayed row + (−change), rounded once).
    """
    row_scale = row_scale_column(row_scale, update)
    # float64 params stay float64; half-precision params are updated in a float32 copy
    works = [p if p.dtype == torch.promote_types(p.dtype, torch.float32) else p.float() for p in params]
    compute = torch.promote_types(update.dtype, works[0].dtype) if works else update.dtype
    for dtype in {w.dtype for w in works}:
        group = [w for w in works if w.dtype == dtype]
        factor = decay.to(dtype) if isinstance(decay, Tensor) else decay
        torch._foreach_mul_(group, factor)
    coefficient = step if row_scale is None else row_scale.to(compute) * step
    zero = None if row_scale is None else row_scale == 0
    # a factor of 0 leaves the row, also where update is not finite (0·NaN): masked in a copy of the change
    masking = zero is not None and (not host_checks_free(update.device) or bool(zero.any()))
    sizes = [w.shape[0] for w in works]
    if rows is None:
        # param − coefficient·update per piece, computed in the param's dtype (float32 or wider) and
        # rounded once: no float32 change the size of update. Masked rows take 0·0 (exactly the
        # decayed row), the others the same arithmetic as in a step where nothing is masked; a
        # float step (add_ with alpha) and a tensor step (addcmul_, captured) round alike.
        source = update.masked_fill(zero, 0) if masking else update
        if masking:
            coefficient = coefficient.masked_fill(zero, 0)
        factors = [coefficient] * len(works) if row_scale is None else coefficient.split(sizes)
        for work, piece, factor in zip(works, source.split(sizes), factors):
            if isinstance(factor, Tensor):
                work.addcmul_(piece, factor, value=-1)
            else:
                work.add_(piece, alpha=-factor)
    else:
        if isinstance(coefficient, Tensor) and coefficient.dim() and coefficient.dtype == compute:
            change = torch.mul(update, coefficient)  # [N, k, C]: promoted in the product, no copy of update
        else:  # (a float or 0-d factor would not promote a half update)
            change = update.to(compute) * coefficient
        if masking:
            change.masked_fill_(zero, 0.0)  # in place: no second copy of the change
        # one index_add_ per matrix, on views made in bulk (Python indexing costs ~µs each)
        matrices = [m for w in works for m in w.unbind(0)]
        for matrix, selected, piece in zip(matrices, rows.unbind(0), change.unbind(0)):
            matrix.index_add_(0, selected, piece.to(matrix.dtype), alpha=-1)
    for work, param in zip(works, params):
        if work is not param:
            param.copy_(work)


def accumulate_momentum_reference(
    momentum: Tensor, grads: Union[Tensor, Sequence[Tensor]], decay: float, scores: bool, squares: bool = False
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """momentum [N, R, C] ← decay·momentum + grads, where grads is a stacked tensor or the
    per-parameter [B_i, R, C] pieces (added through views: no stacking copy). Returns the L1
    norm of each updated row if scores and its squared L2 norm if squares ([N, R], float32 or
    wider: float64 momentum keeps float64), else None in their places.
    An entry whose gradient is not finite keeps its momentum (no decay either), and its row
    measures NaN in both outputs: the guard then skips the matrix (dion3.rules) and the NaN row
    is selected first (top_rows_reference reads NaN as +inf). On the CPU a piece whose gradient
    is finite (asked of the host: free there) takes the plain arithmetic; the masked path, row
    blocks at a time, runs only for the pieces that need it (and always on other devices, which
    must not sync)."""
    pieces = [grads] if isinstance(grads, Tensor) else list(grads)
    targets = list(momentum.split([g.shape[0] for g in pieces]))
    plain = finite_on_host(pieces) if host_checks_free(momentum.device) else [False] * len(pieces)
    clean = [(t, g) for t, g, ok in zip(targets, pieces, plain) if ok]
    if clean:  # the masked path's arithmetic where every entry is finite, without its masks
        # decay·m, rounded, then + g (not one fused add: Dion3's pass has decay 1 and scales m
        # afterwards, and at fraction 1 it must equal NorMuon's μ·m + g to the last bit)
        if decay != 1.0:  # one mul_ each: the CPU's _foreach_mul_ rounds a Python factor to a half dtype first
            for target, _ in clean:
                target.mul_(decay)
        torch._foreach_add_([t for t, _ in clean], [g for _, g in clean])
    masked = [i for i, ok in enumerate(plain) if not ok]
    flagged = []  # per row block of the masked pieces, in matrix order: rows with a bad entry
    for _, _, target, grad in matrix_blocks([targets[i] for i in masked], [pieces[i] for i in masked]):
        finite = torch.isfinite(grad)
        flagged.append(finite.logical_not().any(dim=-1))
        if decay != 1.0:  # decay·m + g where g is finite, m itself elsewhere (the factor in float32
            # or wider, as the plain path's Python float: a half momentum is rounded once, not its factor too)
            factor = torch.full(target.shape, decay, dtype=torch.promote_types(target.dtype, torch.float32),
                                device=target.device)
            target.mul_(factor.masked_fill_(finite.logical_not(), 1.0))
        target.add_(grad.masked_fill(finite.logical_not(), 0))
    dtype = torch.promote_types(momentum.dtype, torch.float32)
    # abs + sum: ~2.5× faster on CPU than vector_norm(ord=1), whose reduction is not vectorized
    l1 = momentum.abs().sum(dim=-1, dtype=dtype) if scores else None
    l2_squared = torch.linalg.vector_norm(momentum, dim=-1, dtype=dtype).square() if squares else None
    if flagged:
        bad = torch.cat(flagged).view(-1, momentum.shape[1])  # the masked pieces' matrices
        if len(masked) < len(pieces):  # CPU only: place them among the others
            starts = [0] + list(itertools.accumulate(g.shape[0] for g in pieces))
            at = torch.tensor([m for i in masked for m in range(starts[i], starts[i + 1])], device=momentum.device)
            bad = torch.zeros(momentum.shape[:2], dtype=torch.bool, device=momentum.device).index_copy_(0, at, bad)
        for measured in (l1, l2_squared):
            if measured is not None:
                measured.masked_fill_(bad, math.nan)
    return l1, l2_squared


def finite_on_host(pieces: Sequence[Tensor]) -> list[bool]:
    """Whether each tensor's entries are all finite, with one host sync for all of them (CPU
    tensors: the sync is free). From each tensor's sum, the cheapest pass that meets every
    entry: not finite iff some entry is not, or the sum overflows (entries near float32's
    largest), which then only sends the piece down the masked path."""
    if not pieces:
        return []
    # the verdicts read in Python from one list of sums (torch.isfinite is four launches on CPU)
    return [math.isfinite(total) for total in torch.stack([piece.sum() for piece in pieces]).tolist()]


def snapshot_rows_reference(
    momentum: Tensor, rows: Tensor, mu: float, scale: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """U = momentum[rows] (a copy) and momentum[rows] ← mu·momentum[rows]; rows: [N, k].
    With scale ([N, 1, 1] per matrix or [N, k, 1] per row) returns U·scale in out_dtype
    (default: momentum's) instead; rows whose factor is not finite keep their momentum (a
    matrix the guard skips gets no error feedback). out: write U there ([N, k, C], any strides)."""
    width = momentum.shape[-1]
    feedback = None
    if scale is not None:  # mu where the factor is finite, else leave the row
        finite = torch.isfinite(scale).expand(*rows.shape, 1)
        if not host_checks_free(momentum.device) or not bool(finite.all()):
            # in float32 or wider, as the plain path's Python float (mu is not rounded to a half momentum's dtype)
            feedback = torch.full(finite.shape, mu, dtype=torch.promote_types(momentum.dtype, torch.float32),
                                  device=momentum.device).masked_fill_(finite.logical_not(), 1.0)
    if momentum.dim() == 3 and momentum.is_contiguous():  # rows of the flat [N·R, C] view:
        # index_select/index_copy_ move whole rows, ~1.7× faster on CPU than gather/scatter
        count, height, _ = momentum.shape
        flat = momentum.view(count * height, width)
        index = (rows + torch.arange(count, device=rows.device).unsqueeze(1) * height).reshape(-1)
        update = flat.index_select(0, index).view(*rows.shape, width)
        decayed = (update * (mu if feedback is None else feedback)).to(momentum.dtype)
        flat.index_copy_(0, index, decayed.view(-1, width))
    else:
        index = rows.unsqueeze(-1).expand(*rows.shape, width)
        update = momentum.gather(-2, index)
        momentum.scatter_(-2, index, (update * (mu if feedback is None else feedback)).to(momentum.dtype))
    if scale is None:
        result = update if out_dtype in (None, update.dtype) else update.to(out_dtype)
    else:
        return scale_cast_reference(update, scale, out_dtype or update.dtype, out)
    if out is not None:
        out.copy_(result)
        return out
    return result


class MomentumRestore(NamedTuple):
    """What putting a skipped matrix's momentum back needs (restore_momentum_reference's
    arguments but the verdict): the bucket's momentum [N, R, C], this step's gradients (a tensor
    or pieces), the momentum pass's decay, and for Dion3 the error feedback's mu and `selection`,
    which gives (the selected rows' positions [N, R], ≥ 0 where selected; the snapshot's norms fed
    [N]) when asked: only a step that restores, or a launch that may, builds them; `unselected`,
    the decay the step gave the rows it did not select (Dion3's unselected_decay; 1: none)."""

    momentum: Tensor
    grads: Union[Tensor, Sequence[Tensor]]
    decay: float
    mu: float = 1.0
    selection: Optional[Callable[[], tuple[Optional[Tensor], Optional[Tensor]]]] = None
    unselected: float = 1.0

    def selected(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """(positions, fed), or (None, None) without error feedback to undo."""
        return (None, None) if self.selection is None else self.selection()


def verdict_factors(update: Tensor, row_scale: Optional[Tensor], verdict: Optional[Tensor]) -> Optional[Tensor]:
    """Per-row factors for post_update_reference that carry the guard's verdict ([N] bool): 0 on
    every row of a skipped matrix ("leave the row", never 0·NaN), row_scale (or 1) elsewhere."""
    if verdict is None:
        return row_scale
    if row_scale is None:
        return verdict.to(torch.float32).view(-1, 1).expand(update.shape[:2])
    return torch.where(verdict.view(-1, *[1] * (row_scale.dim() - 1)), row_scale, 0.0)


def restore_momentum_reference(
    momentum: Tensor, grads: Union[Tensor, Sequence[Tensor]], keep: Tensor, decay: float, mu: float = 1.0,
    fed: Optional[Tensor] = None, positions: Optional[Tensor] = None, unselected: float = 1.0,
) -> None:
    """Put the momentum [N, R, C] of the matrices the guard skipped (keep[i] False) back to what
    it was before this step, by undoing the step's arithmetic in float32 (or wider): first the
    error feedback, M[S] ← M[S]/μ on the selected rows (positions [N, R] ≥ 0) and
    M[~S] ← M[~S]/unselected on the others, of the matrices whose snapshot applied it (fed [N]:
    their norm was finite; the snapshot leaves the others alone), then the accumulation,
    M ← (M − G)/decay where G is finite (entries whose gradient was not finite were never
    added). Equal to the old momentum to within the rounding of those operations; a kept matrix
    is not touched. Works through a few rows at a time."""
    pieces = [grads] if isinstance(grads, Tensor) else list(grads)
    count, height = momentum.shape[:2]
    only = None  # the matrices to restore, where the host may ask (CPU): a normal step does nothing
    if host_checks_free(momentum.device):
        only = set(torch.nonzero(keep.logical_not().reshape(-1)).flatten().tolist())
        if not only:
            return
    work = torch.promote_types(momentum.dtype, torch.float32)
    keep_rows = keep.view(-1, 1).expand(count, height)
    divisors = None  # what the error feedback multiplied each row by: mu, unselected, or 1 (none)
    if positions is not None and fed is not None:
        divisors = torch.where(torch.isfinite(fed.reshape(-1, 1)), torch.where(positions >= 0, mu, unselected), 1.0)
    targets = list(momentum.split([g.shape[0] for g in pieces]))
    for matrix, rows, target, grad in matrix_blocks(targets, pieces, only):
        before = target.to(work, copy=True)
        if divisors is not None:
            before.div_(divisors[matrix, rows].to(work).unsqueeze(-1))
        finite = torch.isfinite(grad)
        old = torch.where(finite, (before - grad.masked_fill(finite.logical_not(), 0).to(work)) / decay, before)
        target.copy_(torch.where(keep_rows[matrix, rows].unsqueeze(-1), target, old.to(target.dtype)))


def selection_positions_reference(rows: Tensor, height: int) -> Tensor:
    """The inverse of a selection rows [N, k]: [N, height] int32 holding each selected row's slot
    in rows, −1 for rows not selected (as kernels/selection.py builds it)."""
    count, k = rows.shape
    out = torch.full((count, height), -1, dtype=torch.int32, device=rows.device)
    return out.scatter_(1, rows, torch.arange(k, dtype=torch.int32, device=rows.device).expand(count, k).contiguous())


# rows per block of the reference paths' temporaries: the masks and copies of the guard's work
# stay far below one selection's size (tests/test_memory.py bounds the step's peak by it)
BLOCK_ROWS = 128


def matrix_blocks(targets, pieces, only: Optional[set] = None):
    """(matrix index, row slice, target rows, grad rows) for blocks of at most BLOCK_ROWS rows of
    one matrix each, over pieces [B_i, R, C] and their momentum targets (views: writing to a
    target writes to the momentum), matrices counted across the pieces; `only`: just these."""
    matrix = 0
    for target, grad in zip(targets, pieces):
        for m, g in zip(target.unbind(0), grad.unbind(0)):
            if only is None or matrix in only:
                for start in range(0, m.shape[0], BLOCK_ROWS):
                    rows = slice(start, start + BLOCK_ROWS)
                    yield matrix, rows, m[rows], g[rows]
            matrix += 1


def top_rows_reference(scores: Tensor, k: int) -> Tensor:
    """The k rows of each matrix with the largest scores [N, R] (non-negative), ascending
    [N, k] int64; among equal scores the lower rows first, NaN as +inf: the rule of the CUDA
    kernel too, so that every path and layout picks the same rows even from tied (e.g. all-zero)
    rows. float32: one topk over distinct int64 keys (the score's bit pattern, which orders
    like the score, above the reversed row index); wider scores: a stable sort (5× slower on CPU)."""
    r = scores.shape[-1]
    if scores.dtype == torch.float32:
        bits = (scores.contiguous().view(torch.int32) & 0x7FFFFFFF).clamp_max_(0x7F800000)  # −0 as +0, NaN as +inf
        keys = (bits.to(torch.int64) << 32) | (r - 1 - torch.arange(r, device=scores.device))
        return keys.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    scores = torch.where(scores.isnan(), torch.inf, scores)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values


def selection_norm_reference(
    squares: Tensor, rows: Tensor, norm_scale: Optional[float] = None, eps: float = 0.0
) -> tuple[Tensor, Optional[Tensor]]:
    """(‖selected rows‖_F [N, 1, 1] from squared row norms squares [N, R] and rows [N, k], and
    1/(norm_scale·norm + eps) or None when norm_scale is None), in squares' dtype."""
    norm = squares.gather(-1, rows).sum(dim=-1).sqrt().view(-1, 1, 1)
    return norm, None if norm_scale is None else torch.reciprocal(norm * norm_scale + eps)


def scale_cast_reference(x: Tensor, scale: Tensor, out_dtype: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
    """(x · scale) written in out_dtype, computed in the wider of the two dtypes; scale [N, 1|R, 1];
    into out when given (any strides)."""
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return torch.mul(x, scale, out=out)
