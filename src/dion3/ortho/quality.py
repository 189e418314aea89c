"""Orthogonalization quality, measured on the small Gram side (n×n with n = min(rows, cols))."""
from __future__ import annotations

import torch
from torch import Tensor


def _wide64(x: Tensor) -> Tensor:
    x = x.detach().double()
    return x.mT if x.shape[-2] > x.shape[-1] else x


def singular_values(out: Tensor) -> Tensor:
    """Singular values of an orthogonalizer's output, from eigenvalues of O·Oᵀ (float64)."""
    wide = _wide64(out)
    eig = torch.linalg.eigvalsh(wide @ wide.mT)
    return eig.clamp_min(0).sqrt()


def orthogonality_error(out: Tensor) -> Tensor:
    """‖O·Oᵀ − I‖_F / √n per matrix."""
    wide = _wide64(out)
    n = wide.shape[-2]
    eye = torch.eye(n, dtype=wide.dtype, device=wide.device)
    return torch.linalg.matrix_norm(wide @ wide.mT - eye) / n**0.5


def relative_difference(a: Tensor, b: Tensor) -> Tensor:
    """‖a − b‖_F / ‖b‖_F per matrix (0 where both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    num = torch.linalg.matrix_norm(a - b)
    den = torch.linalg.matrix_norm(b)
    return torch.where(den > 0, num / den.clamp_min(1e-300), num)


def summary(out: Tensor, reference: Tensor | None = None) -> dict[str, float]:
    """Worst-case metrics over a batch, for reports and benchmarks."""
    sv = singular_values(out)
    report = {
        "sv_min": float(sv.min()),
        "sv_max": float(sv.max()),
        "orthogonality_error": float(orthogonality_error(out).max()),
    }
    if reference is not None:
        report["relative_difference"] = float(relative_difference(out, reference).max())
    return report
