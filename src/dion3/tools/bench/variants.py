"""The optimizers `dion3 bench` times, by name: AdamW, the standard-NS Muon baseline, Muon with
kernels and Gram NS, NorMuon, and Dion3 settings as dion3.tools.setting_names spells them.

Two suffixes, for the bench only, time the frontier study's rule variants beside the rule in one
run (the study's run names spell them alike):

    dion3-1/2-cost-unselected0.9    the momentum rows a step does not select decay ×0.9 (Dion3's
                                    unselected_decay: one more pass over the momentum)
    dion3-1/2-cost-full-every8      every row on every 8th step (PeriodicFull): the row is the
                                    median over 8-step cycles of the cycle's mean step

Both may follow one name, in that order (dion3-1/2-cost-unselected0.9-full-every8).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

from ..setting_names import GRAMMAR, Dion3Setting, parse_dion3

BASELINE = "muon"


@dataclass(frozen=True)
class Variant:
    name: str
    algorithm: str  # adamw | muon | normuon | dion3
    fraction: Optional[float] = None
    orthogonalizer: str = "auto"
    kernels: bool = True  # Triton kernels enabled (dion3.kernels.set_kernels_enabled)
    # dion3: "uniform" (`fraction` on every matrix) or "cost" (one fraction per matrix shape, within
    # the modeled H200 step time of `fraction` on every matrix: dion3.optim.cost_fractions)
    allocation: str = "uniform"
    # dion3: the fraction warms up from 1 to `fraction` over this many steps (FractionWarmup, the
    # documented schedule); every step of the warm-up is timed and the row reports their mean
    warmup_steps: Optional[int] = None
    momentum_dtype: Optional[str] = None  # the matrix groups' momentum_dtype (NAME:bf16 variants)
    ns_coefficients: str = "polar_express"  # the Newton–Schulz schedule (--ns-coefficients), not AdamW's
    unselected_decay: float = 1.0  # dion3: Dion3's unselected_decay (1: the rule)
    full_every: int = 0  # dion3: every row on every full_every-th step (PeriodicFull); 0: never


NAMED_VARIANTS = {
    "adamw": Variant("adamw", "adamw", kernels=False),
    "muon": Variant("muon", "muon", orthogonalizer="newton_schulz", kernels=False),  # the baseline
    "muon-gram": Variant("muon-gram", "muon"),  # auto: Gram NS for non-square, NS for square
    "normuon": Variant("normuon", "normuon"),
}
# the settings the README measures (½, ⅜ and ¼ by cost among them; README "Which setting")
DEFAULT_OPTIMIZERS = ("adamw,muon,muon-gram,normuon,dion3-1/2,dion3-1/4,dion3-1/8,dion3-1/2-cost,dion3-3/8-cost,"
                      "dion3-1/4-cost,dion3-1/4-warmup200")
RULE_SUFFIXES = "-unselectedD (D in (0, 1)) and -full-everyK (K ≥ 2), in that order"
_FULL_EVERY = re.compile(r"-full-every(\d+)$")
_UNSELECTED = re.compile(r"-unselected([0-9.]+)$")


def parse_variant(name: str) -> Variant:
    """A named variant, or a Dion3 setting named as dion3.tools.setting_names spells it: dion3-F
    with F a fraction in (0, 1] such as 1/4 or 0.25; dion3-F-cost: per-shape fractions within the
    modeled H200 step time of dion3-F; dion3-F-warmupN: the fraction warmed up from 1 to F over N
    steps (FractionWarmup); a fixed Dion3 setting with the rule suffixes of the module docstring.
    Any orthogonal variant with ":bf16" (e.g. dion3-1/4:bf16) keeps its momentum in bf16
    (momentum_dtype="bfloat16"). A Dion3 variant's name is the setting's one spelling (dion3-0.25
    and dion3-f0.25 become dion3-1/4)."""
    if name.endswith(":bf16") and name != ":bf16":
        base = parse_variant(name[: -len(":bf16")])
        if base.algorithm == "adamw":
            raise ValueError(f"--optimizers: {name!r}: AdamW has no momentum_dtype")
        return dataclasses.replace(base, name=base.name + ":bf16", momentum_dtype="bfloat16")
    if name in NAMED_VARIANTS:
        return NAMED_VARIANTS[name]
    setting_name, decay, every = _rule_suffixes(name)
    try:
        setting = parse_dion3(setting_name)
    except ValueError as error:
        raise ValueError(f"--optimizers: unknown optimizer {name!r}: {error}") from None
    if setting is None and (decay != 1.0 or every):
        raise ValueError(f"--optimizers: {name!r}: the rule suffixes ({RULE_SUFFIXES}) follow a Dion3 setting "
                         f"such as dion3-1/2-cost")
    if setting is None:
        raise ValueError(f"--optimizers: unknown optimizer {name!r}; expected one of {sorted(NAMED_VARIANTS)} "
                         f"or {GRAMMAR}, each also with :bf16 (bf16 momentum)")
    if setting.allocation != "uniform" and setting.warmup_steps:  # its steps' fractions are not priced here
        raise ValueError(f"--optimizers: {name!r}: the bench times fractions by cost fixed; bench the warm-up's "
                         f"end, {Dion3Setting(setting.fraction, setting.allocation).name}, or train the warm-up "
                         "(dion3 compare)")
    if setting.warmup_steps and (decay != 1.0 or every):
        raise ValueError(f"--optimizers: {name!r}: the rule suffixes ({RULE_SUFFIXES}) time a fixed fraction; "
                         f"drop the warm-up")
    suffix = (f"-unselected{decay:g}" if decay != 1.0 else "") + (f"-full-every{every}" if every else "")
    return Variant(setting.name + suffix, "dion3", fraction=setting.fraction, allocation=setting.allocation,
                   warmup_steps=setting.warmup_steps or None, unselected_decay=decay, full_every=every)


def _rule_suffixes(name: str) -> tuple[str, float, int]:
    """(the name without its rule suffixes, the unselected rows' decay, the full step's period)."""
    given, every, decay = name, 0, 1.0
    match = _FULL_EVERY.search(name)
    if match:
        every = int(match.group(1))
        if every < 2:
            raise ValueError(f"--optimizers: {given!r}: -full-everyK needs K ≥ 2 (K = 1 is every row on every step)")
        name = name[: match.start()]
    match = _UNSELECTED.search(name)
    if match:
        try:
            decay = float(match.group(1))
        except ValueError:
            decay = float("nan")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"--optimizers: {given!r}: -unselectedD needs D in (0, 1) (1 is the rule, no decay), "
                             f"got {match.group(1)}")
        name = name[: match.start()]
    if "-unselected" in name or "-full-every" in name:
        raise ValueError(f"--optimizers: {given!r}: a rule suffix it cannot read; they come last: {RULE_SUFFIXES}")
    return name, decay, every
