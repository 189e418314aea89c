"""One spelling of each Dion3 setting for every command: `dion3 compare`, `dion3 bench`,
`dion3 fractions` and the quality study print, and read back, the same names.

    dion3-1/4               fraction ¼ on every matrix
    dion3-1/4-cost          fractions per matrix shape within the modeled H200 step time of ¼ on
                            every matrix (param_groups' fraction_allocation="cost")
    dion3-1/4-warmup200     the fraction warmed up from 1 to ¼ over 200 steps
    dion3-1/4-cost-warmup200
                            fractions by cost whose budget warms up from 1 to ¼ over 200 steps
                            (a FractionScheduler over groups by cost)
    dion3-1/4-rows          the most rows within that modeled time (fraction_allocation="most_rows");
                            -rows-warmupN as -cost-warmupN

The fraction is written p/q where a denominator up to 64 gives it exactly (1/2, 3/8, 1, 3/10),
else as a decimal (0.333). Read back as well: any fraction spelling (dion3-0.25), and the old
`dion3 compare` spellings dion3-f0.25, dion3-f0.25-cost and dion3-f0.25-warm200, which records
and scripts from before this naming still hold.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

PREFIX = "dion3-"
GRAMMAR = ("dion3-F (F in (0, 1], e.g. dion3-1/4), dion3-F-cost, dion3-F-rows, dion3-F-warmupN or "
           "dion3-F-cost-warmupN")
SUFFIXES = {"cost": "-cost", "most_rows": "-rows"}  # a setting's allocation (param_groups') → its name's suffix
ALLOCATION_WORDS = {"cost": " by cost", "most_rows": " by cost, most rows"}  # … and how prose says it
_DENOMINATOR = 64  # the largest denominator a fraction is written with (as the frontier's labels)


def fraction_text(fraction: float) -> str:
    """The fraction as names and tables write it: "1/4", "3/8", "1"; a decimal ("0.333") where no
    denominator up to 64 gives it exactly."""
    simple = Fraction(fraction).limit_denominator(_DENOMINATOR)
    return str(simple) if float(simple) == fraction else repr(float(fraction))


def parse_fraction(text: str) -> float:
    """A fraction written 1/4 or 0.25, in (0, 1]; ValueError otherwise."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{text!r} is not a number such as 1/4 or 0.25") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"the fraction must lie in (0, 1], got {text}")
    return value


@dataclass(frozen=True)
class Dion3Setting:
    """A Dion3 setting as the commands name it: a fraction, spent on every matrix or by cost,
    fixed or warmed up from 1 (by cost: the budget warms up)."""

    fraction: float
    # "uniform" (the fraction on every matrix), "cost" or "most_rows" (per matrix shape: param_groups'
    # fraction_allocation)
    allocation: str = "uniform"
    warmup_steps: int = 0  # > 0: the fraction warms up linearly from 1 over this many steps

    @property
    def name(self) -> str:
        suffix = SUFFIXES.get(self.allocation, "") + (f"-warmup{self.warmup_steps}" if self.warmup_steps else "")
        return f"{PREFIX}{fraction_text(self.fraction)}{suffix}"

    @property
    def budget(self) -> str:
        """What the fraction spends, in words: "1/4 by cost", "1/4 on every matrix",
        "1 → 1/4 over 200 steps", "1 → 1/4 by cost over 200 steps"."""
        text = fraction_text(self.fraction)
        by_cost = ALLOCATION_WORDS.get(self.allocation, "")
        if self.warmup_steps:
            return f"1 → {text}{by_cost} over {self.warmup_steps} step{'s' if self.warmup_steps > 1 else ''}"
        return f"{text}{by_cost}" if by_cost else f"{text} on every matrix"


def _split_allocation(text: str) -> tuple[str, str]:
    """(text without its allocation suffix, the allocation it names; "uniform" where none)."""
    for allocation, suffix in SUFFIXES.items():
        if text.endswith(suffix):
            return text[: -len(suffix)], allocation
    return text, "uniform"


def parse_dion3(name: str) -> Optional[Dion3Setting]:
    """The Dion3 setting a name spells (module docstring), None for a name that is not Dion3's.
    ValueError, saying what is wrong, for a Dion3 name that spells no setting."""
    if not name.startswith(PREFIX):
        return None
    rest = name[len(PREFIX):]
    if rest[:1] == "f" and rest[1:2] not in ("", "-"):  # the old compare spelling: dion3-f0.25
        rest = rest[1:]
    rest, allocation = _split_allocation(rest)
    warmup_text = None
    for marker in ("-warmup", "-warm"):  # -warm: the old compare spelling
        if marker in rest:
            rest, _, warmup_text = rest.partition(marker)
            break
    if warmup_text is not None and allocation != "uniform":
        raise ValueError("a warm-up by cost is spelled with the warm-up last: dion3-F-cost-warmupN")
    if warmup_text is not None:  # dion3-F-cost-warmupN
        rest, allocation = _split_allocation(rest)
    if warmup_text is not None and not (warmup_text.isdigit() and int(warmup_text) > 0):
        raise ValueError("the warm-up needs a positive number of steps, e.g. dion3-1/4-warmup200")
    return Dion3Setting(parse_fraction(rest), allocation, int(warmup_text) if warmup_text else 0)


def canonical_name(name: str) -> str:
    """The name every command prints for `name`: a Dion3 name in this module's spelling; any other
    name (adamw, muon, a name that spells no setting) as given."""
    try:
        setting = parse_dion3(name)
    except ValueError:
        return name
    return name if setting is None else setting.name
