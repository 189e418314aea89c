"""Greedy minimax Newton–Schulz schedules: how the constants of `polar_express_4` and
`polar_express_3` (ortho.coefficients) were made. The optimizers never call this module; the
schedules are stored as data, and tests/test_ortho.py rebuilds them here to check the stored digits.

    python -m dion3.ortho.minimax            # prints the 3-, 4- and 5-step constants and bands

The construction, one step at a time (the greedy rule of the Polar Express paper, Amsel et al.
2025, arXiv:2505.16932): on the interval [l, u] where the singular values are, take the odd
quintic p(x) = a·x + b·x³ + c·x⁵ that minimizes max |1 − p(x)| over [l, u]. By equioscillation
it maps [l, u] onto [1 − E, 1 + E], E its error, so the next interval is [1 − E, (1 + E)·(1 + ε)]:
the image, with its upper end raised by 1 + ε (ε = `safety`, 1e-2) so that a singular value that
rounding pushed a little above the image is still inside the interval the next polynomial is
built for (a value above it would be amplified by the x⁵ term). The first interval is [lower, 1]:
inputs are scaled by 1/(norm_scale·‖X‖_F), so the largest lies at or below 1/norm_scale, and
norm_scale plays the part of 1 + ε there.

Half precision needs one more margin, the cushion (as in Polar Express): while l is tiny the
minimax polynomial dips to 1 − E ≈ 0.01 at its local minimum (near 0.82 on the first step), so a
matrix whose largest normalized singular value sits there would have its main direction pushed
down to the level of bf16/fp16 rounding noise, and the later steps would grow the noise back with
it. Each polynomial is therefore built on [max(l, κ·u), u] (κ = `cushion`, 0.02), which keeps its
local minimum near 0.16, and then scaled so that its image of the whole [l, u] is centred on 1.
Below κ·u it falls under 1 − E, so the small singular values converge a little more slowly: for
4 steps the images of the singular values ≥ 1e-3·‖X‖_F widen from [0.436, 1.555] to [0.426, 1.566].

Each polynomial is found by a Remez exchange on its four alternation points (l, the local maximum,
the local minimum, u; the error of an odd quintic has no other extrema in (0, ∞)), then checked
on a dense grid.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Triple = tuple[float, float, float]

GRID = 200_001  # points of the dense grids that check a polynomial and measure a band


def _quintic(coefficients: Sequence[float], x):
    a, b, c = coefficients
    x2 = x * x
    return x * (a + x2 * (b + c * x2))


def _critical_points(coefficients: Sequence[float], lower: float, upper: float) -> list[float]:
    """The points of (lower, upper) where p' = a + 3b·x² + 5c·x⁴ vanishes, ascending."""
    a, b, c = coefficients
    roots = np.roots([5.0 * c, 3.0 * b, a]) if c != 0.0 else np.roots([3.0 * b, a])
    found = sorted(math.sqrt(r.real) for r in roots if abs(r.imag) <= 1e-12 * max(1.0, abs(r)) and r.real > 0.0)
    return [x for x in found if lower < x < upper]


def minimax_quintic(lower: float, upper: float, max_iterations: int = 100) -> tuple[Triple, float]:
    """((a, b, c), E): the odd quintic minimizing max |1 − p(x)| over [lower, upper], and that error.

    Remez exchange: solve p(x_i) = 1 ∓ E on the reference (lower, x₁, x₂, upper) with signs
    −, +, −, + (p starts below 1 at `lower`), move x₁ and x₂ to the critical points of the new p,
    and repeat until they stop moving (or, on a narrow interval, stall at rounding level). The result is checked on a dense grid of [lower, upper]."""
    if not 0.0 < lower < upper:
        raise ValueError(f"need 0 < lower < upper, got [{lower}, {upper}]")
    reference = np.array([lower, lower + (upper - lower) / 3, lower + 2 * (upper - lower) / 3, upper])
    signs = np.array([1.0, -1.0, 1.0, -1.0])  # p(x_i) + s_i·E = 1
    previous = math.inf
    for _ in range(max_iterations):
        system = np.stack([reference, reference ** 3, reference ** 5, signs], axis=1)
        a, b, c, error = np.linalg.solve(system, np.ones(4))
        inside = _critical_points((a, b, c), lower, upper)
        if len(inside) != 2:
            raise RuntimeError(f"Remez on [{lower}, {upper}]: the iterate has {len(inside)} extrema inside, not 2")
        moved = np.array([lower, inside[0], inside[1], upper])
        step = float(np.max(np.abs(moved - reference)))
        reference = moved
        # done when the points stop moving, or (narrow intervals) stall at rounding level
        if step <= 1e-15 * upper or (step <= 1e-8 * (upper - lower) and step >= previous):
            break
        previous = step
    else:
        raise RuntimeError(f"Remez on [{lower}, {upper}] did not converge in {max_iterations} iterations")
    coefficients = (float(a), float(b), float(c))
    grid = np.concatenate([np.linspace(lower, upper, GRID), np.geomspace(lower, upper, GRID)])
    worst = float(np.max(np.abs(1.0 - _quintic(coefficients, grid))))
    if not 0.0 < error < 1.0 or worst > error * (1.0 + 1e-9) + 1e-14:
        raise RuntimeError(f"Remez on [{lower}, {upper}]: levelled error {error}, grid error {worst}")
    return coefficients, float(error)


