"""The study's command-line values turned into Run fields: each flag's comma-separated values,
checked, with a SystemExit naming the flag for a value no run could train with."""
from __future__ import annotations

import math
from typing import Optional

from ...ortho.coefficients import SCHEDULES


def floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"quality_study: {flag} expects comma-separated numbers, got {text!r}") from None
    if not values:
        raise SystemExit(f"quality_study: {flag} is empty")
    return values


def ints(text: str, flag: str) -> list[int]:
    values = floats(text, flag)
    if any(v != int(v) or v < 0 for v in values):
        raise SystemExit(f"quality_study: {flag} expects comma-separated integers ≥ 0, got {text!r}")
    return [int(v) for v in values]


def in_range(text: str, flag: str, low: float, high: float, closed_low: bool) -> list[float]:
    """Comma-separated numbers, each in [low, high) (or (low, high) with closed_low=False)."""
    values = floats(text, flag)
    if any(not ((low <= v if closed_low else low < v) and v < high) for v in values):
        interval = f"{'[' if closed_low else '('}{low:g}, {high:g})"
        raise SystemExit(f"quality_study: {flag} values must lie in {interval}, got {text!r}")
    return values


def learning_rates(text: str, flag: str) -> list[float]:
    return in_range(text, flag, 0.0, math.inf, closed_low=False)


def momenta(text: str, flag: str) -> list[float]:
    return in_range(text, flag, 0.0, 1.0, closed_low=True)


def warmup_steps(spec: str, horizon: int) -> int:
    """"200" → 200 steps; "15%" → 15% of the horizon."""
    spec = spec.strip()
    try:
        steps = round(float(spec[:-1]) / 100 * horizon) if spec.endswith("%") else int(spec)
    except ValueError:
        raise SystemExit(f"quality_study: --fraction-warmup expects steps or P%, got {spec!r}") from None
    if steps < 0:
        raise SystemExit(f"quality_study: --fraction-warmup must not be negative, got {spec!r}")
    return steps


def fraction_weights_spec(text: str) -> Optional[str]:
    """One --fraction-weights value → the Run field: "none" → None; "mlp=2,q_proj=1.5" → the same
    parts in order of name with their weights as numbers (one spelling per setting)."""
    text = text.strip()
    if text == "none":
        return None
    weights = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name.strip() or not 0.0 < weight < math.inf:
            raise SystemExit(f"quality_study: --fraction-weights expects part=weight pairs with positive weights "
                             f"(e.g. mlp=2,q_proj=1.5) or none, got {text!r}")
        weights[name.strip()] = weight
    if not weights:
        raise SystemExit("quality_study: --fraction-weights got an empty value; give part=weight pairs or none")
    return ",".join(f"{name}={weights[name]:g}" for name in sorted(weights))


def ns_schedules(text: str) -> list[str]:
    """--ns-coefficients → the schedule names, each a name of dion3.ortho.SCHEDULES, in order."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names or any(name not in SCHEDULES for name in names):
        raise SystemExit(f"quality_study: --ns-coefficients expects some of {tuple(SCHEDULES)}, got {text!r}")
    return names


MOMENTUM_DTYPES = ("float32", "bfloat16")


def momentum_dtypes(text: str) -> list[Optional[str]]:
    """--momentum-dtype → the Run field per dtype: None for float32 (the default, and the key of
    runs from before the option), else the dtype's name."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names or any(name not in MOMENTUM_DTYPES for name in names):
        raise SystemExit(f"quality_study: --momentum-dtype expects some of {MOMENTUM_DTYPES}, got {text!r}")
    return [None if name == "float32" else name for name in names]


def unselected_decays(text: str) -> list[float]:
    """--unselected-decay → the Run field per value, each in (0, 1]: 1 is the rule (the rows a
    step does not select keep accumulating), d < 1 decays them (Dion3's unselected_decay)."""
    values = list(dict.fromkeys(floats(text, "--unselected-decay")))
    if any(not 0.0 < v <= 1.0 for v in values):
        raise SystemExit(f"quality_study: --unselected-decay values must lie in (0, 1], got {text!r}")
    return values


def full_every_steps(text: str) -> list[int]:
    """--full-every → the Run field per value: K ≥ 1, every row on every K-th step (PeriodicFull);
    0, never."""
    return list(dict.fromkeys(ints(text, "--full-every")))
