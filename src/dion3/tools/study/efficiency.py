"""Step-efficiency: how many of Muon's steps a setting's step is worth.

A setting S trained for H steps reaches some final loss L_S(H). Muon, trained with the same
schedule shape for a horizon H', reaches L_M(H'). The step-efficiency of S at H is

    e_S(H) = H' / H   where L_M(H') = L_S(H)

read off Muon's mean loss-against-horizon curve (its best lr at each horizon, each horizon a run
of its own schedule), linear in log steps between the measured horizons. e_S < 1: S needs 1/e_S
times Muon's steps for Muon's loss; e_S > 1: fewer. The band reads the same curve at S's loss ±
one sd of S's gap to Muon at H (paired by seed where both have two or more seeds, else both
spreads combined; `regime.gap`). Outside Muon's measured horizons the nearest segment is
extended, and the row says so.

    python -m dion3.tools.study.efficiency --results benchmarks/results/frontier ... \\
        --out benchmarks/results/frontier --data src/dion3/tools/plan/step_efficiency.json

writes OUT/efficiency.md (a row per regime and setting), OUT/efficiency.png (e_S against tokens
per parameter, a line per setting) and the data file `dion3 plan --tokens-per-step` reads: the
advice follows the records, not the code.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from ...optim.param_groups import BY_COST
from ..bench.presets import named_model
from ..plan.fractions import row_share
from ..setting_names import Dion3Setting
from .points import MUON, Variant, best_points
from .colours import distinct_colours
from .launch import read_results
from .regime import Regime, _variant_order, block_matrix_parameters, gap, regime_cards, regime_of
from .runs import DEFAULT_NS, MODELS
from .summary import write_report

DATA = Path(__file__).resolve().parents[1] / "plan" / "step_efficiency.json"


@dataclass(frozen=True)
class Efficiency:
    """One setting's step-efficiency in one regime (a model, a batch size and a horizon)."""

    model: str
    parameters: int  # the hidden matrices of the blocks (regime.block_matrix_parameters)
    batch_size: int
    tokens_per_step: int
    horizon: int
    tokens_per_parameter: float
    setting: str  # `dion3 plan`'s name (muon, normuon, dion3-1/4-cost), or the variant's label
    label: str
    efficiency: float
    low: float
    high: float
    seeds: int  # the setting's seeds at this horizon
    muon_horizons: tuple  # (horizon, seeds) of each point of Muon's curve
    extrapolated: bool  # the crossing lies outside Muon's measured horizons
    cards: str
    # Dion3: the share of the model's rows its fractions select (plan.fractions.row_share, what the
    # runs record as average_fraction); None for Muon, NorMuon and the variants it does not price
    row_share: Optional[float] = None


def setting_name(variant: Variant) -> str:
    """The name `dion3 plan` prices a variant by; its label for variants the plan does not price."""
    plain = (variant.row_score == "l1" and variant.weights is None and variant.ns_coefficients == DEFAULT_NS
             and variant.unselected_decay == 1.0 and not variant.full_every)
    if plain and variant.optimizer in ("muon", "normuon", "adamw"):
        return variant.optimizer
    if plain and variant.optimizer == "dion3":
        return Dion3Setting(variant.fraction, variant.allocation).name
    return variant.label


def steps_to_loss(curve: Sequence[tuple[int, float]], loss: float) -> tuple[float, bool]:
    """(the horizon at which a loss-against-horizon curve reaches `loss`, whether it was read
    outside the curve). The curve: (horizon, mean loss) at two or more horizons, loss falling as
    the horizon grows; linear in log horizon between points, the end segments extended."""
    points = sorted(curve)
    if len(points) < 2:
        raise ValueError("a curve needs two or more horizons")
    for (h0, l0), (h1, l1) in zip(points, points[1:]):
        if not l1 < l0:
            raise ValueError(f"Muon's loss does not fall from {h0} to {h1} steps ({l0:.4f} → {l1:.4f})")
    outside = not points[-1][1] <= loss <= points[0][1]
    segment = 0 if loss > points[0][1] else len(points) - 2
    for index, ((_, l0), (_, l1)) in enumerate(zip(points, points[1:])):
        if l1 <= loss <= l0:
            segment = index
            break
    (h0, l0), (h1, l1) = points[segment], points[segment + 1]
    log_h = math.log(h0) + (loss - l0) / (l1 - l0) * (math.log(h1) - math.log(h0))
    return math.exp(log_h), outside


