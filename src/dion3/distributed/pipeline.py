"""The distributed step of a sharded bucket (bucket.LayoutBucket): matrices cut into pieces by
any mix of row, strided row, column and expert sharding. FSDP2's plain row sharding (a
ShardedBucket) is one configuration of it: whole rows on every member, so the owner places all
received rows with one indexed copy, and one member alone places nothing.

One bucket, one round over the group of the axes that split its matrices:
  pre-step on the local piece → [Dion3: all-reduce of partial row scores over the column axes;
  global scope: all-gather of full-row scores over the row axes only (after the all-reduce the
  column shards of a row hold the same score: one copy per row set travels)] → all-reduce of
  per-matrix squared norms → one all-to-all of the contributed rows (each member's column range
  of them, normalized in Newton–Schulz's compute dtype, + their variances) to each matrix's
  owner → the owner assembles whole matrices (or their selected rows), orthogonalizes them as
  one batch (+ NorMuon normalization) → one all-to-all back → apply to the local piece with the
  global shape's lr scale.
Rows travel already normalized for Newton–Schulz, in its half-precision compute dtype (half the
bytes of float32 rows): each rank sums the squares of the rows it contributes per matrix, one
small all-reduce gives every matrix's ‖U‖_F, and every rank scales its own rows.
Axes that split only the experts of a stack, and replicated axes, send nothing: each rank steps
the experts it holds, the replicas repeat the same work. With no axis splitting the matrices
(bucket.mesh None) every "collective" is the identity.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import rules
from ..kernels import accumulate_momentum, scale_cast, snapshot_rows
from ..ortho import input_scaling
from .bucket import LayoutBucket
from .exchange import Traffic, exchange_rows, gather_chunks, sum_across
from .selection import PiecePlan, all_rows_plan, global_plan, local_plan, padded_scores
from .update import apply, orthogonalize, padded_selection


def sharded_step(bucket: LayoutBucket, group: dict, cfg: rules.RuleConfig, traffic: Traffic):
    mesh, rank = bucket.mesh, bucket.rank
    count, cols = bucket.count, bucket.shape[1]
    _, rows_here, cols_here = bucket.local.local_shape
    grads = bucket.grads()
    momentum = bucket.momentum
    if cfg.fraction is None:  # Muon / NorMuon: every row goes to its matrix's owner
        update, _, norm, _ = rules.pre_step(momentum, grads, cfg, want_norm=True)
        if norm is None:  # Nesterov's U = μM + G is not seen by the momentum pass
            norm = torch.linalg.vector_norm(update, dim=(-2, -1), dtype=torch.promote_types(update.dtype, torch.float32))
        plan: PiecePlan = all_rows_plan(bucket)
        partial = norm.reshape(count).square()
        row_matrix = None
    else:  # Dion3: M ← M + G, score rows, select, snapshot the selected rows with error feedback
        scores, squares = accumulate_momentum(momentum, grads, 1.0, scores=True, squares=True)
        if bucket.col_mesh is not None:  # a row's L1 norm is the sum of its column pieces' norms
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
        partial = squares.new_zeros(count).index_add_(0, row_matrix, squares.reshape(-1)[plan.rows])
    scaling = input_scaling(plan.per_matrix, cols, momentum.device, group["orthogonalizer"],
                            group["ns_coefficients"], momentum.dtype)
    total = sum_across(partial, mesh, traffic, "norms")
    yield
    factor = scaling.factor(total.wait().sqrt())  # [count]
    if row_matrix is None:
        send = scale_cast(update, factor.view(count, 1, 1), scaling.dtype)
        variance = bucket.variance if cfg.normalize else None
    else:  # U = M[S] scaled per matrix, M[S] ← μ·M[S], in one pass (the fused snapshot of one device)
        flat = momentum.view(1, -1, cols_here)
        row_factor = factor.index_select(0, row_matrix).view(1, -1, 1)
        send = snapshot_rows(flat, plan.rows.view(1, -1), cfg.mu, row_factor, scaling.dtype)[0]
        variance = bucket.variance.view(-1, 1).index_select(0, plan.rows) if cfg.normalize else None

    to_owner, from_owner = plan.send_counts(rank), plan.recv_counts(rank)
    widths = [m.cols[1] - m.cols[0] for m in bucket.members]
    sent_rows = exchange_rows(send.reshape(-1), [n * cols_here for n in to_owner],
                              [n * w for n, w in zip(from_owner, widths)], mesh, traffic, "rows")
    sent_variance = variance is not None and exchange_rows(variance.reshape(-1), to_owner, from_owner, mesh,
                                                           traffic, "variance")
    # The collectives keep what they send alive; this bucket's own references need not wait.
    send = update = variance = None
    yield

    # Owner: whole matrices (or their selected rows), rows in ascending global order.
    owned = len(bucket.owned(rank))
    matrices = _place(sent_rows.wait(), plan, bucket, owned, cols, from_owner)
    ortho = orthogonalize(matrices.view(owned, plan.per_matrix, cols), group, normalized=True)
    del matrices  # the bucket's received rows (a placed copy or the receive buffer itself)
    if sent_variance:
        old = _place(sent_variance.wait(), plan, bucket, owned, 1, from_owner)
        ortho, new = rules.normalize_rows(ortho, old.view(owned, plan.per_matrix, 1), cfg.beta2, cfg.epsilon,
                                          rules.update_bound(group["ns_coefficients"]))
        back_variance = exchange_rows(_pieces(new, plan, bucket, 1, from_owner), from_owner, to_owner, mesh,
                                      traffic, "variance")
    back_rows = exchange_rows(_pieces(ortho, plan, bucket, cols, from_owner),
                              [n * w for n, w in zip(from_owner, widths)], [n * cols_here for n in to_owner],
                              mesh, traffic, "rows")
    del ortho
    yield

    # Result rows arrive in the order they were sent (plan.rows: per matrix, ascending).
    result = back_rows.wait().view(-1, cols_here)
    if plan.rows is None:
        apply(bucket, result.view(count, rows_here, cols_here), None, group)
        if sent_variance:
            bucket.variance.copy_(back_variance.wait().view(count, rows_here, 1))
        return
    mine = plan.counts[rank]
    k = mine[0]
    # the same k rows of every matrix: local scope, and global scope where this rank holds
    # every row (one member, or only columns split); the padded form would copy the result
    if all(c == k for c in mine):
        local_rows = plan.rows.view(count, k) - torch.arange(count, device=result.device)[:, None] * rows_here
        apply(bucket, result.view(count, k, cols_here), local_rows, group)
    else:  # global scope: the number of rows per local matrix varies
        apply(bucket, *padded_selection(plan.rows, result, count, rows_here, rows_here, max(mine, default=0)), group)
    if sent_variance:  # Dion3 (Dion2 has no per-row normalization)
        bucket.variance.view(-1, 1).index_copy_(0, plan.rows, back_variance.wait().view(-1, 1))


def _place(received: Tensor, plan: PiecePlan, bucket: LayoutBucket, owned: int, width: int,
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


def _pieces(placed: Tensor, plan: PiecePlan, bucket: LayoutBucket, width: int, from_owner: list[int]) -> Tensor:
    """The inverse of _place: each member's rows and columns, in the order they arrived, flat."""
    flat = placed.reshape(-1, width)
    if bucket.world_size == 1:
        return flat.reshape(-1)
    if width == 1 or bucket.whole_rows:
        return flat.index_select(0, plan.slots).reshape(-1)
    parts = [flat[:, m.cols[0] : m.cols[1]].index_select(0, slots).reshape(-1)
             for m, slots in zip(bucket.members, plan.slots.split(from_owner))]
    return torch.cat(parts)
