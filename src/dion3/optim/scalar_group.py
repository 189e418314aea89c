"""One AdamW or Lion group's step with the guard (optim.scalar has the update rules): a parameter
whose gradient has a non-finite entry, on any rank holding a piece of it, skips the step; its
weights only decay, its state stays, and it counts once in the optimizer's skip tally."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import distributed
from ..buckets import SkipTally
from ..kernels import finite_on_host, host_checks_free
from . import scalar


def step_group(group: dict, params: list[Tensor], state: dict, tally: SkipTally,
               label: Callable[[Tensor], str]) -> None:
    """Step `params` (those of `group` with a gradient) with the group's algorithm and settings;
    `state` is the optimizer's per-parameter state; `label` names a parameter in errors."""
    grads = [p.grad for p in params]
    sparse = next((p for p, g in zip(params, grads) if g.is_sparse), None)
    if sparse is not None:  # before any state changes, as torch's AdamW refuses it
        raise ValueError(f"parameter {label(sparse)} has a sparse gradient, which an AdamW or Lion group cannot "
                         "step; build its module with sparse=False (e.g. nn.Embedding(..., sparse=False))")
    local_grads = [distributed.local_tensor(g) for g in grads]
    host = host_checks_free(local_grads[0].device)
    if host:  # the host may look: the bad parameters are left out of the step
        ok = torch.tensor(finite_on_host(local_grads), dtype=torch.bool)
    else:  # on the device, without a host sync: the step masks them
        ok = torch.isfinite(torch.stack(torch._foreach_norm(local_grads)).float())
    ok = distributed.agree_on_pieces(ok, params)
    tally.add(ok)
    if host:
        kept = ok.tolist()
        if not all(kept):
            decay = 1.0 - group["lr"] * group["weight_decay"]
            for p in (p for p, keep in zip(params, kept) if not keep):
                p.mul_(decay)
            params, grads = [p for p, keep in zip(params, kept) if keep], [g for g, keep in zip(grads, kept) if keep]
        ok = None
    meshes = _by_mesh(params)  # DTensor's foreach ops take one mesh at a time
    if ok is not None and len(meshes) > 1:
        ok = ok.unbind()  # one 0-d verdict per parameter, each mesh takes its own (no index tensor to copy)
    for at in meshes:
        here = [params[i] for i in at], [grads[i] for i in at], [state[params[i]] for i in at]
        if ok is None:
            _step(group, *here, None)
        else:
            _step(group, *_local(*here), ok if len(meshes) == 1 else [ok[i] for i in at])


def _step(group: dict, params: list, grads: list, states: list, ok) -> None:
    beta1, beta2 = group["betas"]
    if group["algorithm"] == "adamw":
        scalar.adamw_step(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                          [s["step"] for s in states], group["lr"], beta1, beta2, group["epsilon"],
                          group["weight_decay"], ok=ok)
    else:
        scalar.lion_step(params, grads, [s["exp_avg"] for s in states], group["lr"], beta1, beta2,
                         group["weight_decay"], ok=ok)


def _local(params: list, grads: list, states: list) -> tuple[list, list, list]:
    """The local pieces the masked step works on (a mask is not a DTensor); gradients with pending
    reductions reduced first."""
    return ([distributed.local_tensor(p) for p in params],
            [distributed.local_tensor(distributed.settled(g)) for g in grads],
            [{key: distributed.local_tensor(value) for key, value in s.items()} for s in states])


def _by_mesh(params: list) -> list[list[int]]:
    """Indices of params grouped by their DTensor mesh (plain tensors together), in order."""
    groups: dict[object, list[int]] = {}
    for index, p in enumerate(params):
        groups.setdefault(id(p.device_mesh) if distributed.is_dtensor(p) else None, []).append(index)
    return list(groups.values())
