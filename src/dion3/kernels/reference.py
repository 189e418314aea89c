"""PyTorch reference paths for every kernel: used on CPU, for small shapes, and in tests."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor


def symmetric_matmul_reference(
    a: Tensor, b: Tensor, c: Optional[Tensor] = None, alpha: float = 1.0, beta: float = 0.0
) -> Tensor:
    """D = alpha·a·b + beta·c for batched [..., n, k] @ [..., k, n]; the result is symmetric
    by the caller's promise, so only the full product is computed here."""
    if c is None or beta == 0.0:
        out = torch.matmul(a, b)
        return out if alpha == 1.0 else out.mul_(alpha)
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha) if a.dim() == 3 else torch.addmm(
        c, a, b, beta=beta, alpha=alpha
    )


def post_update_reference(
    params: Sequence[Tensor],
    update: Tensor,
    rows: Optional[Tensor],
    decay: Union[Tensor, float],
    step: Union[Tensor, float],
) -> None:
    """In place, for each param [B_i, R, C] and its slice of update [N, k, C] / rows [N, k]:
    param ← decay·param, then param[rows] ← param[rows] − step·update (k = R when rows is None).
    Computed in float32 and rounded once to the param's dtype.
    """
    offset = 0
    for param in params:
        count = param.shape[0]
        compute = torch.promote_types(param.dtype, torch.float32)  # float64 params stay float64
        piece = update[offset : offset + count].to(compute)
        work = param.to(compute).mul_(decay)  # a copy for low-precision params; in place otherwise
        if rows is None:
            work.sub_(piece * step)
        else:
            index = rows[offset : offset + count].unsqueeze(-1).expand(-1, -1, param.shape[-1])
            work.scatter_(1, index, work.gather(1, index) - piece * step)
        if work.data_ptr() != param.data_ptr():
            param.copy_(work)
        offset += count
