"""AdamW and Lion for the parameters that should not be orthogonalized (embeddings, norms,
biases, LM head). Multi-tensor (foreach) and free of host syncs, so they run inside a captured
CUDA graph; `lr` may be a float or a 0-d tensor.

The guard, as for the matrices: a parameter whose gradient has a non-finite entry skips the step
(its weights only decay; its moments and step count stay as they were). The optimizer either
leaves such parameters out of the lists (where the host may look at the gradients: CPU tensors),
or passes `ok`, one 0-d bool tensor per parameter on the device, and the step masks them itself: their
gradient is replaced by what leaves each moment unchanged (lerp(m, m, w) = m exactly), their step
count does not advance and their update is zero, without a host sync."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

Scalar = Union[float, Tensor]


def init_adamw_state(param: Tensor) -> dict[str, Tensor]:
    return {
        # float32 on the parameter's device: exact counts up to 2**24 and capturable
        "step": torch.zeros((), dtype=torch.float32, device=param.device),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


def init_lion_state(param: Tensor) -> dict[str, Tensor]:
    return {"exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format)}


def _one_minus_power(beta: float, steps: list[Tensor]) -> list[Tensor]:
    """[1 − β^t for each step count t], accurate to a few float32 ulps even for β near 1."""
    out = torch._foreach_mul(steps, math.log(beta))
    torch._foreach_expm1_(out)
    torch._foreach_neg_(out)
    return out


def adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    lr: Scalar,
    beta1: float,
    beta2: float,
    epsilon: float,
    weight_decay: Scalar,
    ok: Optional[Sequence[Tensor]] = None,
) -> None:
    """Decoupled-weight-decay Adam, the same update as torch.optim.AdamW. ok (one 0-d bool tensor
    per parameter): skip those that are False (module docstring); their weights still decay."""
    if not params:
        return
    if ok is None:
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    else:
        kept = list(ok)
        torch._foreach_add_(steps, list(torch.stack(kept).to(steps[0].dtype).unbind()))
        torch._foreach_lerp_(exp_avgs, _or_state(kept, grads, exp_avgs), 1.0 - beta1)
        torch._foreach_lerp_(exp_avg_sqs, _or_state(kept, torch._foreach_mul(grads, grads), exp_avg_sqs), 1.0 - beta2)
    if isinstance(weight_decay, Tensor) or weight_decay != 0.0:  # tensors: no host sync
        _foreach_scale_(params, 1.0 - lr * weight_decay)
    # bias corrections as tensors: 1 − β^t = −expm1(t·ln β). Not 1 − pow(β, t): in float32 that
    # subtraction cancels (1 − 0.95 keeps 1e-6 relative error), expm1 keeps a few ulps
    correction1 = _one_minus_power(beta1, steps)
    correction2 = _one_minus_power(beta2, steps)
    torch._foreach_sqrt_(correction2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, correction2)
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(exp_avgs, denom)
    torch._foreach_div_(update, correction1)
    _foreach_scale_(update, lr)
    if ok is not None:
        update = _or_zero(kept, update)
    torch._foreach_sub_(params, update)


def _or_state(kept: Sequence[Tensor], values: list[Tensor], state: list[Tensor]) -> list[Tensor]:
    """values where the parameter is kept, else its state (a lerp towards it leaves it as it is)."""
    return [torch.where(keep, value, current) for keep, value, current in zip(kept, values, state)]


def _or_zero(kept: Sequence[Tensor], values: list[Tensor]) -> list[Tensor]:
    """values where the parameter is kept, else 0. One 0-d zero per dtype and device for all of
    them: a Python 0.0 would build a scalar tensor on every call (host time of eager steps)."""
    zeros: dict = {}
    out = []
    for keep, value in zip(kept, values):
        zero = zeros.get((value.dtype, value.device))
        if zero is None:
            zero = zeros[(value.dtype, value.device)] = value.new_zeros(())
        out.append(torch.where(keep, value, zero))
    return out


def lion_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    lr: Scalar,
    beta1: float,
    beta2: float,
    weight_decay: Scalar,
    ok: Optional[Sequence[Tensor]] = None,
) -> None:
    """Lion: X ← (1 − lr·λ)X − lr·sign(β₁m + (1−β₁)g); m ← β₂m + (1−β₂)g. ok: as adamw_step."""
    if not params:
        return
    if ok is not None:
        kept = list(ok)
        grads = _or_state(kept, grads, exp_avgs)
    update = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(update)
    if ok is not None:
        update = _or_zero(kept, update)
    if isinstance(weight_decay, Tensor) or weight_decay != 0.0:  # tensors: no host sync
        _foreach_scale_(params, 1.0 - lr * weight_decay)
    _foreach_scale_(update, lr)
    torch._foreach_sub_(params, update)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)


def _foreach_scale_(tensors: list[Tensor], factor: Scalar) -> None:
    if isinstance(factor, Tensor):
        torch._foreach_mul_(tensors, factor.to(tensors[0].device))
    else:
        torch._foreach_mul_(tensors, factor)
