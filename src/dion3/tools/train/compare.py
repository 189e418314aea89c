"""`dion3 compare`: train one model from one seed with AdamW, Muon, NorMuon and Dion3, on the
same batches, and compare final validation loss and step times.

Writes to --out: summary.md (the table, and where the preset's lrs and momenta come from),
results.json (settings and every curve), history.csv
(one row per evaluation) and val_loss.png (validation loss, nats per byte or per token, against
step and wall-clock time).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import platform
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..models import REGISTRY, refusal
from ..setting_names import GRAMMAR, Dion3Setting, canonical_name, parse_dion3
from .data import load_data
from .model import GPT, GPTConfig
from .plot import loss_unit, plot_validation
from .trainer import RunResult, RunSpec, Schedule, build_optimizer, resolve_device, train, use_captured_step

# Dion3 at the README's two named settings, fractions by cost (on cpu-tiny's shapes ½ by cost puts ½
# on every matrix; ¼ by cost ended 0.035 below ¼ on every matrix over three seeds,
# benchmarks/results/compare-cpu-tiny-2026-12-04.md)
DEFAULT_OPTIMIZERS = ("adamw", "muon", "normuon", "dion3-1/2-cost", "dion3-1/4-cost")


@dataclass(frozen=True)
class Preset:
    model: GPTConfig
    schedule: Schedule
    lrs: dict  # matrix learning rate per optimizer name (docs/training.md explains the values)
    mus: dict = dataclasses.field(default_factory=dict)  # momentum per optimizer name, if not the default
    device: str = "auto"
    bf16: bool = False
    threads: Optional[int] = None  # CPU threads for torch; None keeps torch's default
    # Where lrs and mus come from, printed under the table: its values are not the README's, and a
    # reader comparing the two needs to know which model chose each (settings_note).
    source: str = "set in the preset, not tuned"
    source_details: tuple[str, ...] = ()


# The README's settings, and where they were chosen: printed beside every preset's own.
STUDY_SETTINGS = ("The README's lr 0.02 and μ 0.6 (Dion3 1/2, 3/8 and 1/4 by cost) are the study models' "
                  "settings, chosen from their lr grids (Llama shapes of 19 M–350 M parameters, data read once, 1500 steps; "
                  "docs/training.md, \"Horizon → recommended fraction schedule, lr, μ\").")


def gpt_config(name: str, seq_len: int) -> GPTConfig:
    """The GPT of a model name of dion3.tools.models (its layers, width, heads and MLP width),
    with the given context."""
    model = REGISTRY[name]
    return GPTConfig(seq_len=seq_len, n_layer=model.n_layer, n_head=model.n_head, d_model=model.d_model,
                     mlp_ratio=model.mlp_width // model.d_model)


# The models' shapes are those of their names in dion3.tools.models (2 × 256 and 8 × 512).
PRESETS: dict[str, Preset] = {
    # ~1.7 M parameters, byte-level; sized for ≤ 10 minutes of all five runs on 2 CPU cores.
    "cpu-tiny": Preset(
        model=gpt_config("cpu-tiny", seq_len=128),
        schedule=Schedule(steps=200, batch_size=16, eval_every=25, eval_batches=8, warmup_steps=10),
        lrs={"adamw": 0.004, "muon": 0.02, "normuon": 0.02, "dion3-1/2": 0.042, "dion3-1/4": 0.08},
        mus={"muon": 0.6, "normuon": 0.6, "dion3-1/2": 0.3, "dion3-1/4": 0.3},
        device="cpu",
        # One thread: these small matrices gain little from a second one, and on a busy machine
        # (CI runners, shared hosts) OpenMP threads waiting on each other cost several times more.
        threads=1,
        source="tuned for this 1.7 M-parameter byte model over 200 steps, not the README's settings",
        source_details=(
            "Dion3 1/4 by cost: lr 0.08, the best of a 3-seed lr grid on this model (0.04, 0.06, 0.08, 0.11; "
            "benchmarks/results/compare-cpu-tiny-2026-12-04.md); at 0.04 it ended 0.05 higher.",
            "AdamW's lr 0.004, NorMuon's μ 0.6 and Dion3's μ 0.3: sweeps on the first cpu-tiny model (4 × 128, "
            "250 steps; commit a53f457), Muon taking NorMuon's lr and μ; Dion3 1/2's lr 0.042 is f = 1/4's lr "
            "of then (0.06) scaled by 1/√f, not swept (docs/training.md, \"Learning rates\").",
        ),
    ),
    # ~25 M parameters in the blocks (d=512, 8 layers); 6.2 minutes for all five runs on one H200.
    "gpu-small": Preset(
        model=gpt_config("gpu-small", seq_len=1024),
        schedule=Schedule(steps=1500, batch_size=16, eval_every=100, eval_batches=16, warmup_steps=50),
        # Not tuned on a GPU yet: the first cpu-tiny model's values, a lower AdamW lr for the wider model.
        lrs={"adamw": 0.003, "muon": 0.02, "normuon": 0.02, "dion3-1/2": 0.042, "dion3-1/4": 0.06},
        mus={"muon": 0.6, "normuon": 0.6, "dion3-1/2": 0.3, "dion3-1/4": 0.3},
        device="cuda",
        bf16=True,
        source="not tuned on this model: the values of cpu-tiny's first, 4 × 128 version, with AdamW's lr "
               "lowered to 0.003 for the wider model (docs/training.md, \"Learning rates\")",
    ),
}


def run_spec(name: str, preset: Preset, lr_overrides: dict, mu_overrides: dict) -> RunSpec:
    """"adamw", "muon", "normuon", or a Dion3 setting as dion3.tools.setting_names spells it (as
    `dion3 bench` does): "dion3-F" (F on every matrix, e.g. dion3-1/4), "dion3-F-warmupN" (the
    fraction warmed up linearly from 1 over the first N steps), "dion3-F-cost" (fractions per
    matrix shape within F's modeled H200 step time, param_groups' fraction_allocation="cost") or
    "dion3-F-cost-warmupN" (that budget warmed up from 1);
    the old spellings dion3-f0.25, dion3-f0.25-warm200 and dion3-f0.25-cost are read too. The run
    is labelled with the setting's one spelling. A Dion3 run without its own lr/momentum takes
    those of its fraction on every matrix, else the f=¼ lr scaled by 1/√f (and the f=¼ momentum):
    a fallback where nothing was measured, since on the study models the best lr did not follow
    1/√f (docs/training.md, "Learning rates"). The overrides are keyed by that spelling too (_overrides)."""
    lrs, mus = {**preset.lrs, **lr_overrides}, {**preset.mus, **mu_overrides}
    if name in ("adamw", "muon", "normuon"):
        return RunSpec(name, name, lrs[name], mu=mus.get(name))
    try:
        setting = parse_dion3(name)
    except ValueError as error:
        raise ValueError(f"--optimizers: {name!r}: {error}") from None
    if setting is None:
        raise ValueError(f"--optimizers: unknown optimizer {name!r}; use adamw, muon, normuon or {GRAMMAR}")
    label, base = setting.name, Dion3Setting(setting.fraction).name
    quarter = Dion3Setting(0.25).name
    lr = lrs.get(label, lrs.get(base, preset.lrs[quarter] * math.sqrt(0.25 / setting.fraction)))
    mu = mus.get(label, mus.get(base, preset.mus.get(quarter)))
    return RunSpec(label, "dion3", lr, setting.fraction, mu, setting.warmup_steps, setting.allocation)


def settings_note(preset_name: str, preset: Preset, specs: Sequence[RunSpec]) -> str:
    """Where each run's lr and momentum come from, for under the table: the preset's record, any run
    whose values the command line changed or the preset has none of, and the README's settings."""
    bullets = list(preset.source_details)
    for spec in specs:
        lr, mu = _preset_values(spec.label, preset)
        changed = ([f"lr {spec.lr:g} (preset: {lr:g})"] if spec.lr != lr else []) + \
                  ([f"μ {_mu(spec.mu)} (preset: {_mu(mu)})"] if spec.mu != mu else [])
        if changed:
            bullets.append(f"{spec.label}: {' and '.join(changed)} set on the command line.")
        elif spec.algorithm == "dion3" and not {spec.label, Dion3Setting(spec.fraction).name} & set(preset.lrs):
            bullets.append(f"{spec.label}: no value of its own in the preset: lr {spec.lr:g} is f = 1/4's lr scaled "
                           "by 1/√f and its μ is f = 1/4's, neither tuned for it (on the study models the best lr "
                           "did not follow 1/√f; docs/training.md, \"Learning rates\").")
    bullets.append(STUDY_SETTINGS)
    # 100 columns for a terminal; paths and names with hyphens stay whole
    wrap = dict(width=100, break_on_hyphens=False, break_long_words=False)
    lines = [textwrap.fill(f"Settings of --preset {preset_name}: {preset.source}.", **wrap)]
    lines += [textwrap.fill(b, initial_indent="- ", subsequent_indent="  ", **wrap) for b in bullets]
    return "\n".join(lines)


