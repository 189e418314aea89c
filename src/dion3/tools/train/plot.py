"""The comparison plot: validation loss against step and against training wall-clock time.

The loss is the model's mean cross-entropy on the validation batches, in nats (natural log):
nats per byte on byte data (the default corpus and text files, vocabulary 256), nats per token
on token shards. The y-axis is logarithmic and spans every evaluation, the untrained model's
(ln 256 ≈ 5.5 on bytes) included. A third panel magnifies the last half of the run by step on a
linear axis, for the runs that end within CLOSE of the best (there the matrix optimizers lie
within hundredths). Each run has its own colour, line style and hollow marker, and the earlier
runs' lines are drawn wider, so a run drawn over another leaves it visible.

`python -m dion3.tools.train.plot RESULTS.json OUT.png` redraws the plot of a `dion3 compare`
record (its results.json, or a copy under benchmarks/results/).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from ..setting_names import parse_dion3
from .data import BYTE_VOCAB
from .trainer import RunResult

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
NICE_TICKS = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)  # per decade, on the log axis
CLOSE = 0.05  # the zoom shows the runs whose final loss is within 5% of the best


def loss_unit(vocab_size: int) -> str:
    """The unit of a cross-entropy over this vocabulary: bytes for 256 symbols, else tokens."""
    return "nats per byte" if vocab_size == BYTE_VOCAB else "nats per token"


def run_style(index: int, runs: int) -> dict[str, Any]:
    """Colour, line style and marker of the index-th of `runs` runs: all three differ between
    neighbours, no two of the first len(COLOURS) runs share a colour, and earlier runs are drawn
    wider, so the later ones, drawn over them, leave an edge of them visible."""
    wider = (runs - 1 - index) / max(runs - 1, 1)  # 1 for the first run, 0 for the last
    return dict(color=COLOURS[index % len(COLOURS)], linestyle=LINESTYLES[index % len(LINESTYLES)],
                marker=MARKERS[index % len(MARKERS)], markerfacecolor="none", markersize=4.5 + 2.5 * wider,
                linewidth=1.2 + 1.1 * wider)


def _log_ticks(axis, low: float, high: float) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

    ticks = [t * 10.0 ** e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
             for t in NICE_TICKS]
    axis.yaxis.set_major_locator(FixedLocator([t for t in ticks if low <= t <= high]))
    axis.yaxis.set_major_formatter(ScalarFormatter())
    axis.yaxis.set_minor_locator(NullLocator())
    axis.yaxis.set_minor_formatter(NullFormatter())


def validation_figure(results: Sequence[RunResult], title: str, unit: str = "nats per byte"):
    """The figure of plot_validation (matplotlib, not saved): the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display (CI, servers)
    import matplotlib.pyplot as plt

    figure, (by_step, by_time, zoom) = plt.subplots(1, 3, figsize=(16, 4.8))
    finite = lambda values: [v for v in values if math.isfinite(v) and v > 0]  # noqa: E731
    losses = [loss for r in results for loss in finite(r.val_losses)]
    finals = finite([r.final_val_loss for r in results])
    best = min(finals) if finals else math.nan
    close = [i for i, r in enumerate(results) if math.isfinite(r.final_val_loss) and r.final_val_loss <= best * (1 + CLOSE)]
    for i, result in enumerate(results):
        style = run_style(i, len(results))
        by_step.plot(result.eval_steps, result.val_losses, label=result.label, **style)
        by_time.plot(result.eval_seconds, result.val_losses, label=result.label, **style)
        if i in close:
            half = [(s, v) for s, v in zip(result.eval_steps, result.val_losses) if s >= result.eval_steps[-1] / 2]
            zoom.plot([s for s, _ in half], [v for _, v in half], label=result.label, **style)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall-clock time (s, evaluation excluded)")
    for axis in (by_step, by_time):
        axis.set_ylabel(f"validation loss ({unit}, log scale)")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
        if losses:
            low, high = min(losses), max(losses)
            margin = (high / low) ** 0.03 if high > low else 1.05
            axis.set_ylim(low / margin, high * margin)  # every evaluation, the untrained one included
            _log_ticks(axis, low / margin, high * margin)
    zoom.set_xlabel("step (last half of the run)")
    zoom.set_ylabel(f"validation loss ({unit})")
    zoom.set_title(f"runs ending within {CLOSE:.0%} of the best, linear", fontsize=9)
    zoom.grid(alpha=0.3)
    by_time.legend(loc="upper right")
    if close:
        zoom.legend(loc="upper right", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def plot_validation(results: Sequence[RunResult], path: Path, title: str, unit: str = "nats per byte") -> Path:
    import matplotlib.pyplot as plt

    figure = validation_figure(results, title, unit)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def load_results(path: Path) -> tuple[list[RunResult], dict]:
    """The runs and settings of a `dion3 compare` results.json (fields a record lacks keep their
    defaults). Runs are labelled as `dion3 compare` names their settings now: a record from before
    (dion3-f0.25-cost) reads as dion3-1/4-cost, and its allocation comes from that name."""
    record = json.loads(Path(path).read_text())
    names = {f.name for f in dataclasses.fields(RunResult)}
    runs = []
    for run in record["runs"]:
        fields = {k: v for k, v in run.items() if k in names}
        try:
            setting = parse_dion3(fields["label"]) if fields.get("algorithm") == "dion3" else None
        except ValueError:  # a label that names no setting stays as it is
            setting = None
        if setting is not None:
            fields.setdefault("fraction_allocation", setting.allocation)
            fields["label"] = setting.name
        runs.append(RunResult(**fields))
    return runs, record.get("settings", {})


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dion3.tools.train.plot", description="Redraw a dion3 compare plot.")
    p.add_argument("results", type=Path, help="a dion3 compare results.json")
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("--unit", help="the loss's unit (default: the record's, else nats per byte; per token on token shards)")
    args = p.parse_args(argv)
    runs, settings = load_results(args.results)
    unit = args.unit or settings.get("loss_unit") or (
        "nats per token" if "token shard" in str(settings.get("data", "")) else "nats per byte")
    device = settings.get("device")
    title = f"dion3 compare --preset {settings.get('preset', '?')}" + (f" ({device})" if device else "")
    print(plot_validation(runs, args.out, title, unit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