def _image(coefficients: Sequence[float], lower: float, upper: float) -> tuple[float, float]:
    """(min, max) of p over [lower, upper], from the ends and the critical points inside."""
    points = np.array([lower, *_critical_points(coefficients, lower, upper), upper])
    values = _quintic(coefficients, points)
    return float(values.min()), float(values.max())


def minimax_schedule(steps: int, lower: float = 1e-3, upper: float = 1.0, safety: float = 1e-2,
                     cushion: float = 0.02) -> tuple[Triple, ...]:
    """The greedy schedule of `steps` polynomials from [lower, upper] (the module's docstring).

    Each polynomial is the minimax one on [max(l, cushion·u), u]; where the cushion raised the
    lower end, it is then scaled so that its image of the whole [l, u] is centred on 1. The next
    interval is that image with its upper end times 1 + safety."""
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    if safety < 0.0 or not 0.0 <= cushion < 1.0:
        raise ValueError(f"need safety ≥ 0 and 0 ≤ cushion < 1, got {safety} and {cushion}")
    schedule = []
    for _ in range(steps):
        built_on = max(lower, cushion * upper)
        coefficients, error = minimax_quintic(built_on, upper)
        least, greatest = 1.0 - error, 1.0 + error  # the image of [built_on, upper]
        if built_on > lower:  # below built_on p falls under 1 − E: centre the image of [lower, upper]
            least, greatest = _image(coefficients, lower, upper)
            scale = 2.0 / (least + greatest)
            coefficients = (scale * coefficients[0], scale * coefficients[1], scale * coefficients[2])
            least, greatest = scale * least, scale * greatest
        schedule.append(coefficients)
        lower, upper = least, greatest * (1.0 + safety)
    return tuple(schedule)


def scalar_image(steps: Sequence[Sequence[float]], sigma_hat) -> np.ndarray:
    """p_T(…p_1(σ̂)) in float64, elementwise: where a normalized singular value σ̂ ends up."""
    x = np.asarray(sigma_hat, dtype=np.float64)
    for coefficients in steps:
        x = _quintic(coefficients, x)
    return x


def image_range(steps: Sequence[Sequence[float]], lower: float = 1e-3, norm_scale: float = 1.02) -> tuple[float, float]:
    """(least, greatest) image of the singular values: the least over σ ≥ lower·‖X‖_F, that is
    σ̂ ∈ [lower, 1]/norm_scale; the greatest over every σ̂ ∈ [0, 1/norm_scale] (smaller
    singular values land lower, not higher)."""
    top = 1.0 / norm_scale
    converged = np.concatenate([np.geomspace(lower * top, top, GRID), np.linspace(lower * top, top, GRID)])
    every = np.concatenate([converged, np.linspace(0.0, top, GRID)])
    return float(scalar_image(steps, converged).min()), float(scalar_image(steps, every).max())


def derived_band(steps: Sequence[Sequence[float]], lower: float = 1e-3, norm_scale: float = 1.02,
                 margin: float = 1e-2, digits: int = 3) -> tuple[float, float]:
    """The band a schedule states: image_range widened by `margin` on each side (rounding in
    float32, grid resolution) and rounded outwards to `digits` decimals."""
    least, greatest = image_range(steps, lower, norm_scale)
    scale = 10 ** digits
    return math.floor((least - margin) * scale) / scale, math.ceil((greatest + margin) * scale) / scale


def main() -> int:
    for steps in (3, 4, 5):
        schedule = minimax_schedule(steps)
        least, greatest = image_range(schedule)
        print(f"{steps} steps from [1e-3, 1], safety 1e-2, norm_scale 1.02: singular values land in "
              f"[{least:.5f}, {greatest:.5f}], band {derived_band(schedule)}")
        for a, b, c in schedule:
            print(f"    ({a!r}, {b!r}, {c!r}),")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
