"""The distributed matrix step: one generator per bucket, interleaved so that one bucket's
collectives are in flight while another bucket computes.

Each bucket step yields right after launching a collective and resumes by waiting on it.
Every rank runs the same buckets in the same order and every bucket issues the same
collectives on every rank (also ranks holding zero rows), so collectives always match.

Row-sharded (FSDP2 Shard(0)):  pre-step on local rows → [Dion3 global: all-gather row scores]
  → all-reduce of per-matrix squared norms → all-to-all of the contributed rows, normalized in
  Newton–Schulz's compute dtype (+ their variances), to each matrix's owner → owner
  orthogonalizes its whole matrices as one batch (+ NorMuon normalization) → all-to-all back
  → apply locally with the global shape's lr scale.
Replicated (DDP): identical pre-step everywhere → each rank orthogonalizes its 1/W of the
  bucket → all-gather → normalize and apply everywhere.
Any other layout (TP columns, strided rows, several axes, expert stacks): layout_step.py.
Each bucket runs over its own group (bucket.mesh): the axes that split its matrices.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from .. import rules
from ..kernels import accumulate_momentum, scale_cast, snapshot_rows
from ..ortho import input_scaling
from ..buckets import bucket_subset, write_back_subset
from .exchange import Traffic, exchange_rows, gather_chunks, sum_across
from .layout_step import layout_step
from .mesh import MeshInfo, local_tensor
from .plan import LayoutBucket, ShardedBucket, owned_matrices
from .selection import all_rows_plan, global_plan, local_plan, padded_scores
from .update import apply, orthogonalize, padded_selection

PIPELINE_DEPTH = 4  # buckets in flight at once: enough overlap, bounded extra memory
# ... and local bucket bytes in flight at most PIPELINE_BUDGET × the largest bucket or
# PIPELINE_MEMORY_SHARE of the device's memory, whichever is more. Each in-flight bucket keeps
# its exchanged rows alive: with every bucket of Llama-8B shapes in flight, FSDP2 on one H200 ran
# out of memory; capping at 1.5× the largest bucket alone cost up to 24% on Llama-1B shapes over
# two H200s (less overlap), where everything fits easily.
PIPELINE_BUDGET = 1.5
PIPELINE_MEMORY_SHARE = 0.1


def run_step(work: list[tuple[dict, object]], rule_config) -> Traffic:
    """Step every (group, bucket) pair, each over its own bucket.mesh; returns the bytes this
    rank sent."""
    traffic = Traffic()
    steps, sizes = [], []
    for group, bucket in work:
        # Which parameters have gradients must agree across ranks (it does under FSDP2 and DDP,
        # which reduce every gradient they produce): every rank then runs the same collectives.
        keep = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        if not keep:
            continue
        if len(keep) == len(bucket.params) and getattr(bucket, "pieces", None) is None:
            steps.append(_bucket_step(bucket, group, rule_config(group), traffic))
        else:  # step a temporary bucket of the entries with gradients (or of uneven blocks' state), then write it back
            steps.append(_subset_step(_bucket_step, bucket, keep, group, rule_config(group), traffic))
        sizes.append(_admission_size(bucket))
    interleave(steps, PIPELINE_DEPTH, sizes, _pipeline_budget(sizes, work))
    return traffic


def _admission_size(bucket) -> int:
    """The bytes that decide when a bucket is admitted into the pipeline. They must be the same
    on every rank (the admission order is the order of every group's collectives): the padded
    local state of row-sharded and replicated buckets is; a LayoutBucket's unpadded piece is not
    (uneven pieces, different expert counts per group), so it counts its parameters' global
    bytes spread over all ranks (a block of a fused weight: its rows' share of them). Buckets of
    uneven blocks (state in parameter-shaped pieces, stacked per step) count the stacked copy,
    as large as their matrices."""
    element = bucket.views[0].element_size()
    if isinstance(bucket, LayoutBucket):
        total = element * (sum(p.numel() for p in bucket.params) if bucket.cuts is None else sum(
            p.numel() * bucket.shape[0] // cut.param_rows for p, cut in zip(bucket.params, bucket.cuts)))
        return total // (dist.get_world_size() if dist.is_initialized() else 1)
    if bucket.momentum is None:
        return sum(v.numel() for v in bucket.views) * element
    return bucket.momentum.numel() * bucket.momentum.element_size()


def _bucket_step(bucket, group: dict, cfg: rules.RuleConfig, traffic: Traffic) -> Iterator:
    if isinstance(bucket, ShardedBucket):
        return sharded_step(bucket, group, cfg, bucket.mesh, traffic)
    if isinstance(bucket, LayoutBucket):
        return layout_step(bucket, group, cfg, traffic)
    return replicated_step(bucket, group, cfg, bucket.mesh, traffic)


def _pipeline_budget(sizes: list[int], work) -> float:
    device = work[0][1].views[0].device if work else None
    memory = torch.cuda.get_device_properties(device).total_memory if device is not None and device.type == "cuda" else 0
    return max(PIPELINE_BUDGET * max(sizes, default=0), PIPELINE_MEMORY_SHARE * memory)


def _subset_step(body, bucket, keep: list[int], *args) -> Iterator:
    """body on a temporary bucket of the entries `keep`, stacked when the step reaches it (not
    before: only the buckets in flight hold copies), with its state written back after."""
    sub, sources = bucket_subset(bucket, keep)
    yield from body(sub, *args)
    write_back_subset(bucket, sub, sources)


def interleave(steps: list[Iterator], depth: int, sizes: list[int] | None = None, budget: float = float("inf")) -> None:
    """Advance bucket steps round-robin, one stage each, admitting new ones in order while
    fewer than `depth` are active and their sizes stay within `budget` (one is always admitted)."""
    sizes = sizes if sizes is not None else [0] * len(steps)
    waiting, active = deque(zip(steps, sizes)), deque()
    while waiting or active:
        in_flight = sum(size for _, size in active)
        while waiting and (not active or (len(active) < depth and in_flight + waiting[0][1] <= budget)):
            in_flight += waiting[0][1]
            active.append(waiting.popleft())
        entry = active.popleft()
        if next(entry[0], StopIteration) is not StopIteration:
            active.append(entry)


def sharded_step(bucket: ShardedBucket, group: dict, cfg: rules.RuleConfig, mesh: MeshInfo, traffic: Traffic):
    rows_here, cols, chunk, count = bucket.local_rows, bucket.shape[1], bucket.chunk, bucket.count
    grads = [local_tensor(p.grad).reshape(1, rows_here, cols) for p in bucket.params]
    real = bucket.momentum[:, :rows_here]
    # Rows travel already normalized for Newton–Schulz, in its half-precision compute dtype (half
    # the bytes of float32 rows): each rank sums the squares of the rows it contributes per
    # matrix, one small all-reduce gives every matrix's ‖U‖_F, and every rank scales its own rows.
    if cfg.fraction is None:  # Muon / NorMuon: every real row goes to its matrix's owner
        update, _, norm, _ = rules.pre_step(real, grads, cfg, want_norm=True)
        plan = all_rows_plan(bucket)
        if norm is None:  # Nesterov's U = μM + G is not seen by the momentum pass
            norm = torch.linalg.vector_norm(update, dim=(-2, -1), dtype=torch.promote_types(update.dtype, torch.float32))
        partial = norm.reshape(count).square()
        unscaled, row_matrix = update, None
    else:  # Dion3: M ← M + G, select, snapshot the selected rows, decay them (error feedback)
        scores, squares = accumulate_momentum(real, grads, 1.0, scores=True, squares=True)
        if group["selection_scope"] == "local":
            plan = local_plan(bucket, scores, cfg.fraction)
        else:
            scores = gather_chunks(padded_scores(bucket, scores), mesh, traffic, "scores")
            yield
            plan = global_plan(bucket, scores.wait(), cfg.fraction)
        row_matrix = torch.div(plan.rows, chunk, rounding_mode="floor")  # plan.rows index [N·chunk]
        picked = squares[row_matrix, plan.rows - row_matrix * chunk]  # padding rows are never picked
        partial = squares.new_zeros(count).index_add_(0, row_matrix, picked)
        unscaled = None  # the snapshot happens below, scaled, once the norms are known
    scaling = input_scaling(plan.per_matrix(), cols, real.device, group["orthogonalizer"], group["ns_coefficients"],
                            real.dtype)
    total = sum_across(partial, mesh, traffic, "norms")
    yield
    factor = scaling.factor(total.wait().sqrt())  # [count]
    if row_matrix is None:
        send = scale_cast(unscaled, factor.view(count, 1, 1), scaling.dtype).view(-1, cols)
    else:  # Dion3: U = M[S] scaled per row, M[S] ← μ·M[S], in one pass (the same fused snapshot as on one device)
        flat = bucket.momentum.view(1, -1, cols)
        row_factor = factor.index_select(0, row_matrix).view(1, -1, 1)
        send = snapshot_rows(flat, plan.rows.view(1, -1), cfg.mu, row_factor, scaling.dtype)[0]
    variance = None
    if cfg.normalize:
        variance = bucket.variance[:, :rows_here].reshape(-1, 1) if plan.rows is None else (
            bucket.variance.view(-1, 1).index_select(0, plan.rows)
        )

    to_owner, from_owner = plan.send_counts(mesh.rank), plan.recv_counts(mesh.rank)
    sent_rows = exchange_rows(send, to_owner, from_owner, mesh, traffic, "rows")
    sent_variance = variance is not None and exchange_rows(variance, to_owner, from_owner, mesh, traffic, "variance")
    # The collectives keep what they send alive; this bucket's own references need not wait.
    send = update = unscaled = variance = None
    yield

    # Owner: whole matrices (or their selected rows), in ascending global row order.
    owned = len(bucket.owned(mesh.rank))
    per_matrix, slots = plan.per_matrix(), plan.slots
    # One rank receives its own rows in matrix order: the placement is the identity.
    slots = None if mesh.world_size == 1 else slots
    matrices = _place(sent_rows.wait(), slots, (owned, per_matrix, cols))
    ortho = orthogonalize(matrices, group, normalized=True)
    del matrices  # the bucket's received rows (a placed copy or the receive buffer itself)
    if sent_variance:
        old = _place(sent_variance.wait(), slots, (owned, per_matrix, 1))
        ortho, new = rules.normalize_rows(ortho, old, cfg.beta2, cfg.epsilon)
        back_variance = exchange_rows(_in_received_order(new, slots), from_owner, to_owner, mesh, traffic, "variance")
    back_rows = exchange_rows(_in_received_order(ortho, slots), from_owner, to_owner, mesh, traffic, "rows")
    del ortho
    yield

    result = back_rows.wait()
    if plan.rows is None:
        apply(bucket, result.view(count, rows_here, cols), None, group)
        if sent_variance:
            bucket.variance[:, :rows_here] = back_variance.wait().view(count, rows_here, 1)
        return
    # The fused row update, as on one device; result rows arrive in the order they were sent
    # (plan.rows: per matrix, ascending).
    mine = plan.counts[mesh.rank]
    if mine and all(c == mine[0] for c in mine):  # local scope: the same k rows of every matrix
        k = mine[0]
        local_rows = plan.rows.view(count, k) - torch.arange(count, device=result.device)[:, None] * chunk
        apply(bucket, result.view(count, k, cols), local_rows, group)
    else:  # global scope: the number of rows per local matrix varies
        apply(bucket, *padded_selection(plan.rows, result, count, chunk, rows_here, max(mine)), group)
    if sent_variance:  # Dion3 (Dion2 has no per-row normalization)
        bucket.variance.view(-1, 1).index_copy_(0, plan.rows, back_variance.wait())


def _place(received: Tensor, slots, shape: tuple[int, int, int]) -> Tensor:
    """Received rows (source-major) → [owned, per_matrix, cols]; slots None: already in place."""
    if slots is None:
        return received.view(shape)
    out = received.new_empty((shape[0] * shape[1], shape[2]))
    return out.index_copy_(0, slots, received).view(shape)


def _in_received_order(placed: Tensor, slots) -> Tensor:
    """The inverse of _place: rows back in the order they arrived, to send them back."""
    flat = placed.reshape(-1, placed.shape[-1])
    return flat if slots is None else flat.index_select(0, slots)


def replicated_step(bucket, group: dict, cfg: rules.RuleConfig, mesh: MeshInfo, traffic: Traffic):
    grads = bucket.grads(group["flatten"])
    scaling = rules.snapshot_scaling(bucket.momentum, cfg, group)
    update, rows, norm, normalized = rules.pre_step(bucket.momentum, grads, cfg, want_norm=True, scaling=scaling)
    count = update.shape[0]
    mine = owned_matrices(count, mesh.world_size, mesh.rank)
    owned_norm = None if norm is None else norm[mine.start : mine.stop]
    owned = orthogonalize(update[mine.start : mine.stop], group, owned_norm, normalized)
    # in O's dtype (the compute dtype, the same on every rank): no wider than it on the wire
    block = owned.new_zeros((-(-count // mesh.world_size), *update.shape[1:]))
    block[: len(mine)] = owned
    gathered = gather_chunks(block, mesh, traffic, "rows")
    yield

    ortho = gathered.wait().reshape(-1, *update.shape[1:])[:count]
    row_scale = None
    if cfg.normalize:  # as on one device: the per-row factors go into the fused update
        old = bucket.variance if rows is None else rules.gather_rows(bucket.variance, rows)
        row_scale, new = rules.row_normalization(ortho, old, cfg.beta2, cfg.epsilon)
        if rows is None:
            bucket.variance.copy_(new)
        else:
            rules.scatter_rows(bucket.variance, rows, new)
    apply(bucket, ortho, rows, group, row_scale)
