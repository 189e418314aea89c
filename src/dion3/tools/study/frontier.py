"""The frontier: each optimizer setting's final loss on a study model against its optimizer step
time on a large model, so that a user can read off which setting keeps Muon's loss and how much
faster its step is.

    python -m dion3.tools.study.frontier --results benchmarks/results/quality-study-llama-384 \\
        --steps STEPS-llama-8b.json [STEPS-llama-1b.json ...] --out DIR

--results: study folders (or their results.jsonl). --steps: `dion3 bench --json` files (or JSON
lists of such reports); the first report's preset is the picture's x-axis, every one gets a column.
The same files may also hold `python -m dion3.tools.study.train_step --json` reports: a model's
table then gets a column with its own whole training step (eager / captured). For each model in the results, at
--horizon steps: the best setting (among those with the most seeds, the lowest mean final validation loss) of each family
(AdamW, Muon, NorMuon) and of each Dion3 variant (fraction, uniform or by cost; fixed fractions),
with its step times: Muon's are `muon-gram`'s (dion3.Muon's defaults), Dion3 F by cost's are
`dion3-F-cost`'s. Writes DIR/frontier.md (a table per model and two picks) and
DIR/frontier.png (a panel per model: loss against step time, one standard deviation over seeds as
error bars, Muon and NorMuon marked), and the same question over every model at once ("Across
sizes": each Dion3 setting's gap at each size, and the cheapest within Muon's sd at all of them).
--name gives the two files another name, e.g. frontier-6000 for a second horizon beside the first.

The picks: "Muon quality", the Dion3 setting with the shortest step whose mean loss is at most
Muon's best mean plus one standard deviation of Muon's seeds; "fastest", the Dion3 setting with
the shortest step. Records of fractions by cost from before the modeled-time rule (no
`cost_rule`) and runs with bf16 momentum are left out: no benchmark times their rule now.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..bench.step_time import parse_variant
from .launch import read_results
from .points import MUON, NORMUON, Point, Variant, best_points
from .runs import DEFAULT_NS
from .summary import write_report


def bench_variant(row: dict) -> Optional[Variant]:
    """The frontier variant a `dion3 bench` row times, if any (the default Muon, NorMuon, AdamW,
    fixed-fraction Dion3 in float32 momentum, its rule variants; with the row's Newton–Schulz
    schedule, `dion3 bench --ns-coefficients`)."""
    spec = row.get("variant", {})
    if spec.get("momentum_dtype") or spec.get("warmup_steps"):
        return None
    if spec.get("algorithm") == "muon" and spec.get("orthogonalizer", "auto") != "auto":
        return None  # the standard-NS baseline, not the Muon users get
    schedule = spec.get("ns_coefficients", DEFAULT_NS)
    if spec.get("algorithm") == "dion3":  # rule variants: bench's -unselectedD and -full-everyK names
        return Variant("dion3", spec["fraction"], spec.get("allocation", "uniform"), ns_coefficients=schedule,
                       unselected_decay=spec.get("unselected_decay", 1.0), full_every=spec.get("full_every", 0))
    if spec.get("algorithm") == "adamw":
        return Variant("adamw")
    return Variant(spec["algorithm"], ns_coefficients=schedule) if spec.get("algorithm") in ("muon", "normuon") else None


def _reports(paths: Sequence[Path]) -> list[dict]:
    """The reports in the files, each file one report or a list of them."""
    reports = []
    for path in paths:
        loaded = json.loads(Path(path).read_text())
        reports += loaded if isinstance(loaded, list) else [loaded]
    return reports


def _is_train_step(report: dict) -> bool:
    return "model" in report and "rows" in report  # train_step's report; `dion3 bench`'s has "source"


def read_steps(paths: Sequence[Path]) -> tuple[list[str], dict[Variant, dict]]:
    """(the presets in order, variant → {(preset, mode): device ms}) from the `dion3 bench --json`
    reports in the files (train_step's reports there are read by read_whole_steps)."""
    presets, times = [], {}
    for report in _reports(paths):
        if _is_train_step(report):
            continue
        preset = report["source"]["name"]
        if preset not in presets:  # a preset benched twice (e.g. once per Newton–Schulz schedule): one column
            presets.append(preset)
        for row in report["results"]:
            variant = bench_variant(row)
            if variant is not None and "device_ms" in row:
                times.setdefault(_rounded(variant), {})[(preset, row["mode"])] = row["device_ms"]
    return presets, times


def setting_variant(name: str) -> Variant:
    """The frontier variant of a train_step setting name (adamw, muon, normuon, dion3-F[-cost])."""
    if name in ("adamw", "muon", "normuon"):
        return Variant(name)
    spec = parse_variant(name)
    return _rounded(Variant("dion3", spec.fraction, spec.allocation))


def read_whole_steps(paths: Sequence[Path]) -> dict[str, dict[Variant, dict]]:
    """model → variant → {mode ("eager" / "captured"): median whole training step ms} from the
    train_step reports in the files (a later report of the same model and setting wins)."""
    whole: dict[str, dict[Variant, dict]] = {}
    for report in _reports(paths):
        if _is_train_step(report):
            for row in report["rows"]:
                whole.setdefault(report["model"], {}).setdefault(setting_variant(row["setting"]), {})[row["mode"]] = \
                    row["total_ms"]
    return whole


def _rounded(variant: Variant) -> Variant:
    """The variant whose `dion3 bench` row times this one: fractions compared to 1e-9 (0.375
    written as 3/8 or 0.375); an L2 selection score is timed as the L1 rule (the momentum pass
    measures the squared row norms either way, and the selection costs the same); the schedule is
    kept (fewer Newton–Schulz steps are what such a row times), and so are the unselected rows'
    decay (one more pass over the momentum) and periodic full steps (the full steps' time too),
    timed by bench rows named with -unselectedD and -full-everyK. Row weights are kept too: they
    give other fractions within the same budget, which spend another share of it (on llama-384,
    gate/up weighted twice gives the fractions of the most rows), and no bench row times them."""
    fraction = None if variant.fraction is None else round(variant.fraction, 9)
    return Variant(variant.optimizer, fraction, variant.allocation, weights=variant.weights,
                   ns_coefficients=variant.ns_coefficients, unselected_decay=variant.unselected_decay,
                   full_every=variant.full_every)


def picks(points: Sequence[Point], axis: tuple) -> dict[str, Optional[Point]]:
    """"muon quality" and "fastest" among the Dion3 points timed on `axis` (preset, mode)."""
    timed = sorted((p for p in points if p.variant.optimizer == "dion3" and axis in p.step_ms), key=lambda p: p.step_ms[axis])
    muon = next((p for p in points if p.variant == MUON), None)
    quality = None
    if muon is not None:
        quality = next((p for p in timed if p.mean <= muon.mean + muon.sd), None)
    return {"muon quality": quality, "fastest": timed[0] if timed else None}


def frontier_table(model: str, points: Sequence[Point], presets: Sequence[str],
                   whole: Optional[dict[Variant, dict]] = None) -> str:
    """The model's table: one row per point; whole (read_whole_steps' entry for the model), when
    given, adds the model's own whole training step."""
    muon = next((p for p in points if p.variant == MUON), None)
    reference = (presets[0], "eager") if presets else None
    muon_ms = muon.step_ms.get(reference) if muon and reference else None
    head = ["setting", "lr", "μ", "seeds", "final val loss", "vs Muon's best"]
    head += [f"{preset} ms (eager / graph)" for preset in presets] + ([f"× Muon's step ({presets[0]})"] if presets else [])
    head += [f"whole {model} training step ms (eager / captured)"] if whole else []
    lines = [f"### {model}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in sorted(points, key=lambda p: p.mean):
        cells = [point.variant.label, f"{point.lr:g}", "—" if point.variant.optimizer == "adamw" else f"{point.mu:g}",
                 str(len(point.losses)), f"{point.mean:.4f} ± {point.sd:.4f}",
                 "—" if muon is None or point is muon else f"{point.mean - muon.mean:+.4f}"]
        for preset in presets:
            eager, graph = point.step_ms.get((preset, "eager")), point.step_ms.get((preset, "graph"))
            cells.append(" / ".join("—" if t is None else f"{t:.1f}" for t in (eager, graph)))
        if presets:
            mine = point.step_ms.get(reference)
            cells.append("—" if mine is None or not muon_ms else f"{mine / muon_ms:.2f}")
        if whole:
            modes = whole.get(_rounded(point.variant), {})
            cells.append(" / ".join("—" if modes.get(m) is None else f"{modes[m]:.1f}" for m in ("eager", "captured")))
        lines.append("| " + " | ".join(cells) + " |")
    if reference:
        chosen = picks(points, reference)
        lines.append("")
        for name, point in chosen.items():
            if point is None:
                lines.append(f"- {name}: none measured" + (" within one seed sd of Muon's best" if name == "muon quality" else ""))
            else:
                gap = f", {point.mean - muon.mean:+.4f} against Muon's best ({muon.mean:.4f} ± {muon.sd:.4f})" if muon else ""
                ratio = f", {point.step_ms[reference] / muon_ms:.2f}× Muon's" if muon_ms else ""
                lines.append(f"- {name}: {point.variant.label} (lr {point.lr:g}, μ {point.mu:g}), {point.mean:.4f} ± "
                             f"{point.sd:.4f}{gap}; {presets[0]} step {point.step_ms[reference]:.1f} ms{ratio}")
    for point in points:
        for lr, mu, seeds in point.unconfirmed:
            lines.append(f"- unconfirmed: {point.variant.label} lr {lr:g}, μ {mu:g} is at or below the best's loss on "
                         f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}, with fewer seeds")
    return "\n".join(lines)


def across_sizes(panels: Sequence[tuple[str, Sequence[Point]]], axis: tuple) -> str:
    """The frontier's question over every model at once: for each Dion3 variant (and NorMuon, and Muon
    or NorMuon with another Newton–Schulz schedule) timed on `axis`, its gap to Muon's best on each model where both have seeds (a spread), marked "within" when
    its mean is at most Muon's mean plus Muon's sd; and the pick "Muon quality at every size": the
    shortest step among the variants within at every such model where they were measured, with
    the models it was not measured on named (a pick is only as wide as its models)."""
    seeded = []
    for model, points in panels:
        muon = next((p for p in points if p.variant == MUON), None)
        if muon is not None and len(muon.losses) > 1:
            seeded.append((model, muon, {p.variant: p for p in points if len(p.losses) > 1}))
    variants = sorted({v for _, _, by in seeded for v, p in by.items()
                       if v != MUON and v.optimizer != "adamw" and axis in p.step_ms},
                      key=lambda v: next(p.step_ms[axis] for _, _, by in seeded for w, p in by.items() if w == v))
    if not seeded or not variants:
        return ""
    lines = ["### Across sizes", "", f"Gap to Muon's best (models where Muon and the setting have ≥ 2 seeds); "
             f"“within”: at most Muon's mean + its sd. Step: {axis[0]} ({axis[1]}).", "",
             "| setting | " + " | ".join(model for model, _, _ in seeded) + f" | {axis[0]} ms |",
             "|" + "---|" * (len(seeded) + 2)]
    choice = None
    for variant in variants:
        cells, held, step = [], True, None
        for _, muon, by in seeded:
            point = by.get(variant)
            if point is None:
                cells.append("—")
                continue
            step = point.step_ms[axis]
            within = point.mean <= muon.mean + muon.sd
            held &= within
            cells.append(f"{point.mean - muon.mean:+.4f} ({'within' if within else 'outside'})")
        lines.append(f"| {variant.label} | " + " | ".join(cells) + f" | {step:.1f} |")
        if held and choice is None and variant.optimizer == "dion3":
            choice = (variant, [model for model, _, by in seeded if variant not in by])
    lines.append("")
    if choice is None:
        lines.append("- muon quality at every size: none of these settings")
    else:
        variant, missing = choice
        lines.append(f"- muon quality at every size: {variant.label}"
                     + (f" (not measured with seeds on {', '.join(missing)})" if missing else ""))
    return "\n".join(lines)


def frontier_picture(panels: Sequence[tuple[str, Sequence[Point]]], axis: tuple, path: Path) -> list[str]:
    """One picture, a panel per model (each with its own loss scale): loss against step time on
    `axis`. Returns the models drawn (a model with no point timed there gets no panel); nothing is
    written when none is timed."""
    panels = [(model, [p for p in points if axis in p.step_ms], points) for model, points in panels]
    panels = [panel for panel in panels if panel[1]]
    if not panels:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=(12, 4.4 * len(panels)), squeeze=False)
    styles = {"muon": ("s", "tab:red"), "normuon": ("D", "tab:green"), "adamw": ("v", "tab:gray")}
    for ax, (model, timed, points) in zip(axes[:, 0], panels):
        # variants share the rule's step time, so their names would overprint: each point carries a
        # number, and a key beside the panel names it; one-seed points are drawn hollow
        key = []
        for point in sorted(timed, key=lambda p: (p.step_ms[axis], p.mean)):
            marker, colour = styles.get(point.variant.optimizer, ("o", "tab:blue"))
            x = point.step_ms[axis]
            ax.errorbar(x, point.mean, yerr=point.sd, fmt=marker, color=colour, capsize=3, markersize=7,
                        markerfacecolor="white" if len(point.losses) == 1 else colour)
            key.append(f"{len(key) + 1}  {point.variant.label} ({len(point.losses)})")
            ax.annotate(str(len(key)), (x, point.mean), textcoords="offset points", xytext=(6, -3), fontsize=8)
        ax.text(1.02, 1.0, "\n".join(key), transform=ax.transAxes, va="top", fontsize=8)
        for point in points:
            if point.variant in (MUON, NORMUON):  # the references, drawn across the panel
                _, colour = styles[point.variant.optimizer]
                ax.axhline(point.mean, color=colour, linestyle="--", linewidth=1, label=f"{point.variant.label} best")
                if point.variant == MUON and point.sd:
                    ax.axhspan(point.mean - point.sd, point.mean + point.sd, color=colour, alpha=0.1, label="Muon best ± sd")
        ax.set_xlabel(f"optimizer step on {axis[0]} shapes, one H200 ({axis[1]}), ms")
        ax.set_ylabel("final validation loss, nats per byte")
        ax.set_title(f"{model}: loss against step time (mean ± sd over seeds; seeds in brackets, one: hollow)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel without Muon or NorMuon has no reference lines
            ax.legend(fontsize=8, loc="upper right")
    figure.tight_layout()  # counts the keys beside the panels
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return [model for model, _, _ in panels]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dion3.tools.study.frontier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, nargs="+", required=True, help="study folders or results.jsonl files")
    parser.add_argument("--steps", type=Path, nargs="*", default=[],
                        help="`dion3 bench --json` files (the first is the x-axis), and train_step --json reports")
    parser.add_argument("--horizon", type=int, default=1500, help="training steps of the runs compared (default 1500)")
    parser.add_argument("--eager", action="store_true", help="compare eager runs (default: runs with --compile)")
    parser.add_argument("--batch-size", type=int,
                        help="compare the runs of this batch size (default: each model's own, MODELS); with --name")
    parser.add_argument("--out", type=Path, required=True, help="folder for NAME.md and NAME.png")
    parser.add_argument("--name", default="frontier",
                        help="the two files' name (default frontier; e.g. frontier-6000 for --horizon 6000 beside it)")
    args = parser.parse_args(argv)
    records = [r for path in args.results for r in read_results(path / "results.jsonl" if path.is_dir() else path)]
    if not records:
        parser.error(f"--results: no finished runs in {[str(p) for p in args.results]}")
    presets, times = read_steps(args.steps)
    whole = {} if args.batch_size else read_whole_steps(args.steps)  # train_step timed each model's own batch
    args.out.mkdir(parents=True, exist_ok=True)
    models = sorted({r["config"]["model"] for r in records})
    sections = [f"# Frontier at {args.horizon} steps" + (f", batch {args.batch_size}" if args.batch_size else "")
                + f" ({'eager' if args.eager else 'compiled'} runs)", "",
                "Command: `python -m dion3.tools.study.frontier " + " ".join(sys.argv[1:] if argv is None else argv) + "`", ""]
    panels = []
    for model in models:
        points = list(best_points(records, model, args.horizon, not args.eager, args.batch_size).values())
        if not points:
            continue
        for point in points:
            point.step_ms = times.get(_rounded(point.variant), {})
        sections += [frontier_table(model, points, presets, whole.get(model)), ""]
        panels.append((model, points))
    summary = across_sizes(panels, (presets[0], "eager")) if presets else ""
    if summary:
        sections += [summary, ""]
    if presets and frontier_picture(panels, (presets[0], "eager"), args.out / f"{args.name}.png"):
        sections += [f"![loss against step time, a panel per model]({args.name}.png)", ""]
    write_report(args.out / f"{args.name}.md", sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
