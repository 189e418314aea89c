"""The matrix step: one staged pipeline for one bucket, run by every driver (DESIGN §7).

    pre-step and selection → to the owners [→ Dion3's unselected rows decayed, opt-in]
    → orthogonalize → gather → normalize and guard → scatter back → apply, restoring what the
    guard skipped

A route supplies the stages that depend on where the bucket's matrices live; everything else is
here, once:
  LocalRoute (one device, below): every exchange is empty;
  distributed.replicated.ReplicatedRoute (DDP): each rank orthogonalizes its 1/W of the bucket
    and `gather` all-gathers O, so every rank normalizes and guards whole matrices;
  distributed.sharded.ShardedRoute (FSDP2, TP, HSDP, expert stacks): `to_owner` is the
    all-to-all of the selected rows to each matrix's owner, who normalizes and guards them, and
    `scatter` the all-to-all back.
The stages are generators that yield right after launching a collective (the distributed step
interleaves buckets: distributed.interleave); on one device they never yield.

The guard (rules.guard) decides per matrix on the ranks that hold whole matrices: a matrix whose
gradient had a non-finite entry (its rows measure NaN in the momentum pass, so its norm and its O
are NaN) or whose O is not finite or above rules.update_bound is skipped as a whole. Its weights
only decay (decoupled weight decay does not depend on the gradient), its per-row variance keeps
its old values, its error feedback and momentum are put back as they were (rules.momentum_restore),
and it counts once in the optimizer's `nonfinite_updates`; the next finite gradient trains it.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Union

import torch
from torch import Tensor

from . import rules
from .kernels import selection_inverse
from .ortho.padding import Padded


class Owned(NamedTuple):
    """What this rank orthogonalizes: its owned matrices' U (a Padded buffer when the snapshot
    wrote Newton–Schulz's normalized input into one), with their norm when known."""

    update: Union[Tensor, Padded]
    norm: Optional[Tensor] = None
    normalized: bool = False


class Whole(NamedTuple):
    """Whole matrices' O where the guard runs, and where their variance rows live (the bucket's
    buffer at `rows`, or received rows with rows None)."""

    ortho: Tensor
    variance: Optional[Tensor]
    rows: Optional[Tensor]


class Result(NamedTuple):
    """What this rank applies to its local matrices: update rows, the local rows they go to
    (None: every row), per-row factors (None: none), and the verdict [count] bool."""

    update: Tensor
    rows: Optional[Tensor]
    row_scale: Optional[Tensor]
    ok: Tensor


def matrix_step(route, group: dict, cfg: rules.RuleConfig) -> Iterator[None]:
    """One bucket's step through `route` (module docstring)."""
    owned = yield from route.to_owner()
    if cfg.fraction is not None and cfg.unselected_decay != 1.0:  # (1: the rule, no pass over the momentum)
        decay_unselected(route.momentum, *route.selection(), cfg.unselected_decay)
    ortho = rules.orthogonalize_rows(owned.update, group["orthogonalizer"], group["ns_coefficients"], owned.norm,
                                     owned.normalized)
    whole = yield from route.gather(ortho)
    row_scale, ok = rules.guard(whole.ortho, whole.variance, whole.rows, cfg, rules.update_bound(group["ns_coefficients"]))
    result = yield from route.scatter(whole, row_scale, ok)
    rules.apply_update(route.views, result.update, result.rows, group["lr"], group["weight_decay"],
                       rules.lr_scale(group["adjust_lr"], *route.shape), result.row_scale, route.skipped, ok=result.ok,
                       restore=rules.momentum_restore(route.momentum, route.grads, cfg, route.selection))
    route.finish(result)


def decay_unselected(momentum: Tensor, positions: Optional[Tensor], fed: Optional[Tensor], decay: float) -> None:
    """Dion3's error-feedback decay of the rows the step did not select, M[~S] ← decay·M[~S]
    (RuleConfig.unselected_decay), on the rows of momentum [N, R, C] this rank holds: positions
    [N, R] (≥ 0 at the selected rows) and fed [N] (finite where the snapshot applied error
    feedback) are the route's selection. Here, after every route's selection, so that one
    device, DDP and each sharded layout decay alike. A matrix whose snapshot skipped the
    feedback (a gradient that was not finite: the guard skips it) is left alone too; for one the
    guard skips later, rules.momentum_restore divides the decay back out. One multiply by
    device values, no host sync: a captured step keeps it (decay is a constant of the graph)."""
    if positions is None or fed is None:
        return
    count, height = positions.shape
    # the factor in the momentum's math dtype (float64 momentum: decay exactly as given)
    work = torch.promote_types(momentum.dtype, torch.float32)
    per_matrix = torch.full((count, 1), decay, dtype=work, device=momentum.device)
    per_matrix.masked_fill_(fed.reshape(count, 1).isfinite().logical_not(), 1.0)
    factor = per_matrix.expand(count, height).masked_fill(positions >= 0, 1.0)
    momentum.mul_(factor.unsqueeze(-1))


def run(steps: Iterator[None]) -> None:
    """Run a step that needs no interleaving (one device) to its end."""
    for _ in steps:
        pass


class LocalRoute:
    """One device: the whole bucket here, every exchange empty."""

    def __init__(self, bucket, group: dict, cfg: rules.RuleConfig):
        self.bucket, self.group, self.cfg = bucket, group, cfg
        self.views, self.shape, self.skipped = bucket.views, bucket.shape, bucket.skipped
        self.momentum = bucket.momentum
        self.grads = bucket.grads(group["flatten"])
        self.pre: Optional[rules.PreStep] = None

    def pre_step(self) -> rules.PreStep:
        """Momentum, selection and the snapshot of the whole bucket (rules.pre_step)."""
        momentum, cfg = self.momentum, self.cfg
        self.pre = rules.pre_step(momentum, self.grads, cfg, want_norm=True,
                                  scaling=rules.snapshot_scaling(momentum, cfg, self.group))
        return self.pre

    def to_owner(self) -> Iterator[None]:
        pre = self.pre_step()
        return Owned(pre.update, pre.norm, pre.normalized)
        yield  # a generator without exchanges

    def gather(self, ortho: Tensor) -> Iterator[None]:
        return Whole(ortho, self.bucket.variance, self.pre.rows)
        yield

    def scatter(self, whole: Whole, row_scale: Optional[Tensor], ok: Tensor) -> Iterator[None]:
        return Result(whole.ortho, self.pre.rows, row_scale, ok)
        yield

    def finish(self, result: Result) -> None:
        """Nothing left: the guard wrote the variance in place."""

    def selection(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """(the selection's inverse [N, R] (≥ 0 at selected rows), the norms the snapshot's
        factors came from, [N]: finite where it applied error feedback), or (None, None)."""
        rows, norm = self.pre.rows, self.pre.norm
        if rows is None or norm is None:
            return None, None
        return selection_inverse(rows, self.momentum.shape[1]), norm.reshape(-1)
