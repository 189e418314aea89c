"""summary.md: one row per setting and horizon, mean ± standard deviation over seeds, non-finite
runs and skipped updates counted apart (never averaged)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Sequence

from ...optim.param_groups import BY_COST
from ..setting_names import Dion3Setting
from .launch import read_results
from .runs import MODELS, Run, rule_label, schedule_label, selection_label


def _setting_label(setting: tuple) -> tuple[str, str]:
    """(optimizer, fraction budget): the budget worded as `dion3 compare` words it ("1/4 by cost")."""
    (_, _, optimizer, fraction, warmup, _, _, allocation, _, _, cost_rule, row_score, weights, schedule, decay,
     full_every, _) = setting
    if optimizer != "dion3":
        return {"adamw": "AdamW", "muon": "Muon", "normuon": "NorMuon"}[optimizer] + schedule_label(schedule), "—"
    rule = " (FLOP rule)" if allocation in BY_COST and not cost_rule else ""
    return ("Dion3" + selection_label(row_score, weights) + schedule_label(schedule) + rule_label(decay, full_every),
            Dion3Setting(fraction, allocation, warmup).budget + rule)


def summary_table(records: Sequence[dict]) -> str:
    """Markdown: one row per setting and horizon, mean ± standard deviation over its seeds,
    best mean loss first within each horizon and model."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(Run(**{**record["config"], "data": None}).setting, []).append(record)
    lines = [
        "| model | horizon | optimizer | fraction budget | lr | μ | seeds | non-finite | skipped updates | final val loss "
        "| train loss, last 50 steps | share of rows orthogonalized | optimizer ms (median) | optimizer TFLOP / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for setting, members in groups.items():
        # a non-finite run is a bug to explain, never a sample to average: counted apart
        finite = [m for m in members if math.isfinite(m["final_val_loss"]) and not m.get("nonfinite_parameters")]
        skipped = sum(m.get("nonfinite_updates", 0) for m in members)  # the optimizer's guard (rules.update_verdict)
        losses = [m["final_val_loss"] for m in finite]
        mean = statistics.fmean(losses) if losses else math.inf
        loss_text = f"{mean:.4f} ± {statistics.stdev(losses) if len(losses) > 1 else 0.0:.4f}" if losses else "—"
        train = [m["final_train_loss"] for m in finite if "final_train_loss" in m]  # absent in older records
        train_text = f"{statistics.fmean(train):.4f}" if train and len(train) == len(finite) else "—"
        flops = [m["optimizer_tflop"] for m in members if "optimizer_tflop" in m]  # absent in older records
        flops_text = f"{statistics.fmean(flops):.4g}" if flops and len(flops) == len(members) else "—"
        rows.append((setting[0], setting[1], mean, setting, len(members), len(members) - len(finite), skipped, loss_text, train_text,
                     statistics.fmean(m["average_fraction"] for m in members),
                     statistics.median(m["optimizer_ms_median"] for m in members), flops_text))
    for (model, horizon, _, setting, count, bad, skipped, loss_text, train_text, fraction, step_ms,
         flops_text) in sorted(rows, key=lambda r: r[:3]):
        name, schedule = _setting_label(setting)
        batch = setting[-1]  # Run.setting: the batch size last
        notes = ["compiled"] * setting[8] + ([f"batch {batch}"] if model in MODELS and batch != MODELS[model].batch_size else [])
        model = f"{model} ({', '.join(notes)})" if notes else model
        name = f"{name}, {setting[9]} momentum" if setting[9] else name
        lines.append(f"| {model} | {horizon} | {name} | {schedule} | {setting[5]:g} | {setting[6]:g} | {count} | {bad} | {skipped} | "
                     f"{loss_text} | {train_text} | {fraction:.3f} | {step_ms:.2f} | {flops_text} |")
    return "\n".join(lines)


def _sharing_note(records: Sequence[dict]) -> str:
    """How many runs shared the device while the step times were measured, from the records (each
    run records its study's --jobs; records written before that field say nothing)."""
    counts = [r["runs_at_once"] for r in records if "runs_at_once" in r]
    seen = [r["gpu_processes_max"] for r in records if r.get("gpu_processes_max") is not None]
    on_gpu = f", up to {max(seen)} processes seen on the GPU ({len(seen)} of {len(records)} runs counted them)" if seen else ""
    if not counts:
        return "with an unrecorded number of runs sharing the device" + on_gpu
    unrecorded = len(records) - len(counts)
    return (f"with up to {max(counts)} runs of one study sharing the device"
            + (f" ({unrecorded} older records do not say how many)" if unrecorded else "") + on_gpu)


def write_summary(out: Path) -> str:
    records = read_results(out / "results.jsonl")
    table = summary_table(records)
    note = (f"Final validation loss (nats per byte), mean ± standard deviation over seeds; optimizer step "
            f"time: median over each run's steps after the first 5, median over seeds, measured "
            f"{_sharing_note(records)}; optimizer TFLOP: executed orthogonalization FLOPs of a run's steps "
            f"(mean over seeds; H200 cost model of `dion3 bench`). {len(records)} runs in results.jsonl.")
    repeated = sum(1 for r in records if not r["config"].get("read_once", False))
    if repeated:
        note += (f"\n\n**{repeated} runs drew random windows that may read data more than once** (--allow-repeat, or "
                 "records from before read-once data): their losses include memorization.")
    (out / "summary.md").write_text(f"# Quality study\n\n{note}\n\n{table}\n")
    return table


def write_report(path: Path, sections: Sequence[str]) -> None:
    """A report's markdown file, also printed (the study tools' outputs)."""
    text = "\n".join(sections)
    path.write_text(text)
    print(text)
