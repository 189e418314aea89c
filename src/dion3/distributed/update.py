"""The owner's and the applying rank's part of a distributed step, shared by every bucket kind:
orthogonalize gathered matrices, and apply an update to local rows (also a varying number of
selected rows per matrix, without a host sync)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import rules
from ..algorithms import NORMALIZING_ALGORITHMS


def orthogonalize(update: Tensor, group: dict, norm: Optional[Tensor] = None, normalized: bool = False) -> Tensor:
    ortho = rules.orthogonalize_rows(update, group["orthogonalizer"], group["ns_coefficients"], norm, normalized)
    # NorMuon/Dion3 spread a bad matrix (not finite, or above rules.update_bound) over all its
    # rows when they normalize them; Muon's owner does it here, so that every rank holding rows
    # of that matrix skips them
    if group["algorithm"] in NORMALIZING_ALGORITHMS:
        return ortho
    return rules.poison_nonfinite(ortho, rules.update_bound(group["ns_coefficients"]))


def apply(bucket, update: Tensor, rows, group: dict, row_scale=None) -> None:
    scale = rules.lr_scale(group["adjust_lr"], *bucket.shape)
    rules.apply_update(bucket.views, update, rows, group["lr"], group["weight_decay"], scale, row_scale,
                       getattr(bucket, "skipped", None))



def padded_selection(flat_rows: Tensor, result: Tensor, count: int, chunk: int, rows_here: int, width: int):
    """(update [count, width, cols], rows [count, width]) for selections of different sizes per
    matrix: each matrix's selected rows (ascending, with their result rows) and then its first
    unselected rows with a zero update, which the fused update leaves at x·decay − 0 = x·decay,
    exactly what it does to any unselected row. All on the device: no host sync."""
    device = result.device
    selected = torch.zeros(count * chunk, dtype=torch.bool, device=device)
    selected[flat_rows] = True
    selected = selected.view(count, chunk)[:, :rows_here]
    order = torch.arange(rows_here, device=device, dtype=torch.float32)
    # Selected rows sort first (negative keys), each group in row order.
    rows = torch.where(selected, order - rows_here, order).topk(width, dim=1, largest=False, sorted=True).indices
    matrix = torch.div(flat_rows, chunk, rounding_mode="floor")
    per_matrix = selected.sum(dim=1)
    first = per_matrix.cumsum(0) - per_matrix  # where each matrix's rows start in result
    target = matrix * width + torch.arange(flat_rows.numel(), device=device) - first[matrix]
    update = result.new_zeros((count * width, result.shape[-1])).index_copy_(0, target, result)
    return update.view(count, width, result.shape[-1]), rows
