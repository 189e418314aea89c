"""Restart autotuning for Gram Newton–Schulz.

In half precision the Gram matrix R picks up spurious eigenvalues of size ≈δ (negative ones
included) that the NS polynomial amplifies. Gram NS acts on each singular value σ through the
scalar recursion r ← r·(a + b·r + c·r²)², q ← q·(a + b·r + c·r²), with r = σ² at a (re)start.
We simulate it over a spectrum 1…1e-10 with r perturbed by −δ, 0, +δ at every (re)start and
pick the restart positions that minimize the worst condition number max|q| / min|q| of the
accumulated Q over all segments.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import combinations

import numpy as np

from .coefficients import CoefficientSpec, Schedule, get_schedule

DEFAULT_DELTA = 4e-4  # size of spurious eigenvalues of R seen in fp16


def worst_condition(schedule: Schedule, restarts: tuple[int, ...], delta: float = DEFAULT_DELTA) -> float:
    """Worst condition number of Q over segments and perturbations for these restart positions."""
    sigma = np.logspace(0.0, -10.0, 241) / schedule.norm_scale
    bounds = [0, *sorted(restarts), len(schedule)]
    worst = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        for sign in (-1.0, 0.0, 1.0):
            s = sigma.copy()
            for start, stop in zip(bounds[:-1], bounds[1:]):
                r = s * s + sign * delta
                q = np.ones_like(s)
                for a, b, c in schedule.steps[start:stop]:
                    factor = a + b * r + c * r * r
                    q = q * factor
                    r = r * factor * factor
                magnitude = np.abs(q)
                if not np.all(np.isfinite(magnitude)) or magnitude.min() == 0.0:
                    return float("inf")
                worst = max(worst, float(magnitude.max() / magnitude.min()))
                s = magnitude * s
    return worst


def autotune_restarts(
    coefficients: CoefficientSpec = "polar_express", num_restarts: int = 1, delta: float = DEFAULT_DELTA
) -> tuple[tuple[int, ...], float]:
    """Return (restart positions, worst condition number of Q) minimizing that condition number.

    Positions are step counts after which Gram NS restarts, each in 1..T−1 for a T-step schedule.
    """
    schedule = get_schedule(coefficients)
    if num_restarts < 0:
        raise ValueError(f"num_restarts must be ≥ 0, got {num_restarts}")
    if num_restarts > len(schedule) - 1:
        raise ValueError(f"a {len(schedule)}-step schedule allows at most {len(schedule) - 1} restarts")
    best: tuple[tuple[int, ...], float] = ((), float("inf"))
    for positions in combinations(range(1, len(schedule)), num_restarts):
        cond = worst_condition(schedule, positions, delta)
        if cond < best[1]:
            best = (positions, cond)
    if not best[0] and num_restarts > 0:  # every choice overflowed; keep a valid answer
        best = (tuple(range(1, num_restarts + 1)), best[1])
    return best


@lru_cache(maxsize=None)
def _default_for(schedule: Schedule) -> tuple[int, ...]:
    if len(schedule) < 3:
        return ()
    return autotune_restarts(schedule, 1)[0]


def default_restarts(schedule: Schedule) -> tuple[int, ...]:
    """One autotuned restart for schedules of 3+ steps (after step 2 of 5 for Polar Express)."""
    return _default_for(schedule)
