"""Time to Muon's loss: which setting gets a user's run to Muon's loss soonest.

A setting S whose whole training step takes w_S times Muon's, and whose step is worth e_S of
Muon's steps (its step-efficiency, measured by the quality study: dion3.tools.study.efficiency),
reaches Muon's loss in w_S / e_S of Muon's time. The whole step is modeled as the forward and
backward pass, 6 · parameters · tokens per step spread over the world at a sustained rate, plus
the optimizer step the plan prices for the layout. The efficiencies come from the measured regime
nearest the user's run (tokens a step and tokens per parameter, both on a log scale); the data
file is the study's, so a new measurement changes the advice, not this code.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..setting_names import parse_dion3

DATA = Path(__file__).with_name("step_efficiency.json")
SETTINGS = ("muon", "normuon", "dion3-1/4-cost", "dion3-3/8-cost", "dion3-1/2-cost")  # what the advice compares
REFERENCES = ("muon", "normuon")
SEEDS_TO_ADVISE = 3  # a setting beyond SETTINGS joins the advice once its regime has measured it on this many seeds


@dataclass(frozen=True)
class MeasuredRegime:
    """Where a step-efficiency was measured: a study model, its batch and its horizon."""

    model: str
    parameters: int  # the model's hidden matrices
    tokens_per_step: int
    horizon: int
    tokens_per_parameter: float
    cards: str = ""

    @property
    def label(self) -> str:
        return (f"{self.model} ({self.parameters / 1e6:.0f} M hidden parameters), {self.tokens_per_step:,} tokens a "
                f"step, {self.horizon} steps ({self.tokens_per_parameter:.2g} tokens per parameter)")


@dataclass(frozen=True)
class Efficiency:
    value: float
    low: float
    high: float
    seeds: int


def load_efficiencies(path: Path = DATA) -> dict[MeasuredRegime, dict[str, Efficiency]]:
    """Regime → setting name → its measured efficiency, from the study's data file."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"--efficiency: cannot read step-efficiencies from {path}: {error}") from None
    table: dict[MeasuredRegime, dict[str, Efficiency]] = {}
    for row in rows:
        regime = MeasuredRegime(row["model"], row["parameters"], row["tokens_per_step"], row["horizon"],
                                row["tokens_per_parameter"], row.get("cards", ""))
        table.setdefault(regime, {})[row["setting"]] = Efficiency(row["efficiency"], row["low"], row["high"], row["seeds"])
    return table


def nearest_regime(table: dict[MeasuredRegime, dict[str, Efficiency]], tokens_per_step: float,
                   tokens_per_parameter: float, settings: Sequence[str] = SETTINGS) -> MeasuredRegime:
    """The measured regime closest to a run in log tokens a step plus log tokens per parameter,
    among those that measured every Dion3 setting of `settings` (else those that measured most)."""
    wanted = [s for s in settings if s not in REFERENCES]
    if not table:
        raise ValueError("no step-efficiency has been measured (the data file holds no rows)")
    most = max(sum(s in row for s in wanted) for row in table.values())
    candidates = [g for g, row in table.items() if sum(s in row for s in wanted) == most]

    def distance(g: MeasuredRegime) -> float:
        return abs(math.log(tokens_per_step / g.tokens_per_step)) + abs(math.log(tokens_per_parameter / g.tokens_per_parameter))

    return min(candidates, key=lambda g: (distance(g), -g.horizon))


def other_shapes(table: dict[MeasuredRegime, dict[str, Efficiency]], regime: MeasuredRegime,
                 within: float = 1.5) -> list[MeasuredRegime]:
    """Regimes measured on another model at the same tokens a step and within `within` times the
    regime's tokens per parameter (one per model, the nearest): how far e moves with the shape alone."""
    nearest: dict[str, MeasuredRegime] = {}
    for g in table:
        if g.model == regime.model or g.tokens_per_step != regime.tokens_per_step:
            continue
        gap = abs(math.log(g.tokens_per_parameter / regime.tokens_per_parameter))
        if gap <= math.log(within) and (g.model not in nearest or gap < abs(
                math.log(nearest[g.model].tokens_per_parameter / regime.tokens_per_parameter))):
            nearest[g.model] = g
    return [nearest[m] for m in sorted(nearest)]


