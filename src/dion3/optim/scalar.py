"""AdamW and Lion for the parameters that should not be orthogonalized (embeddings, norms,
biases, LM head). AdamW through torch's fused kernel, Lion multi-tensor (foreach); both free of
host syncs, so they run inside a captured CUDA graph; `lr` may be a float or a 0-d tensor.

The guard, as for the matrices: a parameter whose gradient has a non-finite entry skips the step
(its weights only decay; its moments and step count stay as they were). The optimizer either
leaves such parameters out of the lists (where the host may look at the gradients: CPU tensors),
or passes `ok`, one verdict per parameter on the device ([N] bool, or 0-d bools), and the step
masks them itself, without a host sync: AdamW hands each parameter's verdict to the fused kernel (found_inf), Lion
replaces the gradient by what leaves its moment unchanged (lerp(m, m, w) = m exactly) and zeroes
the update; step counts do not advance."""
from __future__ import annotations

from typing import Sequence, Union

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
    ok: Union[Tensor, Sequence[Tensor], None] = None,
) -> None:
    """Decoupled-weight-decay Adam, the update of torch.optim.AdamW(fused=True): torch's fused
    kernel reads each parameter, its gradient and its moments once (the foreach form took about a
    dozen passes, ten times the CPU time on embedding-sized tensors). The weights decay first, every
    parameter's, with one multiply; the kernel then runs without weight decay. Its bias corrections
    are 1 − β^t in the parameter's precision, as torch's.
    ok ([N] bool, or one 0-d bool tensor per parameter): skip those that are False (module docstring). Each
    parameter is then its own kernel call, whose found_inf is its verdict: the kernel leaves a
    skipped parameter and its moments as they were, and its step count advances by the verdict."""
    if not params:
        return
    if isinstance(weight_decay, Tensor) or weight_decay != 0.0:  # tensors: no host sync
        _foreach_scale_(params, 1.0 - lr * weight_decay)
    if ok is None:
        torch._foreach_add_(steps, 1.0)
        calls = [(at, None) for at in _by_dtype_and_device(params)]
    else:
        kept = (ok if isinstance(ok, Tensor) else torch.stack(list(ok))).to(steps[0].dtype)
        torch._foreach_add_(steps, list(kept.unbind()))
        skipped = (1.0 - kept).unbind()  # found_inf: 1 leaves the parameter
        calls = [([i], skipped[i]) for i in range(len(params))]
    rates: dict = {}  # a tensor lr moved to each device once, not once per call
    for at, found_inf in calls:
        device = params[at[0]].device
        if device not in rates:
            rates[device] = lr.to(device) if isinstance(lr, Tensor) else lr
        torch._fused_adamw_([params[i] for i in at], [grads[i] for i in at], [exp_avgs[i] for i in at],
                            [exp_avg_sqs[i] for i in at], [], [steps[i] for i in at], lr=rates[device], beta1=beta1, beta2=beta2,
                            weight_decay=0.0, eps=epsilon, amsgrad=False, maximize=False, found_inf=found_inf)


def _by_dtype_and_device(tensors: list[Tensor]) -> list[list[int]]:
    """Indices of tensors with one dtype and device each (a fused call takes one of each), in order."""
    groups: dict[tuple, list[int]] = {}
    for index, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(index)
    return list(groups.values())


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
    ok: Union[Tensor, Sequence[Tensor], None] = None,
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
