"""Newton–Schulz coefficient schedules as data.

Each iteration applies the odd polynomial p(x) = a·x + b·x³ + c·x⁵ to every singular
value. A schedule is a tuple of (a, b, c) rows plus the factor by which the Frobenius
norm is inflated before iterating (it keeps the largest singular value safely below 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

Triple = tuple[float, float, float]


@dataclass(frozen=True)
class Schedule:
    name: str
    steps: tuple[Triple, ...]
    norm_scale: float = 1.0  # X is normalized by norm_scale·‖X‖_F
    band: tuple[float, float] = (0.0, float("inf"))  # where converged singular values land

    def __len__(self) -> int:
        return len(self.steps)


# Polar Express, 5 steps (safety 2e-2, cushion 2), as used by the public Dion code.
POLAR_EXPRESS = Schedule(
    "polar_express",
    (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    norm_scale=1.02,
    band=(0.7, 1.2),
)

# Keller Jordan's fixed quintic, 5 steps. Its invariant interval is [p(x*), p(p(x*))] with x* the
# local minimum of p: ≈ [0.6818, 1.1344].
JORDAN = Schedule("jordan", ((3.4445, -4.7750, 2.0315),) * 5, band=(0.68, 1.14))

# Jiacheng You's 5-step schedule.
YOU = Schedule(
    "you",
    (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    band=(0.8, 1.1),
)

SCHEDULES = {s.name: s for s in (POLAR_EXPRESS, JORDAN, YOU)}

CoefficientSpec = Union[str, Schedule, Sequence[Sequence[float]]]


def get_schedule(spec: CoefficientSpec) -> Schedule:
    """Resolve a schedule name, a Schedule, or an explicit list of (a, b, c)."""
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, str):
        try:
            return SCHEDULES[spec]
        except KeyError:
            raise ValueError(
                f"unknown ns_coefficients {spec!r}; expected one of {sorted(SCHEDULES)} "
                "or an explicit list of (a, b, c)"
            ) from None
    try:
        steps = tuple(tuple(float(v) for v in row) for row in spec)
    except TypeError:
        raise ValueError(f"ns_coefficients must be a name or a list of (a, b, c), got {spec!r}") from None
    if not steps or any(len(row) != 3 for row in steps):
        raise ValueError(f"ns_coefficients must be a non-empty list of (a, b, c) triples, got {spec!r}")
    if any(not math.isfinite(v) for row in steps for v in row):
        raise ValueError(f"ns_coefficients must be finite numbers, got {spec!r}")
    return Schedule("custom", steps)  # type: ignore[arg-type]
