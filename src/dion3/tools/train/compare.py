"""`dion3 compare`: train one model from one seed with AdamW, Muon, NorMuon and Dion3, on the
same batches, and compare final validation loss and step times.

Writes to --out: summary.md (the table), results.json (settings and every curve), history.csv
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from .data import load_data
from .model import GPT, GPTConfig
from .plot import loss_unit, plot_validation
from .trainer import RunResult, RunSpec, Schedule, build_optimizer, resolve_device, train, use_captured_step

# Dion3 at the README's two named settings, fractions by cost (on cpu-tiny's shapes ½ by cost puts ½
# on every matrix; ¼ by cost ended 0.035 below ¼ on every matrix over three seeds,
# benchmarks/results/compare-cpu-tiny-2026-12-04.md)
DEFAULT_OPTIMIZERS = ("adamw", "muon", "normuon", "dion3-f0.5-cost", "dion3-f0.25-cost")


@dataclass(frozen=True)
class Preset:
    model: GPTConfig
    schedule: Schedule
    lrs: dict  # matrix learning rate per optimizer name (docs/training.md explains the values)
    mus: dict = dataclasses.field(default_factory=dict)  # momentum per optimizer name, if not the default
    device: str = "auto"
    bf16: bool = False
    threads: Optional[int] = None  # CPU threads for torch; None keeps torch's default


PRESETS: dict[str, Preset] = {
    # ~1.7 M parameters, byte-level; sized for ≤ 10 minutes of all five runs on 2 CPU cores.
    "cpu-tiny": Preset(
        # 256-wide matrices: at 128 wide, f=¼ selects only 32 rows a step and Dion3 trailed
        # NorMuon by 0.03 (benchmarks/results/compare-cpu-tiny-2026-12-04.md, "Earlier"); 2 layers
        # keep the five runs inside 10 minutes on 2 cores.
        model=GPTConfig(seq_len=128, n_layer=2, n_head=4, d_model=256),
        schedule=Schedule(steps=200, batch_size=16, eval_every=25, eval_batches=8, warmup_steps=10),
        lrs={"adamw": 0.004, "muon": 0.02, "normuon": 0.02, "dion3-f0.5": 0.042, "dion3-f0.25": 0.08},
        mus={"muon": 0.6, "normuon": 0.6, "dion3-f0.5": 0.3, "dion3-f0.25": 0.3},
        device="cpu",
        # One thread: these small matrices gain little from a second one, and on a busy machine
        # (CI runners, shared hosts) OpenMP threads waiting on each other cost several times more.
        threads=1,
    ),
    # ~25 M parameters in the blocks (d=512, 8 layers); 6.2 minutes for all five runs on one H200.
    "gpu-small": Preset(
        model=GPTConfig(seq_len=1024, n_layer=8, n_head=8, d_model=512),
        schedule=Schedule(steps=1500, batch_size=16, eval_every=100, eval_batches=16, warmup_steps=50),
        # Not tuned on a GPU yet: cpu-tiny's values, with a lower AdamW lr for the wider model.
        lrs={"adamw": 0.003, "muon": 0.02, "normuon": 0.02, "dion3-f0.5": 0.042, "dion3-f0.25": 0.06},
        mus={"muon": 0.6, "normuon": 0.6, "dion3-f0.5": 0.3, "dion3-f0.25": 0.3},
        device="cuda",
        bf16=True,
    ),
}


def run_spec(name: str, preset: Preset, lr_overrides: dict, mu_overrides: dict) -> RunSpec:
    """"adamw", "muon", "normuon", "dion3-f<fraction>", "dion3-f<fraction>-warm<steps>" (the
    fraction warmed up linearly from 1 over the first <steps> steps) or "dion3-f<fraction>-cost"
    (fixed fractions per matrix shape within <fraction>'s modeled H200 step time,
    param_groups' fraction_allocation="cost"). A Dion3 run without its own
    lr/momentum takes those of its fraction without warm-up, else the f=¼ lr scaled by the 1/√f
    rule of thumb (and the f=¼ momentum)."""
    lrs, mus = {**preset.lrs, **lr_overrides}, {**preset.mus, **mu_overrides}
    if name in ("adamw", "muon", "normuon"):
        return RunSpec(name, name, lrs[name], mu=mus.get(name))
    if name.startswith("dion3-f"):
        rest = name[len("dion3-f"):]
        allocation = "cost" if rest.endswith("-cost") else "uniform"
        fraction_text, _, warmup_text = rest.removesuffix("-cost").partition("-warm")
        try:
            fraction = float(fraction_text)
        except ValueError:
            fraction = math.nan
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"--optimizers: {name!r} needs a fraction in (0, 1], e.g. dion3-f0.25")
        warmup = 0
        if warmup_text or name.endswith("-warm"):
            if not warmup_text.isdigit() or int(warmup_text) < 1:
                raise ValueError(f"--optimizers: {name!r} needs a positive number of warm-up steps, e.g. dion3-f0.25-warm200")
            warmup = int(warmup_text)
        if warmup and allocation == "cost":  # a warm-up sets one fraction on every group
            raise ValueError(f"--optimizers: {name!r}: fractions by cost are fixed, they take no -warm<steps>")
        base = f"dion3-f{fraction_text}"
        lr = lrs.get(name, lrs.get(base, preset.lrs["dion3-f0.25"] * math.sqrt(0.25 / fraction)))
        mu = mus.get(name, mus.get(base, preset.mus.get("dion3-f0.25")))
        return RunSpec(name, "dion3", lr, fraction, mu, warmup, allocation)
    raise ValueError(f"--optimizers: unknown optimizer {name!r}; use adamw, muon, normuon, dion3-f<fraction>, "
                     "dion3-f<fraction>-warm<steps> or dion3-f<fraction>-cost")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dion3 compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS), help="model size, steps, lrs (default cpu-tiny)")
    parser.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                        help="comma-separated; dion3-f<f>-warm<steps> warms the fraction up from 1, dion3-f<f>-cost "
                             "sets fractions per matrix shape within f's modeled H200 step time "
                             "(dion3.ortho.cost.modeled_seconds) (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="training steps per optimizer (preset default otherwise)")
    parser.add_argument("--batch-size", type=int, help="sequences per step")
    parser.add_argument("--eval-every", type=int, help="steps between validation evaluations")
    parser.add_argument("--lr", action="append", default=[], metavar="NAME=LR", help="override one optimizer's matrix lr, e.g. --lr muon=0.03")
    parser.add_argument("--mu", action="append", default=[], metavar="NAME=MU", help="override one optimizer's momentum, e.g. --mu dion3-f0.25=0.8")
    parser.add_argument("--data", nargs="+", metavar="PATH", help="text files/directories or .bin token shards (default: the Python standard library)")
    parser.add_argument("--out", type=Path, help="output directory (default: compare-<preset>)")
    parser.add_argument("--device", help="auto, cpu or cuda[:N] (preset default otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and batch order (default 0)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: the preset's, else torch's choice)")
    parser.add_argument("--eager", action="store_true",
                        help="on a GPU, run eager optimizer steps instead of one captured CUDA graph per step "
                             "(the default there); CPU steps are always eager")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    return args


def _overrides(flag: str, items: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """NAME=VALUE pairs of a repeatable option, for optimizers that are being run."""
    overrides = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            overrides[name] = float(value)
        except ValueError:
            raise ValueError(f"{flag}: expected NAME=VALUE (e.g. muon=0.02), got {item!r}") from None
        if name not in names:
            raise ValueError(f"{flag}: {name!r} is not among the optimizers being run ({', '.join(names)})")
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


def summary_table(results: Sequence[RunResult]) -> str:
    lines = [
        "| optimizer | matrix lr | momentum | average fraction | final val loss | optimizer ms/step | total ms/step | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fraction = "—" if r.average_fraction is None else f"{r.average_fraction:.3f}"
        lines.append(
            f"| {r.label} | {r.lr:g} | {'—' if r.mu is None else f'{r.mu:g}'} | {fraction} | {r.final_val_loss:.4f} | {r.optimizer_ms:.2f} | {r.total_ms:.1f} | {r.tokens_per_second:,.0f} |"
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
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
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

    table = summary_table(results)
    settings = {
        "preset": args.preset, "model": dataclasses.asdict(preset.model), "schedule": dataclasses.asdict(schedule),
        "device": str(device), "bf16": preset.bf16, "captured_step": captured, "seed": args.seed, "data": data.description,
        "loss_unit": loss_unit(data.vocab_size),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.platform(),
        "total_minutes": round(total_minutes, 2),
    }
    write_logs(out, results, settings)
    (out / "summary.md").write_text(table + "\n")
    plot = plot_validation(results, out / "val_loss.png", f"dion3 compare --preset {args.preset} ({device})",
                           settings["loss_unit"])
    print(f"\n{table}\n\n{total_minutes:.1f} min in all; wrote {out}/summary.md, results.json, history.csv, {plot.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
