"""Cost of orthogonalizing one matrix: the products of standard or Gram Newton–Schulz, their
FLOPs counted dense (2·n·k·m per n×k by k×m product) and as executed when symmetric products
compute only their lower-triangle tiles (T(T+1)/2 of T² tiles, T = ⌈n / tile⌉; DESIGN §4), and a
time model of a selected-row step on one H200 (modeled_seconds).

The one cost function of the package: the distributed planner's owner balance
(dion3.distributed.owners) and the tools' step-cost model (dion3.tools.bench.step_cost) count
FLOPs with it, the fractions by cost (dion3.optim.cost_fractions) spend modeled time; MatrixShape
names the matrices they price. Equal FLOPs are not equal time: products with short Gram sides
run slower per FLOP, and zero padding (ortho.padding) runs every k at its next multiple of 128.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional, Sequence, Union

import torch

from ..kernels import SYMMETRIC_MIN_N, SYMMETRIC_SPEEDUP, symmetric_kernels_available
from .coefficients import CoefficientSpec, get_schedule
from .newton_schulz import _resolve, choose_method
from .padding import ALIGN_MULTIPLE, SHORT_MULTIPLE
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



class Product(NamedTuple):
    flops: int  # dense: 2·n·k·m
    symmetric: bool  # the output is symmetric (a symmetric kernel may compute half its tiles)
    kind: str  # "gram" (n×m by its transpose), "square" (n×n by n×n) or "apply" (n×n by n×m)

# Whether symmetric kernels serve n×n outputs: a flag, or a rule of n (kernels skip small n).
Symmetric = Union[bool, Callable[[int], bool]]


def newton_schulz_products(n: int, m: int, steps: int) -> list[Product]:
    """Per step on a wide n×m X: A = XXᵀ, A² (both symmetric), then (bA + cA²)·X."""
    return [Product(2 * n * n * m, True, "gram"), Product(2 * n ** 3, True, "square"),
            Product(2 * n * n * m, False, "apply")] * steps


def gram_products(n: int, m: int, steps: int, restarts: Iterable[int]) -> list[Product]:
    """Products of Gram NS exactly as ortho.gram_newton_schulz runs them: R = XXᵀ; per step
    Z = bR + cR², Q ← QZ + aQ (none while Q = I), P and R updates (skipped on the last step and
    before a restart); a restart is X ← QX, R = XXᵀ; finally X ← QX."""
    square, gram = Product(2 * n ** 3, True, "square"), Product(2 * n * n * m, True, "gram")
    apply_q = Product(2 * n * n * m, False, "apply")
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


def orthogonalize_products(
    rows: int, cols: int, method: str, symmetric: bool, schedule: CoefficientSpec = "polar_express",
    restarts: Optional[Sequence[int]] = None,
) -> list[Product]:
    """The products that orthogonalizing one rows×cols matrix runs (wide orientation n ≤ m).
    method "auto" chooses as on a GPU whose symmetric products run SYMMETRIC_SPEEDUP times faster
    where `symmetric`."""
    n, m = min(rows, cols), max(rows, cols)
    if method == "auto":
        method = choose_method(rows, cols, SYMMETRIC_SPEEDUP if symmetric else 1.0)
    schedule = get_schedule(schedule)
    if method == "gram":
        restarts = default_restarts(schedule) if restarts is None else restarts
        return gram_products(n, m, len(schedule), restarts)
    if method == "newton_schulz":
        return newton_schulz_products(n, m, len(schedule))
    raise ValueError(f"method must be 'auto', 'newton_schulz' or 'gram', got {method!r}")


def orthogonalize_flops(
    rows: int, cols: int, method: str, symmetric: Symmetric, schedule: CoefficientSpec = "polar_express",
    restarts: Optional[Sequence[int]] = None,
) -> tuple[int, float]:
    """(dense, executed) FLOPs to orthogonalize one rows×cols matrix (see orthogonalize_products)."""
    n = min(rows, cols)
    symmetric = symmetric(n) if callable(symmetric) else bool(symmetric)
    products = orthogonalize_products(rows, cols, method, symmetric, schedule, restarts)
    share = symmetric_share(n) if symmetric else 1.0
    dense = sum(p.flops for p in products)
    return dense, sum(p.flops * share if p.symmetric else p.flops for p in products)


class TimeModel(NamedTuple):
    """Seconds per unit of a selected-row step's k-dependent work on one GPU."""

    square_flops: float  # per executed FLOP of n×n by n×n products
    long_flops: float  # per executed FLOP of products along the long side (X·Xᵀ, Q·X)
    product_bytes: float  # per byte the products read and write (bf16 operands)
    row_bytes: float  # per byte of the selected rows themselves (fp32 gather, normalize, scatter)


# Fitted (least squares of relative errors, one offset per shape for its k-independent work) to the
# Dion3 steps of benchmarks/results/k-sweep-h200-2026-12-02.json on one H200, shapes of 4096² and up
# at k ≥ 1024 or every row (184 points of 5 shapes, rms error 1.9%, largest 13%):
# `python benchmarks/k_sweep.py --fit benchmarks/results/k-sweep-h200-2026-12-02.json`.
# 650 and 694 TFLOP/s, 3.6 TB/s of product traffic, 1.8 TB/s of selected rows.
H200_TIME = TimeModel(1.539e-15, 1.441e-15, 2.770e-13, 5.498e-13)


def time_features(k: int, cols: int, method: str = "auto", schedule: CoefficientSpec = "polar_express"
                  ) -> tuple[float, float, float, float]:
    """(square FLOPs, long-side FLOPs, product bytes, selected-row bytes) of one k × cols matrix
    as a GPU runs it: on the padded buffer (Gram side to SHORT_MULTIPLE, long side to
    ALIGN_MULTIPLE: ortho.padding), symmetric products from SYMMETRIC_MIN_N at their executed tiles."""
    n = -(-min(k, cols) // SHORT_MULTIPLE) * SHORT_MULTIPLE
    m = -(-max(k, cols) // ALIGN_MULTIPLE) * ALIGN_MULTIPLE
    symmetric = h200_symmetric(n)
    share = symmetric_share(n) if symmetric else 1.0
    square = long = traffic = 0.0
    for p in orthogonalize_products(n, m, method, symmetric, schedule):
        out = share if p.symmetric else 1.0
        if p.kind == "square":
            square += p.flops * out
            traffic += 2 * (2 * n * n + n * n * out)
        elif p.kind == "gram":
            long += p.flops * out
            traffic += 2 * (n * m + n * n * out)
        else:
            long += p.flops
            traffic += 2 * (n * n + 2 * n * m)
    return square, long, traffic, 4.0 * k * cols


def modeled_seconds(k: int, cols: int, method: str = "auto", schedule: CoefficientSpec = "polar_express",
                    model: TimeModel = H200_TIME) -> float:
    """Modeled time of what one k × cols selection costs a step beyond its fixed work
    (orthogonalization and the selected rows' traffic), on the GPU `model` was fitted on."""
    return sum(w * x for w, x in zip(model, time_features(k, cols, method, schedule)))


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
