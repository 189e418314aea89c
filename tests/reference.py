"""An independent float64 reference of the update rules of DESIGN §2.

Written from the spec, one matrix at a time, with plain loops and no batching; it does not
import dion3's rule code, so a shared mistake cannot hide.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Optional

import torch
from torch import Tensor


def exact_polar(x: Tensor) -> Tensor:
    """U·Vᵀ of x = U·Σ·Vᵀ (batched over leading dims), in float64; zero for a zero matrix
    (whose SVD would give an arbitrary orthogonal factor)."""
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    nonzero = (s.amax(dim=-1) > 0).to(s.dtype)[..., None, None]
    return u @ vh * nonzero


def lr_multiplier(adjust_lr: Optional[str], rows: int, cols: int) -> float:
    if adjust_lr == "spectral_norm":
        return math.sqrt(rows / cols)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(rows, cols))
    assert adjust_lr is None
    return 1.0


def selected_count(rows: int, fraction: float) -> int:
    """k = max(1, ⌈f·rows⌉) with f read as the decimal the user wrote (0.3 means 3/10)."""
    return max(1, math.ceil(Fraction(repr(fraction)) * rows))


def normuon_normalize(o: Tensor, v: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """F = ‖O‖_F; V ← β₂V + (1−β₂)·mean_j O²; Ô = O/(√V + ε); Ô ← Ô·F / max(‖Ô‖_F, ε)."""
    frob = o.norm()
    v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1, keepdim=True)
    scaled = o / (v.sqrt() + eps)
    return scaled * frob / max(scaled.norm(), eps), v


class ReferenceOptimizer:
    """Muon / NorMuon / Dion3 / Dion2 on float64 copies of the given matrices (2-D, or 3-D
    batches). Dion2 is Dion3 without the per-row normalization. blocks: per parameter, None or
    the row counts of the blocks its matrices split into; each block steps as its own matrix.
    unselected_decay (Dion3/Dion2): the factor of the momentum rows a step does not select."""

    def __init__(
        self,
        params: list[Tensor],
        algorithm: str,
        lr: float = 0.01,
        mu: float = 0.95,
        muon_beta2: float = 0.95,
        weight_decay: float = 0.0,
        epsilon: float = 1e-8,
        nesterov: bool = False,
        fraction: float = 0.25,
        adjust_lr: Optional[str] = "spectral_norm",
        orthogonalizer: Callable[[Tensor], Tensor] = exact_polar,
        selector: Optional[Callable[[Tensor, int], Tensor]] = None,
        blocks: Optional[list[Optional[list[int]]]] = None,
        row_score: str = "l1",
        unselected_decay: float = 1.0,
    ):
        assert algorithm in ("muon", "normuon", "dion3", "dion2")
        self.unselected_decay = unselected_decay
        self.algorithm = algorithm
        self.lr, self.mu, self.beta2, self.wd, self.eps = lr, mu, muon_beta2, weight_decay, epsilon
        self.nesterov, self.fraction, self.adjust_lr = nesterov, fraction, adjust_lr
        self.row_score = row_score  # Dion3's selection: each row's L1 norm, or its L2 norm
        self.orth = orthogonalizer
        # Dion3's rows from the row scores and k; default: the top k of the whole matrix.
        self.select = selector or (lambda scores, k: torch.argsort(scores, descending=True)[:k])
        self.params = [p.detach().double().clone() for p in params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.variance = [torch.zeros(*p.shape[:-1], 1, dtype=torch.float64) for p in self.params]
        self.blocks = blocks or [None] * len(self.params)
        self.selected: list[list[Tensor]] = []  # per param, per matrix (and block): rows chosen last step

    def step(self, grads: list[Optional[Tensor]]) -> None:
        self.selected = []
        for index, grad in enumerate(grads):
            chosen = []
            if grad is not None:
                x, m, v = self.params[index], self.momentum[index], self.variance[index]
                g = grad.double()
                batched = x.dim() == 3
                rows = x.shape[-2]
                sizes = self.blocks[index] or [rows]
                assert sum(sizes) == rows
                for b in range(x.shape[0] if batched else 1):
                    pick = (lambda t: t[b]) if batched else (lambda t: t)
                    start = 0
                    for size in sizes:  # views of the block's rows: updated in place
                        cut = slice(start, start + size)
                        rows_moved = self._matrix_step(pick(x)[cut], pick(m)[cut], pick(v)[cut], pick(g)[cut])
                        chosen.append(rows_moved + start)
                        start += size
            self.selected.append(chosen)

    def _matrix_step(self, x: Tensor, m: Tensor, v: Tensor, g: Tensor) -> Tensor:
        """Updates x, m, v (views) in place; returns the rows that were updated."""
        rows, cols = x.shape
        lr_adjusted = self.lr * lr_multiplier(self.adjust_lr, rows, cols)
        if self.algorithm in ("dion3", "dion2"):
            m += g
            scores = m.abs().sum(dim=1) if self.row_score == "l1" else m.norm(dim=1)
            k = selected_count(rows, self.fraction)
            chosen = self.select(scores, k).sort().values
            u = m[chosen].clone()
            m[chosen] *= self.mu
            unselected = torch.ones(rows, dtype=torch.bool)
            unselected[chosen] = False
            m[unselected] *= self.unselected_decay  # 1: they keep accumulating
        else:
            m.mul_(self.mu).add_(g)
            u = self.mu * m + g if self.nesterov else m.clone()
            chosen = torch.arange(rows)
        o = self.orth(u.unsqueeze(0))[0].double()
        if self.algorithm in ("normuon", "dion3"):
            o, v[chosen] = normuon_normalize(o, v[chosen], self.beta2, self.eps)
        x *= 1 - self.lr * self.wd
        x[chosen] -= lr_adjusted * o
        return chosen


def exact_padded_polar(update, *args, **kwargs):
    """A stand-in for dion3.rules.orthogonalize_padded (where the optimizers orthogonalize):
    the float64 SVD polar factor of the matrices, in their dtype (a normalized input has the
    polar factor of the unscaled one)."""
    from dion3.ortho.padding import Padded

    matrices = update.matrices if isinstance(update, Padded) else update
    return Padded(exact_polar(matrices).to(matrices.dtype), matrices.shape[-2], matrices.shape[-1])


def altered_orthogonalizer(change):
    """A stand-in for dion3.rules.orthogonalize_padded that orthogonalizes as it does, then
    returns change(O) (O: a copy of the result's matrices) instead."""
    import dion3.rules as rules
    from dion3.ortho.padding import Padded

    original = rules.orthogonalize_padded

    def altered(update, *args, **kwargs):
        out = change(original(update, *args, **kwargs).matrices.clone())
        return Padded(out, out.shape[-2], out.shape[-1])

    return altered