def shape_check(predictions: Sequence[Prediction], efficiencies: dict[str, Efficiency]) -> dict[str, float]:
    """Each setting's time to Muon's loss with another regime's efficiencies (the same whole steps)."""
    return {p.setting: p.step_ratio / efficiencies[p.setting].value for p in predictions
            if p.setting != "muon" and p.setting in efficiencies}


def advised_settings(measured: dict[str, Efficiency]) -> list[str]:
    """SETTINGS, then every other fixed Dion3 setting the regime measured on SEEDS_TO_ADVISE or more
    seeds (e.g. dion3-1/2-rows): its row shows what the records say of it, kept or not, and the
    recommendation still goes by time to Muon's loss; a new record adds it, not a new release."""
    extra = []
    for name, efficiency in measured.items():
        try:
            setting = parse_dion3(name)
        except ValueError:
            continue
        if (setting is not None and not setting.warmup_steps and setting.name == name and name not in SETTINGS
                and efficiency.seeds >= SEEDS_TO_ADVISE):
            extra.append(name)
    return list(SETTINGS) + sorted(extra)


def forward_backward_seconds(parameters: float, tokens_per_step: float, world_size: int, flops_per_second: float) -> float:
    """The forward and backward pass of one step on each rank: 6 · parameters · tokens, the
    world's ranks sharing the tokens (data parallel) or the matrices (tensor parallel)."""
    return 6.0 * parameters * tokens_per_step / (world_size * flops_per_second)


@dataclass(frozen=True)
class Prediction:
    setting: str
    optimizer_s: float
    whole_s: float
    step_ratio: float  # whole step over Muon's
    efficiency: Optional[Efficiency]  # None: not measured in the regime (Muon: exactly 1)
    time_ratio: Optional[float]  # time to Muon's loss over Muon's
    time_low: Optional[float]
    time_high: Optional[float]


def predict(optimizer_s: dict[str, float], forward_backward_s: float,
            efficiencies: dict[str, Efficiency]) -> list[Prediction]:
    """Each setting's whole step and time to Muon's loss, in the order of `optimizer_s`."""
    if "muon" not in optimizer_s:
        raise ValueError("the time to Muon's loss needs Muon's optimizer step")
    muon_whole = forward_backward_s + optimizer_s["muon"]
    out = []
    for setting, seconds in optimizer_s.items():
        whole = forward_backward_s + seconds
        ratio = whole / muon_whole
        e = Efficiency(1.0, 1.0, 1.0, 0) if setting == "muon" else efficiencies.get(setting)
        if e is None:
            out.append(Prediction(setting, seconds, whole, ratio, None, None, None, None))
        else:
            out.append(Prediction(setting, seconds, whole, ratio, e, ratio / e.value, ratio / e.high, ratio / e.low))
    return out


def recommendation(predictions: Sequence[Prediction]) -> str:
    """One line that starts with "recommend": the setting with the shortest predicted time to
    Muon's loss, and whether another lies inside its band (the measurements cannot tell them apart)."""
    ranked = sorted((p for p in predictions if p.time_ratio is not None), key=lambda p: p.time_ratio)
    if not ranked:
        return "recommend muon: no other setting's step-efficiency is measured"
    best = ranked[0]
    line = f"recommend {best.setting}: {best.time_ratio:.3f}× Muon's time to Muon's loss"
    if best.setting in REFERENCES:
        line += " (no Dion3 setting gets there sooner)"
    if best.efficiency is not None and best.setting != "muon" and best.efficiency.seeds < 2:
        line += " (its efficiency rests on one seed: no spread of its own is measured)"
    close = [p for p in ranked[1:] if p.time_ratio <= best.time_high or p.time_low <= best.time_ratio]
    if close:
        line += ("; within the measurement's band: " + ", ".join(f"{p.setting} {p.time_ratio:.3f}×" for p in close)
                 + ", which the measured seeds do not tell apart")
    else:
        line += "; outside the measurement's band of every other setting"
    return line


