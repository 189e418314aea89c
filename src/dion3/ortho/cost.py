"""FLOPs of orthogonalizing one matrix: the products of standard or Gram Newton–Schulz, counted
dense (2·n·k·m per n×k by k×m product) and as executed when symmetric products compute only
their lower-triangle tiles (T(T+1)/2 of T² tiles, T = ⌈n / tile⌉; DESIGN §4).

The one cost function of the package: the fractions by cost (dion3.optim.cost_fractions), the
distributed planner's owner balance (dion3.distributed.owners) and the tools' step-cost model
(dion3.tools.bench.step_cost) all count with it; MatrixShape names the matrices they price.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from ..kernels import SYMMETRIC_MIN_N, SYMMETRIC_SPEEDUP, symmetric_kernels_available
from .coefficients import CoefficientSpec, get_schedule
from .newton_schulz import _resolve, choose_method
from .restarts import default_restarts

@dataclass(frozen=True)
class MatrixShape:
    """`count` matrices of shape rows × cols (one parameter each)."""

    name: str
    rows: int
    cols: int
    count: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


def h200_symmetric(n: int) -> bool:
    """The dispatch rule of dion3.kernels on a GPU with Triton: symmetric kernel from n ≥ SYMMETRIC_MIN_N."""
    return n >= SYMMETRIC_MIN_N


SYMMETRIC_TILE = 128
H200_MATMUL_FLOPS = 790e12  # bf16 dense matmul, measured

Product = tuple[int, bool]  # (dense FLOPs, output symmetric)
# Whether symmetric kernels serve n×n outputs: a flag, or a rule of n (kernels skip small n).
Symmetric = Union[bool, Callable[[int], bool]]


def newton_schulz_products(n: int, m: int, steps: int) -> list[Product]:
    """Per step on a wide n×m X: A = XXᵀ, A² (both symmetric), then (bA + cA²)·X."""
    return [(2 * n * n * m, True), (2 * n ** 3, True), (2 * n * n * m, False)] * steps


def gram_products(n: int, m: int, steps: int, restarts: Iterable[int]) -> list[Product]:
    """Products of Gram NS exactly as ortho.gram_newton_schulz runs them: R = XXᵀ; per step
    Z = bR + cR², Q ← QZ + aQ (none while Q = I), P and R updates (skipped on the last step and
    before a restart); a restart is X ← QX, R = XXᵀ; finally X ← QX."""
    square, gram, apply_q = (2 * n ** 3, True), (2 * n * n * m, True), (2 * n * n * m, False)
    restart_after = set(restarts)
    products, q_is_identity = [gram], True
    for i in range(1, steps + 1):
        products.append(square)  # Z
        if not q_is_identity:
            products.append(square)  # Q·Z
        q_is_identity = False
        if i == steps:
            break
        if i in restart_after:
            products += [apply_q, gram]
            q_is_identity = True
        else:
            products += [square, square]  # P, R
    return products + ([] if q_is_identity else [apply_q])


def symmetric_share(n: int, tile: int = SYMMETRIC_TILE) -> float:
    """Fraction of an n×n output's tiles on or below the diagonal."""
    tiles = math.ceil(n / tile)
    return (tiles + 1) / (2 * tiles)


def orthogonalize_flops(
    rows: int, cols: int, method: str, symmetric: Symmetric, schedule: CoefficientSpec = "polar_express",
    restarts: Optional[Sequence[int]] = None,
) -> tuple[int, float]:
    """(dense, executed) FLOPs to orthogonalize one rows×cols matrix. method "auto" chooses as
    on a GPU whose symmetric products run SYMMETRIC_SPEEDUP times faster where `symmetric`."""
    n, m = min(rows, cols), max(rows, cols)
    symmetric = symmetric(n) if callable(symmetric) else bool(symmetric)
    if method == "auto":
        method = choose_method(rows, cols, SYMMETRIC_SPEEDUP if symmetric else 1.0)
    schedule = get_schedule(schedule)
    if method == "gram":
        restarts = default_restarts(schedule) if restarts is None else restarts
        products = gram_products(n, m, len(schedule), restarts)
    elif method == "newton_schulz":
        products = newton_schulz_products(n, m, len(schedule))
    else:
        raise ValueError(f"method must be 'auto', 'newton_schulz' or 'gram', got {method!r}")
    share = symmetric_share(n) if symmetric else 1.0
    dense = sum(f for f, _ in products)
    return dense, sum(f * share if sym else f for f, sym in products)


def step_flops(rows: int, cols: int, device, method: str = "auto", schedule: CoefficientSpec = "polar_express",
               input_dtype: torch.dtype = torch.float32) -> float:
    """Executed FLOPs of what orthogonalize runs on a rows×cols input on this device: the method
    "auto" resolves to there (as the step resolves it), with symmetric kernels where the device
    serves them at this size. The meta device (planning a run without its devices) counts as a
    GPU with the symmetric kernels from SYMMETRIC_MIN_N."""
    device = torch.device(device)
    if device.type == "meta":
        return orthogonalize_flops(rows, cols, method, lambda n: n >= SYMMETRIC_MIN_N, schedule)[1]
    chosen = _resolve(rows, cols, device, method, input_dtype)
    symmetric = symmetric_kernels_available(device, min(rows, cols))
    return orthogonalize_flops(rows, cols, chosen, symmetric, schedule)[1]
