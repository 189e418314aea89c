"""The exchange stages of a sharded bucket (bucket.LayoutBucket) in the one matrix step
(dion3.matrix_step): matrices cut into pieces by any mix of row, strided row, column and expert
sharding. FSDP2's plain row sharding (a
ShardedBucket) is one configuration of it: whole rows on every member, so the owner places all
received rows with one indexed copy, and one member alone places nothing.

One bucket, one round over the group of the axes that split its matrices:
  pre-step on the local piece → [Dion3: all-reduce of partial row scores over the column axes;
  global scope: all-gather of full-row scores over the row axes only (after the all-reduce the
  column shards of a row hold the same score: one copy per row set travels)] → all-reduce of
  per-matrix squared norms → one all-to-all of the contributed rows (each member's column range
  of them, normalized in Newton–Schulz's compute dtype, + their variances) to each matrix's
  owner → the owner assembles whole matrices (or their selected rows), orthogonalizes them as
  one batch, normalizes and guards them (matrix_step) → one all-to-all back of Ô (NaN rows for a
  matrix the guard skipped) and the new variance rows [global scope: + one float per matrix,
  the verdict] → apply to the local piece with the global shape's lr scale, restore the
  momentum of skipped matrices.
Rows travel already normalized for Newton–Schulz, in its half-precision compute dtype (half the
bytes of float32 rows): each rank sums the squares of the rows it contributes per matrix, one
small all-reduce gives every matrix's ‖U‖_F, and every rank scales its own rows.
Axes that split only the experts of a stack, and replicated axes, send nothing: each rank steps
the experts it holds, the replicas repeat the same work. With no axis splitting the matrices
(bucket.mesh None) every "collective" is the identity.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import rules
from ..kernels import accumulate_momentum, scale_cast, snapshot_rows
from ..matrix_step import Owned, Result, Whole
from ..ortho import input_scaling
from .bucket import LayoutBucket
from .exchange import Traffic, exchange_rows, gather_chunks, sum_across
from .selection import RowRoutes, all_rows_plan, global_plan, local_plan, padded_scores


class ShardedRoute:
    """The exchange stages of a sharded bucket in the one matrix step (module docstring)."""

    def __init__(self, bucket: LayoutBucket, group: dict, cfg: rules.RuleConfig, traffic: Traffic):
        self.bucket, self.group, self.cfg, self.traffic = bucket, group, cfg, traffic
        self.views, self.shape, self.skipped = bucket.views, bucket.shape, getattr(bucket, "skipped", None)
        self.momentum = bucket.momentum
        self.grads = bucket.grads()
        self.plan: Optional[RowRoutes] = None
        self.total: Optional[Tensor] = None  # ‖U‖_F² per matrix, summed over the group

    def to_owner(self):
        """Pre-step on the local piece, selection, the norms, and the rows to their owners."""
        bucket, group, cfg, traffic = self.bucket, self.group, self.cfg, self.traffic
        mesh, rank = bucket.mesh, bucket.rank
        count, cols = bucket.count, bucket.shape[1]
        _, rows_here, cols_here = bucket.local.local_shape
        momentum = self.momentum
        if cfg.fraction is None:  # Muon / NorMuon: every row goes to its matrix's owner
            update, _, norm, _ = rules.pre_step(momentum, self.grads, cfg, want_norm=True)
            if norm is None:  # Nesterov's U = μM + G is not seen by the momentum pass
                norm = torch.linalg.vector_norm(update, dim=(-2, -1), dtype=torch.promote_types(update.dtype, torch.float32))
            plan: RowRoutes = all_rows_plan(bucket)
            partial = norm.reshape(count).square()
            row_matrix = None
        else:  # Dion3: M ← M + G, score rows, select, snapshot the selected rows with error feedback
            by_l2 = cfg.row_score == "l2"
            scores, squares = accumulate_momentum(momentum, self.grads, 1.0, scores=not by_l2, squares=True)
            if by_l2:  # ranked by squared L2 norms (a copy where summed in place below: squares stay local)
                scores = squares.clone() if bucket.col_mesh is not None else squares
            if bucket.col_mesh is not None:  # a row's score is the sum of its column pieces' (L1 or squared L2)
                summed = sum_across(scores, bucket.col_mesh, traffic, "scores")
                yield
                scores = summed.wait()
            if group["selection_scope"] == "local":
                plan = local_plan(bucket, scores, cfg.fraction)
            else:
                gathered = gather_chunks(padded_scores(bucket, scores), bucket.row_mesh, traffic, "scores")
                yield
                plan = global_plan(bucket, gathered.wait(), cfg.fraction)
            row_matrix = torch.div(plan.rows, max(rows_here, 1), rounding_mode="floor")
            # a row whose gradient was not finite measures NaN (kernels.accumulate_momentum): its
            # matrix's summed norm is NaN on every rank, and the guard skips it everywhere
            partial = squares.new_zeros(count).index_add_(0, row_matrix, squares.reshape(-1)[plan.rows])
        self.plan = plan
        scaling = input_scaling(plan.per_matrix, cols, momentum.device, group["orthogonalizer"],
                                group["ns_coefficients"], momentum.dtype)
        total = sum_across(partial, mesh, traffic, "norms")
        yield
        self.total = total.wait()
        factor = scaling.factor(self.total.sqrt())  # [count]
        if row_matrix is None:
            send = scale_cast(update, factor.view(count, 1, 1), scaling.dtype)
            variance = bucket.variance if cfg.normalize else None
        else:  # U = M[S] scaled per matrix, M[S] ← μ·M[S], in one pass (the fused snapshot of one device)
            flat = momentum.view(1, -1, cols_here)
            row_factor = factor.index_select(0, row_matrix).view(1, -1, 1)
            send = snapshot_rows(flat, plan.rows.view(1, -1), cfg.mu, row_factor, scaling.dtype)[0]
            variance = bucket.variance.view(-1, 1).index_select(0, plan.rows) if cfg.normalize else None

        self.to_counts, self.from_counts = plan.send_counts(rank), plan.recv_counts(rank)
        self.widths = [m.cols[1] - m.cols[0] for m in bucket.members]
        sent_rows = exchange_rows(send.reshape(-1), [n * cols_here for n in self.to_counts],
                                  [n * w for n, w in zip(self.from_counts, self.widths)], mesh, traffic, "rows")
        sent_variance = variance is not None and exchange_rows(variance.reshape(-1), self.to_counts, self.from_counts,
                                                               mesh, traffic, "variance")
        # The collectives keep what they send alive; this bucket's own references need not wait.
        send = update = variance = None
        yield

        # Owner: whole matrices (or their selected rows), rows in ascending global order.
        self.owned = owned = len(bucket.owned(rank))
        matrices = _place(sent_rows.wait(), plan, bucket, owned, cols, self.from_counts)
        self.old_variance = None
        if sent_variance:
            self.old_variance = _place(sent_variance.wait(), plan, bucket, owned, 1, self.from_counts).view(
                owned, plan.per_matrix, 1)
        return Owned(matrices.view(owned, plan.per_matrix, cols), normalized=True)

    def gather(self, ortho: Tensor):
        """The owner holds whole matrices (or their selected rows) already; their variance rows
        arrived with them."""
        return Whole(ortho, self.old_variance, None)
        yield

    def scatter(self, whole: Whole, row_scale: Optional[Tensor], ok: Tensor):
        """Ô of every owned matrix (NaN for one the guard skipped, so that every rank holding its
        rows skips them) and its new variance rows back to the ranks holding them."""
        bucket, plan, mesh, traffic = self.bucket, self.plan, self.bucket.mesh, self.traffic
        cols, (_, rows_here, cols_here) = bucket.shape[1], bucket.local.local_shape
        count, from_owner, to_owner = bucket.count, self.from_counts, self.to_counts
        if row_scale is None:  # Muon / Dion2
            ortho = whole.ortho.mul_(torch.where(ok, 1.0, math.nan).to(whole.ortho.dtype).view(-1, 1, 1))
        else:
            factors = torch.where(ok.view(-1, 1, 1), row_scale.reshape(whole.ortho.shape[:2]).unsqueeze(-1), math.nan)
            ortho = scale_cast(whole.ortho.contiguous(), factors, whole.ortho.dtype)
        back_variance = None
        if whole.variance is not None:  # new values for the matrices that stepped, old ones otherwise
            back_variance = exchange_rows(_pieces(whole.variance, plan, bucket, 1, from_owner), from_owner, to_owner,
                                          mesh, traffic, "variance")
        back_rows = exchange_rows(_pieces(ortho, plan, bucket, cols, from_owner),
                                  [n * w for n, w in zip(from_owner, self.widths)],
                                  [n * cols_here for n in to_owner], mesh, traffic, "rows")
        verdict = None
        if self.group.get("selection_scope") == "global" and plan.rows is not None and mesh is not None:
            # a rank holding rows of a matrix none of which were selected receives none of them
            # back: it learns the owner's verdict from one float per matrix
            skipped = torch.zeros(count, dtype=torch.float32, device=ok.device)
            mine = bucket.owned(bucket.rank)
            skipped[mine.start : mine.stop] = ok.logical_not().to(torch.float32)
            verdict = sum_across(skipped, mesh, traffic, "verdict")
        del ortho
        yield

        # Result rows arrive in the order they were sent (plan.rows: per matrix, ascending).
        result = back_rows.wait().view(-1, cols_here)
        self.back_variance = back_variance
        if plan.rows is None:
            update, rows = result.view(count, rows_here, cols_here), None
        else:
            mine = plan.counts[bucket.rank]
            k = mine[0]
            # the same k rows of every matrix: local scope, and global scope where this rank holds
            # every row (one member, or only columns split); the padded form would copy the result
            if all(c == k for c in mine):
                update = result.view(count, k, cols_here)
                rows = plan.rows.view(count, k) - torch.arange(count, device=result.device)[:, None] * rows_here
            else:  # global scope: the number of rows per local matrix varies
                update, rows = padded_selection(plan.rows, result, count, rows_here, rows_here, max(mine, default=0))
        # good: its rows came back finite, its gradient was finite on every rank, its owner kept it
        local_ok = rules.matrices_within(rules.frobenius_norms(update), update.shape, math.inf) & self.total.isfinite()
        if verdict is not None:
            local_ok = local_ok & (verdict.wait() == 0)
        return Result(update, rows, None, local_ok)

    def finish(self, result: Result) -> None:
        """The variance rows the owners sent back (unchanged for a skipped matrix)."""
        if self.back_variance is None:
            return
        values = self.back_variance.wait()
        if self.plan.rows is None:
            self.bucket.variance.copy_(values.view(self.bucket.variance.shape))
        else:  # Dion3 (Dion2 has no per-row normalization)
            self.bucket.variance.view(-1, 1).index_copy_(0, self.plan.rows, values.view(-1, 1))

    def selection(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """(which local rows were selected, as [count, rows held] int32 ≥ 0 there, and the summed
        norms, finite where the snapshot applied error feedback), or (None, None) for Muon."""
        if self.plan is None or self.plan.rows is None:
            return None, None
        count, rows_here = self.bucket.count, self.bucket.local.local_shape[1]
        positions = torch.full((count * rows_here,), -1, dtype=torch.int32, device=self.plan.rows.device)
        return positions.index_fill_(0, self.plan.rows, 0).view(count, rows_here), self.total


def _place(received: Tensor, plan: RowRoutes, bucket: LayoutBucket, owned: int, width: int,
           from_owner: list[int]) -> Tensor:
    """Received pieces (member-major; member s's rows span its column range) → [owned·K, width].
    One member: they arrive in place. Whole rows (width 1 for variances): one indexed copy."""
    if bucket.world_size == 1:
        return received.view(owned * plan.per_matrix, width)
    out = received.new_empty((owned * plan.per_matrix, width))
    if width == 1 or bucket.whole_rows:
        return out.index_copy_(0, plan.slots, received.view(-1, width))
    offset = 0
    for member, slots in zip(bucket.members, plan.slots.split(from_owner)):
        start, stop = member.cols
        block = received[offset : offset + slots.numel() * (stop - start)].view(-1, stop - start)
        offset += block.numel()
        out[:, start:stop].index_copy_(0, slots, block)
    return out


def _pieces(placed: Tensor, plan: RowRoutes, bucket: LayoutBucket, width: int, from_owner: list[int]) -> Tensor:
    """The inverse of _place: each member's rows and columns, in the order they arrived, flat."""
    flat = placed.reshape(-1, width)
    if bucket.world_size == 1:
        return flat.reshape(-1)
    if width == 1 or bucket.whole_rows:
        return flat.index_select(0, plan.slots).reshape(-1)
    parts = [flat[:, m.cols[0] : m.cols[1]].index_select(0, slots).reshape(-1)
             for m, slots in zip(bucket.members, plan.slots.split(from_owner))]
    return torch.cat(parts)


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