def muon_curve(points: dict) -> list[tuple[int, float]]:
    """(horizon, Muon's best mean loss) at each horizon of `points` (horizon → best_points) where
    Muon ran: the curve steps_to_loss reads."""
    return [(h, p[MUON].mean) for h, p in sorted(points.items()) if MUON in p]


def regime_efficiencies(records: Sequence[dict], compiled: bool = True) -> list[Efficiency]:
    """Every setting's efficiency at every horizon of every (model, batch) whose Muon has two or
    more horizons; AdamW is left out (its losses lie far outside Muon's curve)."""
    by_batch: dict[tuple[str, int], set[int]] = {}
    for record in records:
        regime = regime_of(record, compiled)
        if regime is not None:
            by_batch.setdefault((regime.model, regime.batch_size), set()).add(regime.horizon)
    rows = []
    for (model, batch), horizons in sorted(by_batch.items()):
        points = {h: best_points(records, model, h, compiled, batch) for h in sorted(horizons)}
        curve = muon_curve(points)
        if len(curve) < 2:
            continue
        muon_seeds = tuple((h, len(p[MUON].losses)) for h, p in points.items() if MUON in p)
        for horizon, at_horizon in points.items():
            muon = at_horizon.get(MUON)
            if muon is None:
                continue
            regime = Regime(model, batch, horizon)
            cards = regime_cards(records, regime, compiled)
            for variant, point in sorted(at_horizon.items(), key=lambda item: _variant_order(item[0])):
                if variant.optimizer == "adamw" or variant == MUON:
                    continue
                g = gap(point, muon)
                crossing, outside = steps_to_loss(curve, muon.mean + g.mean)
                slow, slow_outside = steps_to_loss(curve, muon.mean + g.mean + g.sd)
                fast, fast_outside = steps_to_loss(curve, muon.mean + g.mean - g.sd)
                rows.append(Efficiency(
                    model, block_matrix_parameters(MODELS[model]), batch, regime.tokens_per_step, horizon,
                    round(regime.tokens_per_parameter, 3), setting_name(variant), variant.label,
                    round(crossing / horizon, 4), round(slow / horizon, 4), round(fast / horizon, 4),
                    len(point.losses), muon_seeds, outside or slow_outside or fast_outside, cards,
                    share_of_rows(model, variant)))
    return rows


def share_of_rows(model: str, variant: Variant) -> Optional[float]:
    """The share of `model`'s rows a variant selects, rounded to 3 places: 1 for Muon and NorMuon;
    None for AdamW and for the Dion3 variants whose allocation row_share does not price (weighted
    rows, periodic full steps, another Newton–Schulz schedule, whose cost moves the fractions)."""
    if variant.optimizer in ("muon", "normuon"):
        return 1.0
    if (variant.optimizer != "dion3" or variant.weights is not None or variant.full_every
            or variant.ns_coefficients != DEFAULT_NS or variant.allocation not in ("uniform", *BY_COST)):
        return None
    try:
        matrices = named_model(model, None, None, "plan").preset.matrices
    except ValueError:
        return None
    return round(row_share(matrices, variant.fraction, allocation=variant.allocation), 3)


