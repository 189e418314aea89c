"""The shared torch.optim front-end for Dion3, Muon and NorMuon (and their AdamW/Lion groups).

Matrix parameters of one group are bucketed by (matrix shape, dtype, device). Each bucket owns
one stacked momentum buffer [N, rows, cols] (and one per-row variance buffer [N, rows, 1] in
float32); the per-parameter optimizer state holds views into those buffers, so state_dict()
has an entry per parameter while the step runs batched over the whole bucket.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .. import distributed, rules
from ..ortho import get_schedule
from ..ortho.newton_schulz import METHODS
from . import scalar

MATRIX_ALGORITHMS = ("dion3", "muon", "normuon")
SCALAR_ALGORITHMS = ("adamw", "lion")
ALIASES = {"nordion2": "dion3"}
SCOPES = ("local", "global")


@dataclass
class Bucket:
    """Same-shape matrices of one group, orthogonalized together."""

    shape: tuple[int, int]  # (rows, cols) of each matrix
    params: list[Tensor] = field(default_factory=list)
    views: list[Tensor] = field(default_factory=list)  # each param as [B_i, rows, cols]
    momentum: Optional[Tensor] = None  # [N, rows, cols]
    variance: Optional[Tensor] = None  # [N, rows, 1] float32 (NorMuon / Dion3)


def matrix_view(tensor: Tensor, flatten: bool) -> Tensor:
    """A parameter (or its gradient) as a batch of matrices [B, rows, cols]."""
    if flatten:
        return tensor.reshape(1, tensor.shape[0], -1)
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor


class OrthogonalOptimizer(torch.optim.Optimizer):
    """Base class; use Dion3, Muon or NorMuon."""

    def __init__(self, params, defaults: dict[str, Any], distributed_mesh=None, check_finite: bool = False):
        self.distributed_mesh = distributed_mesh
        self._mesh = distributed.resolve_mesh(distributed_mesh)  # None: single device
        self.communication_bytes = 0  # bytes this rank sent in the last step (distributed only)
        self.communication_bytes_by_kind: dict[str, int] = {}
        self.check_finite = bool(check_finite)
        self._buckets: list[list[Bucket]] = []
        self._ready = False
        super().__init__(params, defaults)
        self._ready = True
        self._build_buckets()

    # ----------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        if "algorithm" in group:
            group["algorithm"] = ALIASES.get(group["algorithm"], group["algorithm"])
        if "params" not in group:
            raise ValueError(f"parameter group {len(self.param_groups)} has no 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        names = None
        if params and isinstance(params[0], tuple):  # named parameters
            names, params = [n for n, _ in params], [p for _, p in params]
        group["params"] = params
        if names is not None:  # torch checks that all groups are named or none is
            group["param_names"] = names
        index = len(self.param_groups)
        seen = {id(p): g for g, other in enumerate(self.param_groups) for p in other["params"]}
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(
                    f"parameter {self._label(names, index, i, p)} already belongs to parameter group "
                    f"{seen[id(p)]}; a parameter may appear in one group only"
                )
        super().add_param_group(group)
        group = self.param_groups[-1]
        try:
            self._validate_group(group, index)
        except ValueError:
            self.param_groups.pop()  # a rejected group must leave the optimizer as it was
            raise
        if self._ready:
            self._build_buckets()

    @staticmethod
    def _label(names, group_index: int, index: int, param: Tensor) -> str:
        if names is not None:
            return repr(names[index])
        return f"{index} of group {group_index} (shape {tuple(param.shape)})"

    def _param_label(self, group: dict, index: int) -> str:
        # by identity: list.index would compare group dicts, and with them their tensors
        group_index = next(i for i, g in enumerate(self.param_groups) if g is group)
        return self._label(group.get("param_names"), group_index, index, group["params"][index])

    def _validate_group(self, group: dict, index: int) -> None:
        where = f"parameter group {index}"
        algorithm = group["algorithm"]
        if algorithm not in MATRIX_ALGORITHMS + SCALAR_ALGORITHMS:
            raise ValueError(
                f"{where}: unknown algorithm {algorithm!r}; expected one of "
                f"{MATRIX_ALGORITHMS + SCALAR_ALGORITHMS} (or the alias 'nordion2')"
            )
        lr = group["lr"]
        lr_value = float(lr) if isinstance(lr, Tensor) and lr.numel() == 1 else lr
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError(f"{where}: lr tensor must hold one value, got shape {tuple(lr.shape)}")
        if not isinstance(lr_value, (int, float)) or not math.isfinite(lr_value) or lr_value < 0:
            raise ValueError(f"{where}: lr must be a finite number ≥ 0, got {lr!r}")
        _check_range(where, "weight_decay", group["weight_decay"], 0.0, math.inf)
        _check_range(where, "epsilon", group["epsilon"], 0.0, math.inf, low_open=True)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        for name, value in zip(("betas[0]", "betas[1]"), betas):
            _check_range(where, name, value, 0.0, 1.0, high_open=True)
        if algorithm in SCALAR_ALGORITHMS:
            return
        _check_range(where, "mu", group["mu"], 0.0, 1.0, high_open=True)
        _check_range(where, "muon_beta2", group["muon_beta2"], 0.0, 1.0, high_open=True)
        _check_range(where, "fraction", group["fraction"], 0.0, 1.0, low_open=True)
        if group["adjust_lr"] not in rules.ADJUST_LR:
            raise ValueError(f"{where}: unknown adjust_lr {group['adjust_lr']!r}; expected one of {rules.ADJUST_LR}")
        if group["orthogonalizer"] not in METHODS:
            raise ValueError(f"{where}: unknown orthogonalizer {group['orthogonalizer']!r}; expected one of {METHODS}")
        if group["selection_scope"] not in SCOPES:
            raise ValueError(f"{where}: unknown selection_scope {group['selection_scope']!r}; expected one of {SCOPES}")
        if algorithm == "dion3" and group["nesterov"]:
            raise ValueError(f"{where}: Dion3 has no Nesterov variant; use nesterov=False")
        get_schedule(group["ns_coefficients"])  # raises on unknown names
        for i, p in enumerate(group["params"]):
            label = self._label(group.get("param_names"), index, i, p)
            if not p.is_floating_point():
                raise ValueError(
                    f"{where}: parameter {label} has dtype {p.dtype}, but algorithm {algorithm!r} "
                    "needs real floating-point matrices (float32, bfloat16, float16, float64)"
                )
            if p.dim() >= 2 and 0 in p.shape:  # topk and the NS normalization need ≥ 1 row and column
                raise ValueError(f"{where}: parameter {label} is empty (a dimension is 0); leave it out")
            if group["flatten"] and p.dim() >= 2:
                continue
            if p.dim() not in (2, 3):
                hint = (
                    "put 1-D parameters (biases, norms) in an 'adamw' or 'lion' group"
                    if p.dim() < 2
                    else "pass flatten=True to treat it as a matrix (e.g. conv weights)"
                )
                raise ValueError(
                    f"{where}: parameter {label} is "
                    f"{p.dim()}-D, but algorithm {algorithm!r} needs 2-D matrices or 3-D batches of "
                    f"matrices; {hint}"
                )

    def _build_buckets(self) -> None:
        """(Re)create the stacked state buffers, keeping any per-parameter state already present
        (after load_state_dict), and create state for every parameter up front."""
        self._buckets = []
        for group in self.param_groups:
            buckets: dict[tuple, Bucket] = {}
            if self._mesh is not None and group["algorithm"] in MATRIX_ALGORITHMS:
                self._buckets.append(distributed.build_buckets(self, group, self._mesh))
                continue
            if group["algorithm"] in MATRIX_ALGORITHMS:
                for p in group["params"]:
                    view = matrix_view(p.detach(), group["flatten"])
                    key = (tuple(view.shape[1:]), p.dtype, p.device)
                    bucket = buckets.setdefault(key, Bucket(shape=key[0]))
                    bucket.params.append(p)
                    bucket.views.append(view)
                for bucket in buckets.values():
                    self._allocate_bucket_state(bucket, group)
            else:
                init = scalar.init_adamw_state if group["algorithm"] == "adamw" else scalar.init_lion_state
                for p in group["params"]:
                    fresh = init(p)
                    state = self.state[p]
                    for key, value in fresh.items():
                        state[key] = state[key].to(value.device) if key in state else value
            self._buckets.append(list(buckets.values()))

    def _allocate_bucket_state(self, bucket: Bucket, group: dict) -> None:
        rows, cols = bucket.shape
        count = sum(v.shape[0] for v in bucket.views)
        like = bucket.views[0]
        bucket.momentum = torch.zeros((count, rows, cols), dtype=like.dtype, device=like.device)
        wants_variance = group["algorithm"] != "muon"
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
                    loaded = state[key]
                    if loaded.numel() != target.numel():
                        raise ValueError(
                            f"state {key!r} of parameter with shape {tuple(p.shape)} has shape "
                            f"{tuple(loaded.shape)}; the state dict does not match these parameters"
                        )
                    target.copy_(loaded.reshape(target.shape))
                state[key] = target.view(shape)
            for key in list(state):
                if key not in targets:
                    del state[key]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict(state_dict)  # before torch mutates anything
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; restore full-precision variance.
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid, {})
            if "variance" in saved:
                self.state[p]["variance"] = saved["variance"].to(device=p.device, dtype=torch.float32)
        self._build_buckets()

    def _check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError unless state_dict has, for every parameter, each state entry its
        (saved) algorithm needs with the parameter's shape."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("state dict must have 'state' and 'param_groups' entries (from optimizer.state_dict())")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(saved_groups)} parameter groups but this optimizer has "
                f"{len(self.param_groups)}; the state dict does not match these parameters"
            )
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"parameter group {index} of the state dict has {len(saved['params'])} parameters but "
                    f"this optimizer's has {len(group['params'])}; the state dict does not match these parameters"
                )
            algorithm = ALIASES.get(saved.get("algorithm"), saved.get("algorithm", group["algorithm"]))
            flatten = saved.get("flatten", group.get("flatten", False))
            for i, (pid, p) in enumerate(zip(saved["params"], group["params"])):
                entry = state_dict["state"].get(pid, {})
                for key, shape in expected_state_shapes(algorithm, p, flatten).items():
                    if key not in entry:
                        raise ValueError(
                            f"state dict has no {key!r} for parameter {self._label(group.get('param_names'), index, i, p)} "
                            f"of group {index} ({algorithm}); the state dict does not match these parameters"
                        )
                    found = tuple(entry[key].shape) if isinstance(entry[key], Tensor) else ()
                    if math.prod(found) != math.prod(shape) or (len(shape) > 0 and found != shape):
                        raise ValueError(
                            f"state {key!r} of parameter {self._label(group.get('param_names'), index, i, p)} "
                            f"has shape {found} in the state dict, expected {shape}; the state dict does not "
                            "match these parameters"
                        )

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.check_finite:
            self._raise_on_nonfinite()
        if self._mesh is not None:
            self._distributed_matrix_step()
        for group, buckets in zip(self.param_groups, self._buckets):
            if group["algorithm"] in SCALAR_ALGORITHMS:
                self._scalar_step(group)
            elif self._mesh is None:
                for bucket in buckets:
                    self._matrix_step(bucket, group)
        return loss

    def _distributed_matrix_step(self) -> None:
        """All matrix buckets of all groups in one interleaved pass (dion3.distributed)."""
        work = [
            (group, bucket)
            for group, buckets in zip(self.param_groups, self._buckets)
            if group["algorithm"] in MATRIX_ALGORITHMS
            for bucket in buckets
        ]
        traffic = distributed.run_step(work, self.rule_config, self._mesh)
        self.communication_bytes = traffic.total
        self.communication_bytes_by_kind = dict(traffic.by_kind)

    def _raise_on_nonfinite(self) -> None:
        checked = [(g, i, p) for g in self.param_groups for i, p in enumerate(g["params"]) if p.grad is not None]
        if not checked:
            return
        finite = torch.stack([torch.isfinite(distributed.local_tensor(p.grad)).all() for _, _, p in checked])
        if self._mesh is not None:  # all ranks must agree, or the others would hang in the step
            finite = distributed.all_ranks_true(finite, self._mesh)
        finite = finite.cpu().tolist()
        for ok, (group, index, _) in zip(finite, checked):
            if not ok:
                raise FloatingPointError(f"non-finite gradient in parameter {self._param_label(group, index)}")

    def _scalar_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        beta1, beta2 = group["betas"]
        if group["algorithm"] == "adamw":
            scalar.adamw_step(
                params, grads,
                [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params],
                [self.state[p]["step"] for p in params],
                group["lr"], beta1, beta2, group["epsilon"], group["weight_decay"],
            )
        else:
            scalar.lion_step(
                params, grads, [self.state[p]["exp_avg"] for p in params],
                group["lr"], beta1, beta2, group["weight_decay"],
            )

    @staticmethod
    def rule_config(group: dict) -> rules.RuleConfig:
        algorithm = group["algorithm"]
        return rules.RuleConfig(
            fraction=group["fraction"] if algorithm == "dion3" else None,
            mu=group["mu"],
            nesterov=group["nesterov"],
            normalize=algorithm != "muon",
            beta2=group["muon_beta2"],
            epsilon=group["epsilon"],
        )

    def _matrix_step(self, bucket: Bucket, group: dict) -> None:
        with_grad = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        if not with_grad:
            return
        if len(with_grad) < len(bucket.params):
            return self._partial_step(bucket, with_grad, group)
        cfg = self.rule_config(group)
        grads = [matrix_view(p.grad, group["flatten"]) for p in bucket.params]
        update, rows = rules.pre_step(bucket.momentum, grads, cfg)
        variance = None
        if cfg.normalize:
            variance = bucket.variance if rows is None else rules.gather_rows(bucket.variance, rows)
        ortho, variance = self._orthogonalize(update, variance, cfg, group)
        if variance is not None:
            if rows is None:
                bucket.variance.copy_(variance)
            else:
                rules.scatter_rows(bucket.variance, rows, variance)
        scale = rules.lr_scale(group["adjust_lr"], *bucket.shape)
        rules.apply_update(bucket.views, ortho, rows, group["lr"], group["weight_decay"], scale)

    def _orthogonalize(
        self, update: Tensor, variance: Optional[Tensor], cfg: rules.RuleConfig, group: dict
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Orthogonalize U [N, k, cols] and, for NorMuon/Dion3, normalize its rows."""
        ortho = rules.orthogonalize_rows(update, group["orthogonalizer"], group["ns_coefficients"])
        if variance is None:
            return ortho, None
        return rules.normalize_rows(ortho, variance, cfg.beta2, cfg.epsilon)

    @staticmethod
    def _offsets(bucket: Bucket) -> list[int]:
        offsets = [0]
        for view in bucket.views:
            offsets.append(offsets[-1] + view.shape[0])
        return offsets

    def _partial_step(self, bucket: Bucket, keep: list[int], group: dict) -> None:
        """Rare path: only some parameters of the bucket have gradients. Step a temporary
        bucket holding copies of their state, then write that state back."""
        offsets = self._offsets(bucket)
        spans = [slice(offsets[i], offsets[i + 1]) for i in keep]
        sub = Bucket(shape=bucket.shape)
        sub.params = [bucket.params[i] for i in keep]
        sub.views = [bucket.views[i] for i in keep]
        sub.momentum = torch.cat([bucket.momentum[s] for s in spans])
        if bucket.variance is not None:
            sub.variance = torch.cat([bucket.variance[s] for s in spans])
        self._matrix_step(sub, group)
        start = 0
        for span in spans:
            stop = start + span.stop - span.start
            bucket.momentum[span].copy_(sub.momentum[start:stop])
            if bucket.variance is not None:
                bucket.variance[span].copy_(sub.variance[start:stop])
            start = stop


def variance_shape(param: Tensor, flatten: bool) -> tuple[int, ...]:
    """Shape of a parameter's per-row second moment: one value per matrix row."""
    return (param.shape[0], 1) if flatten else (*param.shape[:-1], 1)


def expected_state_shapes(algorithm: str, param: Tensor, flatten: bool) -> dict[str, tuple[int, ...]]:
    """The state entries (and their shapes) the optimizer keeps for param under algorithm."""
    shape = tuple(param.shape)
    if algorithm == "adamw":
        return {"step": (), "exp_avg": shape, "exp_avg_sq": shape}
    if algorithm == "lion":
        return {"exp_avg": shape}
    if algorithm == "muon":
        return {"momentum": shape}
    return {"momentum": shape, "variance": variance_shape(param, flatten)}


def _check_range(where, name, value, low, high, low_open=False, high_open=False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{where}: {name} must lie in {lo}{low}, {high}{hi}, got {value!r}")
