"""The distributed optimizer step: every bucket's matrix step (dion3.matrix_step, the one
pipeline) as a generator, interleaved so that one bucket's collectives are in flight while
another bucket computes.

Each bucket step yields right after launching a collective and resumes by waiting on it.
Every rank runs the same buckets in the same order and every bucket issues the same
collectives on every rank (also ranks holding zero rows), so collectives always match.
Sharded buckets (FSDP2 Shard(0), TP columns, strided rows, several axes, expert stacks) run
through sharded.ShardedRoute, replicated ones (DDP) through replicated.ReplicatedRoute; each
bucket over its own group (bucket.mesh): the axes that split its matrices.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch
import torch.distributed as dist

from .. import rules
from ..buckets import bucket_subset, write_back_subset
from ..matrix_step import matrix_step
from .bucket import LayoutBucket
from .exchange import Traffic
from .replicated import ReplicatedRoute
from .sharded import ShardedRoute

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
    on every rank (the admission order is the order of every group's collectives): a replicated
    bucket's state is; a sharded bucket's piece is not (uneven pieces, different expert counts
    per group), so it counts its parameters' global bytes spread over all ranks (a block of a
    fused weight: its rows' share of them). Buckets of uneven blocks (state in parameter-shaped
    pieces, stacked per step) count the stacked copy, as large as their matrices."""
    element = bucket.views[0].element_size()
    if isinstance(bucket, LayoutBucket):
        total = element * (sum(p.numel() for p in bucket.params) if bucket.cuts is None else sum(
            p.numel() * bucket.shape[0] // cut.param_rows for p, cut in zip(bucket.params, bucket.cuts)))
        return total // (dist.get_world_size() if dist.is_initialized() else 1)
    if bucket.momentum is None:
        return sum(v.numel() for v in bucket.views) * element
    return bucket.momentum.numel() * bucket.momentum.element_size()


def _bucket_step(bucket, group: dict, cfg: rules.RuleConfig, traffic: Traffic) -> Iterator:
    # the route is built when the step starts: a bucket subset's stacked state exists only then
    if isinstance(bucket, LayoutBucket):
        route = ShardedRoute(bucket, group, cfg, traffic)
    else:
        route = ReplicatedRoute(bucket, group, cfg, bucket.mesh, traffic)
    yield from matrix_step(route, group, cfg)


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
