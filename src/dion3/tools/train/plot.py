"""The comparison plot: validation loss against step and against training wall-clock time."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .trainer import RunResult


def plot_validation(results: Sequence[RunResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display (CI, servers)
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for result in results:
        by_step.plot(result.eval_steps, result.val_losses, marker=".", label=result.label)
        by_time.plot(result.eval_seconds, result.val_losses, marker=".", label=result.label)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall-clock time (s, evaluation excluded)")
    finals = [r.final_val_loss for r in results]
    # the first evaluation after step 0, so the untrained loss does not squash the curves
    starts = [r.val_losses[min(1, len(r.val_losses) - 1)] for r in results]
    for axis in (by_step, by_time):
        axis.set_ylabel("validation loss")
        axis.grid(alpha=0.3)
        low, high = min(finals), max(starts)
        if high > low:
            axis.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
    by_step.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
