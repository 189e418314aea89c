"""The study model's whole training step for each frontier setting, timed with the device to itself:

    python -m dion3.tools.study.train_step --model llama-hf-110m --compile --json OUT.json

One process builds the model once (with --compile its forward and backward go through
torch.compile, as the study's --compile runs) and, for each setting in turn, a fresh optimizer
built as the study builds it (trainer.build_optimizer). It then times --steps training steps
after --warmup untimed ones, on random byte tokens in the model's batch shape: the whole step
(forward, backward, optimizer step) and the optimizer step alone. CUDA events on a GPU, the host
clock on the CPU; medians over the timed steps of every round. --rounds repeats the list of
settings, so slow drift of the device hits every setting alike. The optimizer steps eagerly, or
also captured in a CUDA graph (CapturedStep) with --captured.

Settings are named as `dion3 bench` and `dion3 compare` name them (dion3.tools.setting_names):
adamw, muon, normuon, dion3-F (F on every matrix) and dion3-F-cost (fractions by cost within F's
modeled step time), e.g. dion3-1/2-cost; rows name each setting that way. Their lr and μ are
the study's bests; they do not change the time of a step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from ...optim.graph import CapturedStep
from ..train.model import GPT, GPTConfig, padded_vocab
from ..bench.step_time import parse_variant
from ..train.trainer import RunSpec, StepClock, bf16_autocast, build_optimizer, resolve_device
from .child import build_llama
from .runs import MODELS

DEFAULT_SETTINGS = "adamw,muon,normuon,dion3-1/4-cost,dion3-3/8-cost,dion3-1/2-cost"
# (lr, μ) per family: the study's bests (benchmarks/results/frontier); the step time does not depend on them
RATES = {"adamw": (0.0005, None), "muon": (0.01, 0.7), "normuon": (0.02, 0.6), "dion3": (0.015, 0.6)}
BYTE_VOCABULARY = 256
CAPTURE_WARMUP = 4  # CapturedStep's three eager steps and its capture


@dataclass
class StepTimes:
    setting: str
    mode: str  # "eager" or "captured"
    total_ms: float  # median whole training step
    optimizer_ms: float  # median optimizer step
    tokens_per_second: float


def run_spec(name: str) -> RunSpec:
    """The study's RunSpec of a setting name (module docstring), labelled with the setting's one
    spelling; Dion3's names are read as `dion3 bench` reads them (parse_variant), with fixed
    fractions and float32 momentum as the study runs them."""
    if name in RATES and name != "dion3":
        family, fraction, allocation = name, None, "uniform"
    else:
        try:
            variant = parse_variant(name)
        except ValueError:
            variant = None
        if variant is None or variant.algorithm != "dion3" or variant.warmup_steps is not None or variant.momentum_dtype:
            raise SystemExit(f"train_step: unknown setting {name!r}; expected adamw, muon, normuon, dion3-F or "
                             "dion3-F-cost with F in (0, 1], e.g. dion3-1/4-cost")
        family, fraction, allocation, name = "dion3", variant.fraction, variant.allocation, variant.name
    lr, mu = RATES[family]
    return RunSpec(name, family, lr, fraction, mu, fraction_allocation=allocation)


def build_model(model_name: str, device: torch.device) -> tuple[torch.nn.Module, int, int]:
    """(the study's model on device, batch size, sequence length)."""
    spec = MODELS[model_name]
    config = GPTConfig(seq_len=spec.seq_len, n_layer=spec.n_layer, n_head=spec.n_head, d_model=spec.d_model,
                       vocab_size=padded_vocab(BYTE_VOCABULARY))
    factory = GPT if spec.kind == "gpt" else build_llama(spec)
    torch.manual_seed(0)
    return factory(config).to(device), spec.batch_size, spec.seq_len


def time_setting(model, forward, spec: RunSpec, tokens, targets, device: torch.device, captured: bool,
                 warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(whole-step ms, optimizer ms) of `steps` timed training steps with a fresh optimizer."""
    model.zero_grad(set_to_none=True)
    optimizer = build_optimizer(model, spec)
    step = CapturedStep(optimizer) if captured else optimizer.step
    clock = StepClock(device)
    for number in range(warmup + steps):
        start = clock.mark()
        with bf16_autocast(device):
            loss = forward(tokens, targets)
        loss.backward()
        middle = clock.mark()
        step()
        end = clock.mark()
        optimizer.zero_grad(set_to_none=not captured)  # captured: the graph reads the same gradient buffers
        if number >= warmup:
            clock.add("total", start, end)
            clock.add("optimizer", middle, end)
    times = clock.milliseconds("total"), clock.milliseconds("optimizer")
    del step, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def measure(model_name: str, settings: Sequence[str], device: torch.device, compiled: bool, captured: bool,
            warmup: int, steps: int, rounds: int, progress=print) -> list[StepTimes]:
    specs = [run_spec(name) for name in settings]
    model, batch, seq_len = build_model(model_name, device)
    forward = torch.compile(model, dynamic=False) if compiled else model
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, BYTE_VOCABULARY, (batch, seq_len + 1), generator=generator).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    modes = ["eager", "captured"] if captured else ["eager"]
    timed: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for round_number in range(rounds):
        for spec in specs:
            for mode in modes:
                total, inner = time_setting(model, forward, spec, inputs, targets, device, mode == "captured", warmup, steps)
                kept = timed.setdefault((spec.label, mode), ([], []))
                kept[0].extend(total)
                kept[1].extend(inner)
                progress(f"round {round_number + 1}/{rounds}: {spec.label} ({mode}) whole step "
                         f"{statistics.median(total):.2f} ms, optimizer {statistics.median(inner):.2f} ms")
    tokens_per_step = batch * seq_len
    return [StepTimes(label, mode, statistics.median(total), statistics.median(inner),
                      tokens_per_step / (statistics.median(total) / 1e3))
            for (label, mode), (total, inner) in timed.items()]


def table(model_name: str, rows: Sequence[StepTimes]) -> str:
    reference = {row.mode: row.total_ms for row in rows if row.setting == "muon"}
    lines = ["| model | setting | optimizer step | whole step ms | optimizer ms | tokens/s | whole step × Muon's |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row.total_ms / reference[row.mode]:.2f}" if row.mode in reference else "—"
        lines.append(f"| {model_name} | {row.setting} | {row.mode} | {row.total_ms:.2f} | {row.optimizer_ms:.2f} | "
                     f"{row.tokens_per_second:,.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-hf-110m", choices=sorted(MODELS))
    parser.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma list (default {DEFAULT_SETTINGS})")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per setting and round (default 30)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the settings (default 2)")
    parser.add_argument("--compile", action="store_true", help="forward and backward through torch.compile")
    parser.add_argument("--captured", action="store_true", help="also the optimizer step captured (CUDA only)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="write the rows and the machine here")
    args = parser.parse_args(argv)
    for flag in ("steps", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    if args.captured and device.type != "cuda":
        parser.error("--captured captures CUDA graphs: it needs a GPU (--device cuda)")
    if args.captured and args.warmup < CAPTURE_WARMUP:
        parser.error(f"--captured needs --warmup {CAPTURE_WARMUP} or more: CapturedStep steps eagerly three times, "
                     "then captures, and the capture is not a step to time")
    settings = [name.strip() for name in args.settings.split(",") if name.strip()]
    for name in settings:
        run_spec(name)  # every name checked before the model is built
    rows = measure(args.model, settings, device, args.compile, args.captured, args.warmup, args.steps, args.rounds)
    print(table(args.model, rows), flush=True)
    if args.json:
        machine = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "compiled": args.compile, "steps": args.steps, "warmup": args.warmup,
                       "rounds": args.rounds, "machine": machine, "rows": [asdict(row) for row in rows]}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
