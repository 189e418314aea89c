"""The regime: where a cheap Dion3 setting keeps Muon's loss, by tokens per step and tokens per
parameter. The study's runs fall into regimes, each a model, a batch size and a horizon; in each the
best of every family and Dion3 variant is found as the frontier finds it
(`points.best_points`), and each setting's gap to Muon's best is written down:

    python -m dion3.tools.study.regime --results benchmarks/results/frontier ... --out DIR

writes DIR/regime.md (a row per setting, a column per regime: the gap, its spread over seeds and
whether it lies within Muon's seed sd) and DIR/regime.png (the gap against tokens per step and
against tokens per parameter, a line per setting, error bars one sd over the seeds).

Tokens per parameter counts the hidden matrices of the blocks (the parameters Dion3 and Muon
train; `block_matrix_parameters`), the size the study models are named by. The gap is paired by
seed where the setting and Muon share two or more seeds (the same seed reads the same data in the
same order, so the pairs cancel the data's share of the spread), else the two spreads combined.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .points import MUON, Point, Variant, best_points
from .colours import distinct_colours
from .launch import read_results
from .runs import MODELS, ModelSpec
from .summary import write_report


def block_matrix_parameters(spec: ModelSpec) -> int:
    """The hidden matrices' parameters of a study model's blocks (no embedding, head or norm)."""
    d = spec.d_model
    if spec.kind == "llama-hf":
        kv_width = spec.kv_heads * (d // spec.n_head)
        per_layer = 2 * d * d + 2 * d * kv_width + 3 * d * spec.mlp_width  # q, o; k, v; gate, up, down
    else:
        per_layer = 4 * d * d + 2 * 4 * d * d  # q, k, v, proj; the 4× MLP's two matrices
    return spec.n_layer * per_layer


@dataclass(frozen=True)
class Regime:
    model: str
    batch_size: int
    horizon: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * MODELS[self.model].seq_len

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens_per_step * self.horizon / block_matrix_parameters(MODELS[self.model])

    @property
    def label(self) -> str:
        return f"{self.model}, {self.batch_size} × {MODELS[self.model].seq_len}, {self.horizon} steps"


@dataclass(frozen=True)
class Gap:
    """One setting's gap to Muon's best in one regime (loss units, positive: behind Muon)."""

    mean: float
    sd: float  # of the paired differences, or the two spreads combined
    paired: int  # seeds shared with Muon (0: not paired)
    muon_sd: float

    @property
    def within(self) -> bool:
        """At most one of Muon's seed sds behind Muon's best (the frontier's criterion)."""
        return self.mean <= self.muon_sd

    def verdict(self, seeded: bool) -> str:
        """"within; " or "outside; " where both bests have seeds (a spread), else nothing."""
        return f"{'within' if self.within else 'outside'}; " if seeded else ""


def gap(point: Point, muon: Point) -> Gap:
    shared = sorted(set(point.seeds) & set(muon.seeds))
    if len(shared) >= 2:
        mine, theirs = dict(zip(point.seeds, point.losses)), dict(zip(muon.seeds, muon.losses))
        differences = [mine[s] - theirs[s] for s in shared]
        return Gap(point.mean - muon.mean, statistics.stdev(differences), len(shared), muon.sd)
    return Gap(point.mean - muon.mean, math.hypot(point.sd, muon.sd), 0, muon.sd)


def regime_of(record: dict, compiled: bool = True) -> Optional[Regime]:
    """The regime a run belongs to; None for a run of the other kind (eager or compiled) or of a
    model the study no longer builds."""
    config = record["config"]
    if config.get("compiled", False) != compiled or config["model"] not in MODELS:
        return None
    return Regime(config["model"], config["batch_size"], config["horizon"])


def regimes(records: Sequence[dict], compiled: bool = True) -> list[Regime]:
    """Every regime the records hold, smallest tokens per step first."""
    found = {regime_of(r, compiled) for r in records} - {None}
    return sorted(found, key=lambda g: (g.model, g.tokens_per_step, g.horizon))


@dataclass
class RegimeRow:
    muon: Point  # Muon's best in the regime
    gaps: dict  # variant → (its best point, its Gap)


def regime_gaps(records: Sequence[dict], compiled: bool = True, min_seeds: int = 2) -> dict[Regime, RegimeRow]:
    """For each regime where Muon's best has at least `min_seeds` seeds: Muon's best and the gap of
    every other variant's best with at least `min_seeds` seeds too."""
    table = {}
    for regime in regimes(records, compiled):
        points = best_points(records, regime.model, regime.horizon, compiled, regime.batch_size)
        muon = points.get(MUON)
        if muon is None or len(muon.losses) < min_seeds:
            continue
        table[regime] = RegimeRow(muon, {v: (p, gap(p, muon)) for v, p in points.items()
                                         if v != MUON and len(p.losses) >= min_seeds})
    return table


def regime_cards(records: Sequence[dict], regime: Regime, compiled: bool = True) -> str:
    """The cards that ran a regime's runs and how many each ("not recorded" before records named
    them): settings are compared within one card kind, so a mixed regime says so."""
    counts = Counter(r.get("card") or "not recorded" for r in records if regime_of(r, compiled) == regime)
    return ", ".join(f"{card} × {n}" for card, n in sorted(counts.items(), key=lambda item: -item[1]))


def regime_table(table: dict[Regime, RegimeRow]) -> str:
    """Markdown: Muon's best loss, then a row per setting; a column per regime."""
    variants = sorted({v for row in table.values() for v in row.gaps}, key=_variant_order)
    head = ["setting"] + [f"{g.label} ({g.tokens_per_step:,} tokens a step, {g.tokens_per_parameter:.2g} tokens "
                          f"per parameter)" for g in table]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| Muon's best (loss, lr, μ) | " + " | ".join(
        f"{row.muon.mean:.4f} ± {row.muon.sd:.4f} (lr {row.muon.lr:g}, μ {row.muon.mu:g}; {_seeds(row.muon)})"
        for row in table.values()) + " |")
    for variant in variants:
        cells = []
        for row in table.values():
            if variant not in row.gaps:
                cells.append("—")
                continue
            point, g = row.gaps[variant]
            seeded = min(len(point.losses), len(row.muon.losses)) > 1
            cells.append(f"{g.mean:+.4f} ± {g.sd:.4f} ({g.verdict(seeded)}lr {point.lr:g}"
                         + (f", μ {point.mu:g}" if variant.optimizer != "adamw" else "") + f"; {_seeds(point)})")
        lines.append(f"| {variant.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seeds(point: Point) -> str:
    return f"{len(point.losses)} seed{'s' if len(point.losses) > 1 else ''}"


def _variant_order(variant: Variant) -> tuple:
    rank = {"muon": 0, "normuon": 1, "dion3": 2, "adamw": 3}[variant.optimizer]  # Muon: another schedule
    return (rank, -(variant.fraction or 0.0), variant.allocation, variant.row_score, variant.weights or "",
            variant.ns_coefficients, -variant.unselected_decay, variant.full_every)


def regime_picture(table: dict[Regime, RegimeRow], path: Path) -> bool:
    """Two panels, the gap to Muon's best against tokens per step and against tokens per
    parameter (log axes), a line per setting through the regimes of one model, a marker per
    model; AdamW is left out (its gap is an order larger). False when nothing is drawn."""
    variants = sorted({v for row in table.values() for v in row.gaps if v.optimizer != "adamw"}, key=_variant_order)
    if not variants:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(14, 5.2))
    markers = dict(zip(sorted({g.model for g in table}), "osD^vP*X"))
    colours = distinct_colours(len(variants))
    # on the batch axis a line joins one model's regimes of one horizon; across tokens per
    # parameter, all of one model's regimes (a longer horizon or a larger batch)
    panels = [("tokens per step", lambda g: g.tokens_per_step, lambda g: (g.model, g.horizon)),
              ("tokens per parameter (hidden matrices)", lambda g: g.tokens_per_parameter, lambda g: (g.model,))]
    for axis, (name, x_of, line_of) in zip(axes, panels):
        for index, variant in enumerate(variants):
            lines: dict[tuple, list] = {}
            for regime, row in table.items():
                if variant in row.gaps:
                    lines.setdefault(line_of(regime), []).append((x_of(regime), row.gaps[variant][1]))
            for key, series in lines.items():
                series.sort(key=lambda item: item[0])
                gaps = [g for _, g in series]
                axis.errorbar([x for x, _ in series], [g.mean for g in gaps], yerr=[g.sd for g in gaps],
                              marker=markers[key[0]], color=colours[index], capsize=3, linewidth=1.2)
        axis.axhline(0.0, color="tab:red", linestyle="--", linewidth=1)
        axis.set_xscale("log")
        axis.set_xlabel(name)
        axis.set_ylabel("final val loss − Muon's best (nats per byte)")
        axis.grid(alpha=0.3)
    axes[0].set_title("gap to Muon's best against tokens per step")
    axes[1].set_title("against tokens per parameter")
    # one legend entry per setting (colour) and per model (marker), beside the panels
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colours[i], linewidth=2, label=v.label) for i, v in enumerate(variants)]
    handles += [Line2D([], [], color="black", marker=m, linestyle="none", label=model) for model, m in markers.items()]
    figure.legend(handles=handles, fontsize=8, loc="center right")
    figure.subplots_adjust(left=0.06, right=0.82, wspace=0.25)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dion3.tools.study.regime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, nargs="+", required=True, help="study folders or results.jsonl files")
    parser.add_argument("--eager", action="store_true", help="compare eager runs (default: runs with --compile)")
    parser.add_argument("--min-seeds", type=int, default=2, help="seeds a best needs to be shown (default 2)")
    parser.add_argument("--out", type=Path, required=True, help="folder for NAME.md and NAME.png")
    parser.add_argument("--name", default="regime", help="the two files' name (default regime)")
    args = parser.parse_args(argv)
    if args.min_seeds < 1:
        parser.error("--min-seeds must be ≥ 1")
    records = [r for path in args.results for r in read_results(path / "results.jsonl" if path.is_dir() else path)]
    if not records:
        parser.error(f"--results: no finished runs in {[str(p) for p in args.results]}")
    table = regime_gaps(records, not args.eager, args.min_seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = ["# Gap to Muon's best by regime", "",
                "Command: `python -m dion3.tools.study.regime " + " ".join(sys.argv[1:] if argv is None else argv) + "`", "",
                "Each cell: the setting's best mean final validation loss minus Muon's best, ± the sd of the per-seed "
                "differences (paired by seed) or of both spreads combined; “within”: at most Muon's seed sd behind (judged "
                "only where both have two or more seeds).", ""]
    if not table:
        sections.append(f"No regime has Muon's best with {args.min_seeds} or more seeds.")
    else:
        sections += [regime_table(table), "", "Cards that ran each regime's runs (“not recorded”: a record that does not name its card):", ""]
        sections += [f"- {regime.label}: {regime_cards(records, regime, not args.eager)}" for regime in table] + [""]
        if regime_picture(table, args.out / f"{args.name}.png"):
            sections += [f"![gap to Muon's best against tokens per step and per parameter]({args.name}.png)", ""]
    write_report(args.out / f"{args.name}.md", sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