def _preset_values(name: str, preset: Preset) -> tuple[float, Optional[float]]:
    spec = run_spec(name, preset, {}, {})
    return spec.lr, spec.mu


def _mu(mu: Optional[float]) -> str:
    return "the optimizer's default" if mu is None else f"{mu:g}"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dion3 compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-tiny", metavar="NAME",
                        help=f"model size, steps, lrs: {', '.join(sorted(PRESETS))} (default cpu-tiny)")
    parser.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                        help="comma-separated; dion3-F (F on every matrix, e.g. dion3-1/4), dion3-F-warmupN warms "
                             "the fraction up from 1 over N steps, dion3-F-cost sets fractions per matrix shape "
                             "within F's modeled H200 step time (dion3.ortho.cost.modeled_seconds), "
                             "dion3-F-cost-warmupN warms that budget up; `dion3 bench` "
                             "names the same settings alike (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="training steps per optimizer (preset default otherwise)")
    parser.add_argument("--batch-size", type=int, help="sequences per step")
    parser.add_argument("--eval-every", type=int, help="steps between validation evaluations")
    parser.add_argument("--lr", action="append", default=[], metavar="NAME=LR", help="override one optimizer's matrix lr, e.g. --lr muon=0.03")
    parser.add_argument("--mu", action="append", default=[], metavar="NAME=MU", help="override one optimizer's momentum, e.g. --mu dion3-1/4=0.8")
    parser.add_argument("--data", nargs="+", metavar="PATH", help="text files/directories or .bin token shards (default: the Python standard library)")
    parser.add_argument("--out", type=Path, help="output directory (default: compare-<preset>)")
    parser.add_argument("--device", help="auto, cpu or cuda[:N] (preset default otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and batch order (default 0)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: the preset's, else torch's choice)")
    parser.add_argument("--eager", action="store_true",
                        help="on a GPU, run eager optimizer steps instead of one captured CUDA graph per step "
                             "(the default there); CPU steps are always eager")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:  # e.g. a model of `dion3 bench` or the study: say which commands take it
        parser.error(f"--preset: {refusal(args.preset, 'compare')}")
    for name in ("steps", "batch_size", "eval_every", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    return args


def _overrides(flag: str, items: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """NAME=VALUE pairs of a repeatable option, for optimizers that are being run (`names`, each
    spelled as its run is labelled); a Dion3 NAME in another spelling means the same setting."""
    overrides = {}
    for item in items:
        given, _, value = item.partition("=")
        name = canonical_name(given)
        try:
            overrides[name] = float(value)
        except ValueError:
            raise ValueError(f"{flag}: expected NAME=VALUE (e.g. muon=0.02), got {item!r}") from None
        if name not in names:
            raise ValueError(f"{flag}: {given!r} is not among the optimizers being run ({', '.join(names)})")
    return overrides


def check_optimizers(specs: Sequence[RunSpec], config: GPTConfig) -> None:
    """Build every run's optimizer once on a meta-device model (no memory, no data) so that a bad
    lr or momentum fails before the first run trains, with the optimizer's own message."""
    with torch.device("meta"):
        model = GPT(config)
    for spec in specs:
        try:
            build_optimizer(model, spec)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{spec.label}: {error}") from None


class Progress:
    """A tqdm bar per run on a terminal; one plain line per evaluation otherwise (CI logs)."""

    def __init__(self, label: str, steps: int):
        self.label, self.steps, self.bar = label, steps, None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=f"{label:<12}", unit="step", leave=True, dynamic_ncols=True)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def evaluated(self, result: RunResult, step: int) -> None:
        message = f"val {result.val_losses[-1]:.4f}"
        if self.bar is not None:
            self.bar.set_postfix_str(message)
        else:
            print(f"[{self.label}] step {step:>5}/{self.steps}  {message}  ({result.eval_seconds[-1]:.1f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fraction_cells(result: RunResult) -> tuple[str, str]:
    """(fraction budget, fraction per matrix) of a run, for the table: the setting's fraction and how
    it is spent ("1/4 by cost", as its name dion3-1/4-cost says), and the least and greatest
    fraction any matrix held at any step ("0.188–0.5"). Muon and NorMuon orthogonalize every row
    (1); AdamW none."""
    if result.algorithm != "dion3":
        return "—", "1" if result.algorithm in ("muon", "normuon") else "—"
    budget = Dion3Setting(result.fraction, result.fraction_allocation, result.fraction_warmup).budget
    if result.fraction_range is None:  # a record from before the range was kept
        return budget, "—"
    low, high = (f"{value:.3g}" for value in result.fraction_range)
    return budget, low if low == high else f"{low}–{high}"


def summary_table(results: Sequence[RunResult], unit: str) -> str:
    """The table of the runs; `unit` is the loss's (plot.loss_unit: nats per byte on bytes), named in
    the header so that the table reads in the unit the README and the records give."""
    lines = [
        "| optimizer | matrix lr | momentum | fraction budget | fraction per matrix | "
        f"final val loss ({unit}) | optimizer ms/step | total ms/step | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        budget, per_matrix = fraction_cells(r)
        lines.append(
            f"| {r.label} | {r.lr:g} | {'—' if r.mu is None else f'{r.mu:g}'} | {budget} | {per_matrix} | "
            f"{r.final_val_loss:.4f} | {r.optimizer_ms:.2f} | {r.total_ms:.1f} | {r.tokens_per_second:,.0f} |"
        )
    return "\n".join(lines)


def write_logs(out: Path, results: Sequence[RunResult], settings: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs = [dict(dataclasses.asdict(r), final_val_loss=r.final_val_loss, tokens_per_second=r.tokens_per_second) for r in results]
    (out / "results.json").write_text(json.dumps({"settings": settings, "runs": runs}, indent=1) + "\n")
    with open(out / "history.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["optimizer", "step", "train_seconds", "val_loss"])
        for r in results:
            for row in zip(r.eval_steps, r.eval_seconds, r.val_losses):
                writer.writerow([r.label, row[0], f"{row[1]:.3f}", f"{row[2]:.5f}"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return _compare(args)
    except (ValueError, OSError) as error:
        print(f"dion3 compare: error: {error}", file=sys.stderr)
        return 2


def _compare(args: argparse.Namespace) -> int:
    preset = PRESETS[args.preset]
    threads = args.threads or preset.threads
    if threads:
        torch.set_num_threads(threads)
    given = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    names = [canonical_name(name) for name in given]
    for old, name in zip(given, names):
        if old != name:  # another spelling of the setting: the table, logs and plot use its name
            print(f"note: {old} is written {name}", file=sys.stderr)
    lrs, mus = _overrides("--lr", args.lr, names), _overrides("--mu", args.mu, names)
    specs = [run_spec(name, preset, lrs, mus) for name in names]
    changes = {k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size), ("eval_every", args.eval_every)) if v}
    schedule = dataclasses.replace(preset.schedule, **changes)
    device = resolve_device(args.device or preset.device)
    captured = use_captured_step(device, args.eager)
    out = args.out or Path(f"compare-{args.preset}")
    check_optimizers(specs, preset.model)
    data = load_data(args.data)
    print(f"dion3 compare --preset {args.preset}: {len(specs)} runs × {schedule.steps} steps on {device} "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {'captured' if captured else 'eager'} "
          f"optimizer steps); data: {data.description}, "
          f"{data.train.numel():,} train / {data.val.numel():,} val tokens", flush=True)

    results, started = [], time.perf_counter()
    for spec in specs:
        progress = Progress(spec.label, schedule.steps)
        results.append(train(spec, preset.model, schedule, data, device, args.seed, preset.bf16, progress.evaluated, progress.step,
                             captured=captured))
        progress.close()
    total_minutes = (time.perf_counter() - started) / 60

    unit = loss_unit(data.vocab_size)
    table = summary_table(results, unit)
    settings = {
        "preset": args.preset, "model": dataclasses.asdict(preset.model), "schedule": dataclasses.asdict(schedule),
        "device": str(device), "bf16": preset.bf16, "captured_step": captured, "seed": args.seed, "data": data.description,
        "loss_unit": unit,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.platform(),
        "total_minutes": round(total_minutes, 2),
    }
    note = settings_note(args.preset, preset, specs)
    settings["settings_source"] = note
    write_logs(out, results, settings)
    (out / "summary.md").write_text(f"{table}\n\n{note}\n")
    plot = plot_validation(results, out / "val_loss.png", f"dion3 compare --preset {args.preset} ({device})",
                           settings["loss_unit"])
    print(f"\n{table}\n\n{note}\n\n{total_minutes:.1f} min in all; wrote {out}/summary.md, results.json, history.csv, {plot.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
