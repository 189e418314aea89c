"""The shared torch.optim front-end for Dion3, Muon and NorMuon (and their AdamW/Lion groups).

Matrix parameters of one group are bucketed by (matrix shape, dtype, device). Each bucket owns
one stacked momentum buffer [N, rows, cols] (and one per-row variance buffer [N, rows, 1] in
float32); the per-parameter optimizer state holds views into those buffers, so state_dict()
has an entry per parameter while the step runs batched over the whole bucket.

With `num_heads` / `split_sizes` (dion3.blocks) a parameter contributes one bucket entry per
block. Equal heads fold into the batch ([B, H·h, C] → [B·H, h, C], a view), so the parameter's
state stays one span of a bucket buffer. Uneven blocks land in buckets of different shapes, so
no single buffer can hold their parameter's state: there the parameter-shaped state tensor is
the owner, and each step stacks the bucket's blocks of it into a temporary buffer and copies
them back afterwards (bucket_subset / write_back_subset, as for a partial step). Every other
parameter of such a bucket owns its state the same way, so that the bucket is one stacked batch.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import distributed, matrix_step, rules
from ..buckets import Bucket, SkipTally, add_matrix, bucket_subset, matrix_view, momentum_dtype, write_back_subset
from ..ortho.precision import agree_across_ranks
from . import scalar
from .added_groups import check_names, check_unique_names, warn_of_defaults
from .foreign_state import check_not_foreign
from .scalar_group import step_group
from .validation import (
    ALIASES,
    BUDGET_KEY,
    BY_COST_KEYS,
    MATRIX_ALGORITHMS,
    NORMALIZING_ALGORITHMS,
    SCALAR_ALGORITHMS,
    SELECTING_ALGORITHMS,
    check_fractions,
    check_group_keys,
    check_flag,
    check_state_dict,
    param_label,
    validate_group,
    variance_shape,
    warn_of_allocation_change,
)


class OrthogonalOptimizer(torch.optim.Optimizer):
    """Base class; use Dion3, Muon or NorMuon."""

    def __init__(self, params, defaults: dict[str, Any], distributed_mesh=None, check_finite: bool = False):
        self.distributed_mesh = distributed_mesh
        self._mesh = distributed.resolve_mesh(distributed_mesh)  # None: single device
        self.communication_bytes = 0  # bytes this rank sent in the last step (distributed only)
        self.communication_bytes_by_kind: dict[str, int] = {}
        check_flag(type(self).__name__, "check_finite", check_finite)
        self.check_finite = check_finite
        # matrices whose update was not finite and was skipped, per device (nonfinite_updates)
        self._skipped: dict[torch.device, SkipTally] = {}
        self._step_number: dict[torch.device, Tensor] = {}  # step() calls, counted on each device
        self._last_skip: dict[torch.device, Tensor] = {}  # the latest step number that skipped a matrix
        self._seen: dict[torch.device, Tensor] = {}
        self._buckets: list[list[Bucket]] = []
        self._has_dtensors = False
        self._ready = False
        super().__init__(params, defaults)
        self._ready = True
        if self._orthogonalizes_on_cpu() and (self._mesh is not None or any(
                distributed.is_dtensor(p) for g in self.param_groups for p in g["params"])):
            # one collective, before the buckets: their owners weigh the bytes of the wire dtype
            agree_across_ranks()
        self._build_buckets()

    # ----------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        if "algorithm" in group:
            group["algorithm"] = ALIASES.get(group["algorithm"], group["algorithm"])
        if "params" not in group:
            raise ValueError(f"parameter group {len(self.param_groups)} has no 'params' entry")
        check_group_keys(group, len(self.param_groups), self.defaults)  # stricter than torch: a typo is not ignored
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        index = len(self.param_groups)
        pairs = [isinstance(p, tuple) for p in params]
        if any(pairs):  # named parameters
            if not all(pairs):
                raise ValueError(f"parameter group {index} mixes (name, tensor) pairs and bare tensors in 'params'; "
                                 "give every parameter a name or none")
            group["param_names"], params = [n for n, _ in params], [p for _, p in params]
        group["params"] = params
        names = group.get("param_names")
        check_names(group, index, self.param_groups)  # torch's own error would not say what to pass
        # where each parameter already is: (group, position); torch only warns of a repeat in one
        # group, whose step would then update the parameter twice
        placed = {id(p): (g, j) for g, other in enumerate(self.param_groups) for j, p in enumerate(other["params"])}
        for i, p in enumerate(params):
            if id(p) in placed:
                g, j = placed[id(p)]
                if g != index:
                    raise ValueError(f"parameter {param_label(names, index, i, p)} already belongs to parameter "
                                     f"group {g}; a parameter may appear in one group only")
                also = repr(names[j]) if names is not None else f"at index {j}"
                raise ValueError(f"parameter {param_label(names, None, i, p)} appears twice in parameter group "
                                 f"{index} (also {also}); list each parameter once")
            placed[id(p)] = (index, i)
        check_unique_names(names, index, self.param_groups)  # after the tensors: a repeated tensor is said as such
        super().add_param_group(group)
        group = self.param_groups[-1]
        try:
            validate_group(group, index)
        except ValueError:
            self.param_groups.pop()  # a rejected group must leave the optimizer as it was
            raise
        if self._ready:  # a group added to a built optimizer (the constructor's groups are the caller's choice)
            warn_of_defaults(param_group, group, index, self.param_groups[:-1], type(self).__name__)
            self._build_buckets()

    @property
    def nonfinite_updates(self) -> Tensor:
        """How many matrix updates this rank skipped (a 0-d int64 tensor on the parameters'
        device, counted without host syncs; read it when you log): a matrix whose gradient has a
        non-finite entry, or whose orthogonalized update is not finite or larger than any
        orthogonalization can be (rules.update_bound), skips that step as a whole. Its weights
        only decay, its per-row variance, error feedback and momentum stay as they were before
        the step (docs/errors.md, "Non-finite gradients and updates"); each skip counts once, in
        the step it happens, and `last_nonfinite_step` holds that step's number."""
        return self._sum_over_devices({device: tally.count for device, tally in self._skipped.items()})

    @property
    def last_nonfinite_step(self) -> Tensor:
        """The number (1 for the first step() call) of the latest step in which this rank skipped
        a matrix update, 0 if none did: a 0-d int64 device tensor, updated without host syncs."""
        values = list(self._last_skip.values())
        if not values:
            return torch.zeros((), dtype=torch.int64)
        latest = values[0]
        for other in values[1:]:
            latest = torch.maximum(latest, other.to(latest.device))
        return latest

    @staticmethod
    def _sum_over_devices(counters: dict) -> Tensor:
        values = list(counters.values())
        if not values:
            return torch.zeros((), dtype=torch.int64)
        total = values[0]
        for other in values[1:]:  # parameters on several devices of one process: rare
            total = total + other.to(total.device)
        return total

    def _count_step(self) -> None:
        """Count this step's skips, advance the step number and note it where this step skipped
        something (five launches per device, no host sync)."""
        for device, tally in self._skipped.items():
            tally.flush()
            counter = tally.count
            number, last, seen = self._step_number[device], self._last_skip[device], self._seen[device]
            number.add_(1)
            torch.where(counter > seen, number, last, out=last)
            seen.copy_(counter)

    def _skip_counter(self, bucket) -> None:
        """Give a bucket the skip counter of its device (shared by every bucket there)."""
        bucket.skipped = self._tally(distributed.local_tensor(bucket.params[0]).device)

    def _tally(self, device: torch.device) -> SkipTally:
        """The skip counter of a device (matrix buckets and AdamW/Lion groups there share it)."""
        if device not in self._skipped:
            self._skipped[device] = SkipTally(device)
            self._step_number[device] = torch.zeros((), dtype=torch.int64, device=device)
            self._last_skip[device] = torch.zeros((), dtype=torch.int64, device=device)
            self._seen[device] = torch.zeros((), dtype=torch.int64, device=device)  # the counter a step ago
        return self._skipped[device]

    def _param_label(self, group: dict, index: int) -> str:
        # by identity: list.index would compare group dicts, and with them their tensors
        group_index = next(i for i, g in enumerate(self.param_groups) if g is group)
        return param_label(group.get("param_names"), group_index, index, group["params"][index])

    def _build_buckets(self) -> None:
        """(Re)create the stacked state buffers, keeping any per-parameter state already present
        (after load_state_dict), and create state for every parameter up front."""
        self._buckets = []
        self._has_dtensors = any(distributed.is_dtensor(p) for g in self.param_groups for p in g["params"])
        for group in self.param_groups:
            buckets: dict[tuple, Bucket] = {}
            if self._is_distributed() and group["algorithm"] in MATRIX_ALGORITHMS:
                self._buckets.append(distributed.build_buckets(self, group, self._mesh))
                continue
            if group["algorithm"] in MATRIX_ALGORITHMS:
                for p in group["params"]:
                    add_matrix(buckets, (), p, p, group)
                self._allocate_buckets(list(buckets.values()), group)
            else:
                init = scalar.init_adamw_state if group["algorithm"] == "adamw" else scalar.init_lion_state
                for p in group["params"]:
                    fresh = init(p)
                    state = self.state[p]
                    for key, value in fresh.items():
                        state[key] = state[key].to(value.device) if key in state else value
            self._buckets.append(list(buckets.values()))
        for bucket in (b for group_buckets in self._buckets for b in group_buckets):
            self._skip_counter(bucket)

    def _allocate_buckets(self, buckets: list[Bucket], group: dict) -> None:
        """State of one group's (replicated) buckets. A bucket whose parameters each have one
        entry there and nowhere else gets stacked buffers that the state entries view; any other
        bucket (one holding uneven blocks) steps through `pieces` of parameter-shaped state."""
        entries: dict[int, int] = {}
        for bucket in buckets:
            for p in bucket.params:
                entries[id(p)] = entries.get(id(p), 0) + 1
        stacked = [all(entries[id(p)] == 1 for p in b.params) for b in buckets]
        for bucket, whole in zip(buckets, stacked):
            if whole:
                self._allocate_bucket_state(bucket, group)
        owned: dict[int, dict[str, Tensor]] = {}
        for bucket, whole in zip(buckets, stacked):
            if whole:
                continue
            bucket.pieces = {}
            for p, block in zip(bucket.params, bucket.blocks):
                if id(p) not in owned:
                    owned[id(p)] = self._allocate_param_state(p, group)
                for key, tensor in owned[id(p)].items():
                    bucket.pieces.setdefault(key, []).append(block.cut(matrix_view(tensor, group["flatten"])))

    def _allocate_param_state(self, p: Tensor, group: dict) -> dict[str, Tensor]:
        """Parameter-shaped state tensors that own the state of p (loaded values kept)."""
        local = distributed.local_tensor(p.detach())
        fresh = {"momentum": torch.zeros(p.shape, dtype=momentum_dtype(group, local.dtype), device=local.device)}
        if group["algorithm"] in NORMALIZING_ALGORITHMS:
            fresh["variance"] = torch.zeros(variance_shape(p, group["flatten"]), dtype=torch.float32, device=local.device)
        state = self.state[p]
        for key, target in fresh.items():
            if key in state:
                self._load_into(target, state[key], key, p, group)
            state[key] = target
        for key in list(state):
            if key not in fresh:
                del state[key]
        return fresh

    def _load_into(self, target: Tensor, loaded: Tensor, key: str, p: Tensor, group: dict) -> None:
        if loaded.numel() != target.numel():
            label = self._param_label(group, next(i for i, q in enumerate(group["params"]) if q is p))
            raise ValueError(
                f"state {key!r} of parameter {label} has shape {tuple(loaded.shape)}, expected "
                f"{tuple(target.shape)}; the state dict does not match these parameters"
            )
        target.copy_(loaded.reshape(target.shape))

    def _orthogonalizes_on_cpu(self) -> bool:
        return any(distributed.local_tensor(p).device.type == "cpu" for g in self.param_groups
                   if g["algorithm"] in MATRIX_ALGORITHMS for p in g["params"])

    def _is_distributed(self) -> bool:
        """A distributed_mesh was given, or some parameter is a DTensor (its own mesh is read);
        known once the buckets are built."""
        return self._mesh is not None or self._has_dtensors

    def _allocate_bucket_state(self, bucket: Bucket, group: dict) -> None:
        rows, cols = bucket.shape
        count = sum(v.shape[0] for v in bucket.views)
        like = bucket.views[0]
        bucket.momentum = torch.zeros((count, rows, cols), dtype=momentum_dtype(group, like.dtype), device=like.device)
        wants_variance = group["algorithm"] in NORMALIZING_ALGORITHMS
        if wants_variance:
            bucket.variance = torch.zeros((count, rows, 1), dtype=torch.float32, device=like.device)
        offset = 0
        for p, view in zip(bucket.params, bucket.views):
            span = slice(offset, offset + view.shape[0])
            offset += view.shape[0]
            state = self.state[p]
            targets = {"momentum": (bucket.momentum[span], p.shape)}
            if wants_variance:
                targets["variance"] = (bucket.variance[span], variance_shape(p, group["flatten"]))
            for key, (target, shape) in targets.items():
                if key in state:
                    self._load_into(target, state[key], key, p, group)
                state[key] = target.view(shape)
            for key in list(state):
                if key not in targets:
                    del state[key]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_not_foreign(state_dict, self.param_groups)  # another optimizer's (AdamW's, say): convert_state_dict
        check_state_dict(state_dict, self.param_groups)  # before torch mutates anything
        warn_of_allocation_change(state_dict, self.param_groups)
        current = [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        # torch replaces each group by the saved one: a setting the checkpoint does not have (one
        # saved before num_heads/split_sizes existed) keeps this optimizer's value. A group saved
        # with its allocation (its budget) brings the whole of it: a key of it that the checkpoint
        # lacks is not this optimizer's to keep (a most-rows flag on the fractions of a by-cost run).
        for group, before, saved in zip(self.param_groups, current, state_dict["param_groups"]):
            for key, value in before.items():
                if not (key in BY_COST_KEYS and BUDGET_KEY in saved):
                    group.setdefault(key, value)
            # check_state_dict let only this algorithm in: keep its name, not a saved alias ("nordion2")
            group["algorithm"] = before["algorithm"]
            # the state's dtype is this optimizer's choice, not the checkpoint's: a run may resume
            # with bf16 momentum from float32 state or the other way (the values are cast)
            if "momentum_dtype" in before:
                group["momentum_dtype"] = before["momentum_dtype"]
        # torch casts floating state to the parameter's dtype; restore full-precision variance.
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid, {})
            if "variance" in saved:
                self.state[p]["variance"] = saved["variance"].to(device=p.device, dtype=torch.float32)
        self._build_buckets()

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.check_finite:
            self._raise_on_nonfinite()
        check_fractions(self.param_groups)  # a group's fraction may change between steps, like lr
        alone = []  # buckets stepped on this rank by itself (no group: single device, or no mesh)
        for group, buckets in zip(self.param_groups, self._buckets):
            if group["algorithm"] in MATRIX_ALGORITHMS:
                alone += [(group, b) for b in buckets if type(b) is Bucket and b.mesh is None]
        if self._is_distributed():
            self._distributed_matrix_step()
        for group, bucket in alone:
            self._matrix_step(bucket, group)
        for group in self.param_groups:
            if group["algorithm"] in SCALAR_ALGORITHMS:
                self._scalar_step(group)
        self._count_step()
        return loss

    def _distributed_matrix_step(self) -> None:
        """All matrix buckets of all groups in one interleaved pass (dion3.distributed)."""
        work = [
            (group, bucket)
            for group, buckets in zip(self.param_groups, self._buckets)
            if group["algorithm"] in MATRIX_ALGORITHMS
            for bucket in buckets
            if type(bucket) is not Bucket or bucket.mesh is not None
        ]
        traffic = distributed.run_step(work, self.rule_config)
        self.communication_bytes = traffic.total
        self.communication_bytes_by_kind = dict(traffic.by_kind)

    def _raise_on_nonfinite(self) -> None:
        checked = [(g, i, p) for g in self.param_groups for i, p in enumerate(g["params"]) if p.grad is not None]
        if not checked:
            return
        # a sparse gradient is read whole, as a matrix group's step reads it
        grads = [_dense(distributed.local_tensor(p.grad)) for _, _, p in checked]
        # One pass per gradient: the norm is finite iff every entry is finite and the float32 norm
        # does not overflow (entries of ~1e19, whose orthogonalized update would be zero).
        finite = torch.stack([
            torch.isfinite(torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)))
            for g in grads])
        here = finite
        if self._is_distributed():  # all ranks must agree, or the others would hang in the step
            finite = distributed.all_ranks_true(finite, self._mesh)
        for ok, ok_here, grad, (group, index, _) in zip(finite.cpu().tolist(), here.cpu().tolist(), grads, checked):
            if ok:
                continue
            label = self._param_label(group, index)
            if ok_here:
                raise FloatingPointError(f"non-finite gradient (or gradient norm) in parameter {label} on another rank")
            if not bool(torch.isfinite(grad).all()):  # failure path only: which kind of failure
                raise FloatingPointError(f"non-finite gradient in parameter {label}")
            raise FloatingPointError(
                f"gradient of parameter {label} is finite but its norm overflows float32 (entries of "
                "about 1e19 or more): its orthogonalized update would be zero"
            )

    def _scalar_step(self, group: dict) -> None:
        """AdamW or Lion on one group, guarded per parameter (scalar_group.step_group)."""
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            step_group(group, params, self.state, self._tally(distributed.local_tensor(params[0].grad).device),
                       lambda p: self._param_label(group, next(i for i, q in enumerate(group["params"]) if q is p)))

    @staticmethod
    def rule_config(group: dict) -> rules.RuleConfig:
        algorithm = group["algorithm"]
        return rules.RuleConfig(
            fraction=group["fraction"] if algorithm in SELECTING_ALGORITHMS else None, mu=group["mu"],
            nesterov=group["nesterov"], normalize=algorithm in NORMALIZING_ALGORITHMS,
            beta2=group["muon_beta2"], epsilon=group["epsilon"],
            # groups saved before these options lack them
            row_score=group.get("row_score", "l1"), unselected_decay=group.get("unselected_decay", 1.0),
        )

    def _matrix_step(self, bucket: Bucket, group: dict) -> None:
        with_grad = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        if not with_grad:
            return
        if len(with_grad) < len(bucket.params) or bucket.pieces is not None:
            return self._partial_step(bucket, with_grad, group)
        cfg = self.rule_config(group)
        matrix_step.run(matrix_step.matrix_step(matrix_step.LocalRoute(bucket, group, cfg), group, cfg))

    def _partial_step(self, bucket: Bucket, keep: list[int], group: dict) -> None:
        """Only some entries of the bucket have gradients, or its state lives in parameter-shaped
        pieces (uneven blocks): step a temporary bucket holding stacked copies of the state of
        the entries `keep`, then write that state back."""
        sub, targets = bucket_subset(bucket, keep)
        self._matrix_step(sub, group)
        write_back_subset(bucket, sub, targets)


def _dense(tensor: Tensor) -> Tensor:
    return tensor.to_dense() if tensor.is_sparse else tensor
