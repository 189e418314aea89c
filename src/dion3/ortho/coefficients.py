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

# Fewer steps, for rules that normalize rows after orthogonalizing (NorMuon, Dion3): our greedy
# minimax constructions from [1e-3, 1] (dion3.ortho.minimax: safety 1e-2, cushion 0.02; both are
# the first steps of the same construction at 5 steps). A rule change under study, not a default.
# Bands: the images of singular values ≥ 1e-3·‖X‖_F (every image, for the upper end), widened by
# 0.01 and rounded outwards; exact images [0.4257, 1.5660] and [0.1307, 1.8667]. Polar Express cut
# to 4 or 3 steps lands in [0.4084, 1.5755] and [0.1257, 1.8692].
POLAR_EXPRESS_4 = Schedule(
    "polar_express_4",
    (
        (8.31968561540051, -23.859450318966733, 17.531445041810255),
        (4.082607978632795, -2.893404675268208, 0.525393190567182),
        (3.926967032968569, -2.856177578676787, 0.5322515290423173),
        (3.2997972929539743, -2.4289094183776627, 0.4878788037480626),
    ),
    norm_scale=1.02,
    band=(0.415, 1.576),
)

POLAR_EXPRESS_3 = Schedule(
    "polar_express_3",
    (
        (8.31968561540051, -23.859450318966733, 17.531445041810255),
        (4.082607978632795, -2.893404675268208, 0.525393190567182),
        (3.926967032968569, -2.856177578676787, 0.5322515290423173),
    ),
    norm_scale=1.02,
    band=(0.12, 1.877),
)

SCHEDULES = {s.name: s for s in (POLAR_EXPRESS, JORDAN, YOU, POLAR_EXPRESS_4, POLAR_EXPRESS_3)}

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