@dataclass(frozen=True)
class Run:
    """The user's run as the advice describes it."""

    tokens_per_step: float
    world_size: int
    parameters: float  # those the forward and backward multiply by
    hidden_parameters: float  # the hidden matrices (tokens per parameter counts these, as the study)
    tokens_per_parameter: float
    tokens_assumed: bool  # tokens per parameter not given: 20
    flops_per_second: float  # the forward and backward's sustained rate per GPU


def report(run: Run, regime: MeasuredRegime, forward_backward: float, predictions: Sequence[Prediction],
           labels: dict[str, str],
           checks: Sequence[tuple[MeasuredRegime, dict[str, Efficiency]]] = (),
           row_shares: Optional[dict[str, tuple[float, Optional[float]]]] = None) -> str:
    """The plan's section on the time to Muon's loss: the run, its modeled forward and backward
    (seconds), the regime its efficiencies come from, a row per setting, the same settings' times
    with the efficiencies of another shape measured alike (`checks`), and the recommend line.
    row_shares: setting → (share of the rows it selects on this model, on the regime's model or
    None), for the Dion3 settings: one budget buys different shares on different shapes."""
    row_shares = row_shares or {}
    lines = [
        f"Time to Muon's loss: {run.tokens_per_step:,.0f} tokens a step over {run.world_size} rank"
        f"{'s' if run.world_size > 1 else ''}; forward and backward 6 · {run.parameters / 1e9:.3g} B parameters · "
        f"tokens at {run.flops_per_second / 1e12:.0f} TFLOP/s a GPU = {forward_backward * 1e3:,.1f} ms a step; "
        f"{run.tokens_per_parameter:.3g} tokens per hidden-matrix parameter"
        + (" (assumed: --train-tokens sets it)" if run.tokens_assumed else ""),
        f"step-efficiency from the measured regime nearest this run: {regime.label}"
        + (f"; cards {regime.cards}" if regime.cards else ""),
        f"measured at {regime.parameters / 1e6:.0f} M hidden parameters, this run has {run.hidden_parameters / 1e9:.3g} B: "
        "the study has not measured ≥ 1 B parameters or ≥ 20 tokens per parameter", "",
        f"| setting | rows selected: this model / {regime.model} | optimizer step ms | whole step ms | "
        "× Muon's whole step | step-efficiency (band; seeds) | time to Muon's loss, × Muon's (band) |",
        "|---|---|---|---|---|---|---|"]
    for p in predictions:
        if p.setting == "muon":
            efficiency, time = "1 (the reference)", "1"
        elif p.efficiency is None:
            efficiency, time = "not measured in this regime", "—"
        else:
            e = p.efficiency
            efficiency = f"{e.value:.3f} ({e.low:.3f}–{e.high:.3f}; {e.seeds})"
            time = f"{p.time_ratio:.3f} ({p.time_low:.3f}–{p.time_high:.3f})"
        if p.setting in REFERENCES:
            rows = "all"
        elif p.setting in row_shares:
            here, there = row_shares[p.setting]
            rows = f"{here:.2f} / " + ("—" if there is None else f"{there:.2f}")
        else:
            rows = "—"
        lines.append(f"| {labels.get(p.setting, p.setting)} ({p.setting}) | {rows} | {p.optimizer_s * 1e3:,.1f} | "
                     f"{p.whole_s * 1e3:,.1f} | {p.step_ratio:.3f} | {efficiency} | {time} |")
    fewer = [f"{s} {here:.2f} against {there:.2f}" for s, (here, there) in row_shares.items()
             if there is not None and here < there - 0.05]
    if fewer:
        lines += ["", f"fewer rows on this model than where the efficiencies were measured ({regime.model}): "
                  + ", ".join(fewer) + "; a step of fewer rows may be worth fewer of Muon's steps"]
    for other, efficiencies in checks:
        times = shape_check(predictions, efficiencies)
        if times:
            lines += ["", f"the same settings with the efficiencies of another shape, {other.label}: " + ", ".join(
                f"{s} e {efficiencies[s].value:.3f} ({efficiencies[s].seeds} seed{'s' if efficiencies[s].seeds != 1 else ''})"
                f" → {t:.3f}×" for s, t in times.items())]
    return "\n".join(lines + ["", recommendation(predictions)])
