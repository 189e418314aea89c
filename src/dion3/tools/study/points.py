"""The points the study's reports compare: a Variant (an optimizer family, or a Dion3 fraction,
allocation and rule variant) and its best Point on one model, horizon and batch (best_points:
the lr and μ with the most seeds, then the lowest mean loss). The frontier, the regime table, the
step-efficiency and the screen all read them."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ...optim.param_groups import BY_COST
from ..setting_names import ALLOCATION_WORDS, fraction_text
from .runs import DEFAULT_NS, MODELS, best_on_shared_seeds, rule_label, schedule_label, selection_label


@dataclass(frozen=True)
class Variant:
    """What a point of the frontier is: an optimizer family, or a Dion3 fraction and allocation."""

    optimizer: str  # adamw, muon, normuon, dion3
    fraction: Optional[float] = None
    allocation: str = "uniform"
    row_score: str = "l1"  # Dion3's selection score (dion3.rules.ROW_SCORES)
    weights: Optional[str] = None  # by cost: the rows' weights by parameter name (the study's fraction_weights)
    ns_coefficients: str = DEFAULT_NS  # the Newton–Schulz schedule (the study's --ns-coefficients)
    # rule variants under study (--unselected-decay, --full-every): never pooled with the rule's records
    unselected_decay: float = 1.0
    full_every: int = 0

    @property
    def label(self) -> str:
        if self.optimizer != "dion3":
            family = {"adamw": "AdamW", "muon": "Muon", "normuon": "NorMuon"}[self.optimizer]
            return family + schedule_label(self.ns_coefficients)
        text = fraction_text(self.fraction).replace("/", "⁄")  # the fraction slash, for prose
        allocation = ALLOCATION_WORDS.get(self.allocation, " on every matrix")
        return (f"Dion3 {text}" + allocation
                + selection_label(self.row_score, self.weights) + schedule_label(self.ns_coefficients)
                + rule_label(self.unselected_decay, self.full_every))


# the references every other point is compared with: Muon and NorMuon with the default schedule
MUON, NORMUON = Variant("muon"), Variant("normuon")


@dataclass
class Point:
    variant: Variant
    lr: float
    mu: float
    losses: list[float]
    step_ms: dict  # (preset, mode) → median device ms
    unconfirmed: list = field(default_factory=list)  # (lr, μ, shared seeds) of rivals ahead on fewer seeds
    seeds: list = field(default_factory=list)  # the seed of each loss, in the same order

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.losses) if len(self.losses) > 1 else 0.0


def best_points(records: Sequence[dict], model: str, horizon: int, compiled: bool,
                batch_size: Optional[int] = None) -> dict[Variant, Point]:
    """The best lr/μ of each variant for one model, horizon and batch size (default: the model's
    own, MODELS): among the settings with the most
    seeds (those a seed-0 sweep led the study to confirm; a point needs a spread), the lowest mean.
    A setting with fewer seeds that beats it on the seeds they share is listed in `unconfirmed`
    (its seeds are the study's next runs). Non-finite runs never count (they are bugs to explain,
    not samples)."""
    if batch_size is None and model in MODELS:
        batch_size = MODELS[model].batch_size
    settings: dict[tuple, tuple[Variant, float, float, dict[int, float]]] = {}
    for record in records:
        config = record["config"]
        if (config["model"] != model or config["horizon"] != horizon or config.get("compiled", False) != compiled
                or config.get("batch_size", batch_size) != batch_size or config.get("momentum_dtype") or config.get("fraction_warmup", 0)):
            continue
        allocation = config.get("fraction_allocation", "uniform")
        if allocation in BY_COST and not config.get("cost_rule"):
            continue  # allocated by the FLOP rule that fractions by cost no longer follow
        if not math.isfinite(record["final_val_loss"]) or record.get("nonfinite_parameters"):
            continue
        dion3 = config["optimizer"] == "dion3"
        variant = Variant(config["optimizer"], config["fraction"] if dion3 else None, allocation if dion3 else "uniform",
                          config.get("row_score", "l1") if dion3 else "l1",
                          config.get("fraction_weights") if dion3 else None,
                          config.get("ns_coefficients", DEFAULT_NS) if config["optimizer"] != "adamw" else DEFAULT_NS,
                          config.get("unselected_decay", 1.0) if dion3 else 1.0,
                          config.get("full_every", 0) if dion3 else 0)
        key = (variant, config["lr"], config["mu"])
        settings.setdefault(key, (variant, config["lr"], config["mu"], {}))[3][record["seed"]] = record["final_val_loss"]
    by_variant: dict[Variant, list[tuple[float, float, dict[int, float]]]] = {}
    for variant, lr, mu, by_seed in settings.values():
        by_variant.setdefault(variant, []).append((lr, mu, by_seed))
    best: dict[Variant, Point] = {}
    for variant, candidates in by_variant.items():
        lr, mu, by_seed = min(candidates, key=lambda c: (-len(c[2]), statistics.fmean(c[2].values())))
        point = Point(variant, lr, mu, [by_seed[s] for s in sorted(by_seed)], {}, seeds=sorted(by_seed))
        for other_lr, other_mu, other in candidates:  # a rival that wins on the seeds it shares: run its seeds
            if len(other) < len(by_seed) and best_on_shared_seeds([by_seed, other])[0] == 1:
                point.unconfirmed.append((other_lr, other_mu, sorted(set(other) & set(by_seed))))
        best[variant] = point
    return best