def efficiency_table(rows: Sequence[Efficiency]) -> str:
    lines = ["| model (hidden parameters) | tokens a step | steps | tokens per parameter | setting | share of rows | "
             "e_S | band | seeds | Muon's horizons (seeds) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.model, r.batch_size, r.horizon)):  # stable: the settings' order
        mark = " (extended)" if r.extrapolated else ""
        share = "—" if r.row_share is None else "all" if r.row_share == 1.0 else f"{r.row_share:.2f}"
        lines.append(f"| {r.model} ({r.parameters / 1e6:.1f} M) | {r.tokens_per_step:,} | {r.horizon} | "
                     f"{r.tokens_per_parameter:.2g} | {r.label} | {share} | {r.efficiency:.3f}{mark} | "
                     f"{r.low:.3f}–{r.high:.3f} | {r.seeds} | {', '.join(f'{h} ({n})' for h, n in r.muon_horizons)} |")
    return "\n".join(lines)


def efficiency_picture(rows: Sequence[Efficiency], path: Path) -> bool:
    """Left: e_S against tokens per parameter (log axis), a line per setting and model, error bars
    the band. Right: the same e_S against the share of the model's rows the setting selects (the
    Dion3 settings whose share is priced), a point per regime: where the same name buys another
    share on another shape, whether e follows the share."""
    shown = list(rows)
    if not shown:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axis, by_share) = plt.subplots(1, 2, figsize=(15, 5.2), gridspec_kw=dict(width_ratios=[3, 2]))
    labels = list(dict.fromkeys(r.label for r in shown))
    colours = dict(zip(labels, distinct_colours(len(labels))))
    models = sorted({(r.model, r.batch_size) for r in shown})
    markers = dict(zip(models, "osD^vP*X"))
    for label in labels:
        for model in models:
            series = sorted((r for r in shown if r.label == label and (r.model, r.batch_size) == model),
                            key=lambda r: r.tokens_per_parameter)
            if series:
                axis.errorbar([r.tokens_per_parameter for r in series], [r.efficiency for r in series],
                              yerr=[[r.efficiency - r.low for r in series], [r.high - r.efficiency for r in series]],
                              color=colours[label], marker=markers[model], capsize=3, linewidth=1.2)
            shared = [r for r in series if r.row_share is not None and r.row_share < 1.0]
            if shared:
                by_share.errorbar([r.row_share for r in shared], [r.efficiency for r in shared],
                                  yerr=[[r.efficiency - r.low for r in shared], [r.high - r.efficiency for r in shared]],
                                  color=colours[label], marker=markers[model], capsize=3, linestyle="none")
    for target in (axis, by_share):
        target.axhline(1.0, color="tab:red", linestyle="--", linewidth=1)
        target.grid(alpha=0.3)
    by_share.set_xlabel("share of the model's rows selected")
    by_share.set_title("the same, against the share of rows (Dion3)")
    axis.set_xscale("log")
    axis.set_xlabel("tokens per parameter (hidden matrices)")
    axis.set_ylabel("step-efficiency e_S (Muon's steps per step of S)")
    axis.set_title("Muon's steps to each setting's loss, per step")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colours[label], linewidth=2, label=label) for label in labels]
    handles += [Line2D([], [], color="black", marker=m, linestyle="none", label=f"{model}, batch {batch}")
                for (model, batch), m in markers.items()]
    by_share.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the points
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_data(rows: Sequence[Efficiency], path: Path, command: str) -> None:
    """The file `dion3 plan` reads: every row the plan can use (settings it prices by name)."""
    head = dict(command=command, commit=_commit(),
                definition="e_S(H): Muon's steps to S's loss at H steps, over H (dion3.tools.study.efficiency)")
    lines = [json.dumps(dict(asdict(r), muon_horizons=[list(p) for p in r.muon_horizons]), ensure_ascii=False)
             for r in rows]  # a row a line: a new measurement reads as a diff of rows
    text = json.dumps(head, indent=1, ensure_ascii=False)[:-2] + ',\n "rows": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"
    path.write_text(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dion3.tools.study.efficiency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, nargs="+", required=True, help="study folders or results.jsonl files")
    parser.add_argument("--eager", action="store_true", help="eager runs (default: runs with --compile)")
    parser.add_argument("--out", type=Path, required=True, help="folder for efficiency.md and efficiency.png")
    parser.add_argument("--data", type=Path, help=f"also write the plan's data file here (the package's: {DATA.name})")
    args = parser.parse_args(argv)
    records = [r for path in args.results for r in read_results(path / "results.jsonl" if path.is_dir() else path)]
    if not records:
        parser.error(f"--results: no finished runs in {[str(p) for p in args.results]}")
    rows = regime_efficiencies(records, not args.eager)
    command = "python -m dion3.tools.study.efficiency " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = ["# Step-efficiency against Muon", "", f"Command: `{command}`", "",
                "e_S: the steps Muon (its best lr at each horizon) needs to reach the setting's final validation loss, "
                "over the setting's steps, read on Muon's mean loss-against-horizon curve (linear in log steps). "
                "Band: the same at the loss ± one sd of the setting's gap to Muon (paired by seed where both have two "
                "or more); with one seed of each, no spread is known and the band is a point. “extended”: read beyond "
                "Muon's measured horizons.", ""]
    if not rows:
        sections.append("No (model, batch) has Muon at two or more horizons.")
    else:
        sections += [efficiency_table(rows), "", "Cards that ran each regime's runs:", ""]
        cards = {(r.model, r.batch_size, r.horizon): r.cards for r in rows}
        sections += [f"- {model}, batch {batch}, {horizon} steps: {text}" for (model, batch, horizon), text in
                     sorted(cards.items())] + [""]
        if efficiency_picture(rows, args.out / "efficiency.png"):
            sections += ["![step-efficiency against tokens per parameter](efficiency.png)", ""]
    write_report(args.out / "efficiency.md", sections)
    if args.data:
        write_data(rows, args.data, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
