"""`dion3 bench`: time one optimizer step on model-shaped fp32 parameters.

Each variant (AdamW, the standard-NS Muon baseline, Muon with kernels and Gram NS, NorMuon,
Dion3 at several fractions, uniform or per shape by cost) runs alone, eager and graph-captured,
on fixed random gradients; memory is freed between runs and a failing variant reports its error
in its row. Reported per row: median device ms (CUDA events; perf_counter on CPU), median host
ms (time for the step call to return), kernel launches per step (CUDA), first step s (optimizer construction to the end of the
first step, including compilation and autotuning), ready s (to the end of warm-up, capture
included), effective TFLOP/s and GB/s from the cost model in flops.py, bytes sent per step,
speedup vs the baseline.

--ns-coefficients NAME runs every Muon, NorMuon and Dion3 variant (the baseline too) with that
Newton–Schulz schedule, e.g. polar_express_4 (4 steps): compare two runs, one per schedule.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shlex
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from ... import kernels
from ...optim import Dion3, Muon, NorMuon
from ...optim.cost_fractions import cost_allocated_fractions, cost_allocated_groups
from ...ortho.coefficients import SCHEDULES, get_schedule
from . import step_cost as flops
from .launches import launches_per_step
from .report import Progress, format_table
from .presets import PRESETS, Preset, get_preset, parse_shapes
from ..setting_names import GRAMMAR, Dion3Setting, canonical_name, parse_dion3

GRAPH_WARMUP = 3  # eager steps CapturedStep runs before capturing
BASELINE = "muon"


@dataclass(frozen=True)
class Variant:
    name: str
    algorithm: str  # adamw | muon | normuon | dion3
    fraction: Optional[float] = None
    orthogonalizer: str = "auto"
    kernels: bool = True  # Triton kernels enabled (dion3.kernels.set_kernels_enabled)
    # dion3: "uniform" (`fraction` on every matrix) or "cost" (one fraction per matrix shape, within
    # the modeled H200 step time of `fraction` on every matrix: dion3.optim.cost_fractions)
    allocation: str = "uniform"
    # dion3: the fraction warms up from 1 to `fraction` over this many steps (FractionWarmup, the
    # documented schedule); every step of the warm-up is timed and the row reports their mean
    warmup_steps: Optional[int] = None
    momentum_dtype: Optional[str] = None  # the matrix groups' momentum_dtype (NAME:bf16 variants)
    ns_coefficients: str = "polar_express"  # the Newton–Schulz schedule (--ns-coefficients), not AdamW's


NAMED_VARIANTS = {
    "adamw": Variant("adamw", "adamw", kernels=False),
    "muon": Variant("muon", "muon", orthogonalizer="newton_schulz", kernels=False),  # the baseline
    "muon-gram": Variant("muon-gram", "muon"),  # auto: Gram NS for non-square, NS for square
    "normuon": Variant("normuon", "normuon"),
}
# the settings the README measures (½, ⅜ and ¼ by cost among them; README "Which setting")
DEFAULT_OPTIMIZERS = ("adamw,muon,muon-gram,normuon,dion3-1/2,dion3-1/4,dion3-1/8,dion3-1/2-cost,dion3-3/8-cost,"
                      "dion3-1/4-cost,dion3-1/4-warmup200")


def parse_variant(name: str) -> Variant:
    """A named variant, or a Dion3 setting named as dion3.tools.setting_names spells it: dion3-F
    with F a fraction in (0, 1] such as 1/4 or 0.25; dion3-F-cost: per-shape fractions within the
    modeled H200 step time of dion3-F; dion3-F-warmupN: the fraction warmed up from 1 to F over N
    steps (FractionWarmup). Any orthogonal variant with ":bf16" (e.g. dion3-1/4:bf16) keeps its
    momentum in bf16 (momentum_dtype="bfloat16"). A Dion3 variant's name is the setting's one
    spelling (dion3-0.25 and dion3-f0.25 become dion3-1/4)."""
    if name.endswith(":bf16") and name != ":bf16":
        base = parse_variant(name[: -len(":bf16")])
        if base.algorithm == "adamw":
            raise ValueError(f"--optimizers: {name!r}: AdamW has no momentum_dtype")
        return dataclasses.replace(base, name=base.name + ":bf16", momentum_dtype="bfloat16")
    if name in NAMED_VARIANTS:
        return NAMED_VARIANTS[name]
    try:
        setting = parse_dion3(name)
    except ValueError as error:
        raise ValueError(f"--optimizers: unknown optimizer {name!r}: {error}") from None
    if setting is None:
        raise ValueError(f"--optimizers: unknown optimizer {name!r}; expected one of {sorted(NAMED_VARIANTS)} "
                         f"or {GRAMMAR}, each also with :bf16 (bf16 momentum)")
    if setting.allocation == "cost" and setting.warmup_steps:  # its steps' fractions are not priced here
        raise ValueError(f"--optimizers: {name!r}: the bench times fractions by cost fixed; bench the warm-up's "
                         f"end, {Dion3Setting(setting.fraction, 'cost').name}, or train the warm-up (dion3 compare)")
    return Variant(setting.name, "dion3", fraction=setting.fraction, allocation=setting.allocation,
                   warmup_steps=setting.warmup_steps or None)


# ------------------------------------------------------------------------ building a run
def make_parameters(preset: Preset, device: torch.device, with_scalars: bool):
    """Fresh fp32 matrices (and scalar params) with fixed random gradients."""
    def leaf(shape):
        p = torch.nn.Parameter(torch.randn(shape, device=device).mul_(0.02))
        p.grad = torch.randn(shape, device=device)
        return p

    matrices = [leaf((m.rows, m.cols)) for m in preset.matrices for _ in range(m.count)]
    scalars = [leaf(s.shape) for s in preset.scalars for _ in range(s.count)] if with_scalars else []
    return matrices, scalars


def make_optimizer(variant: Variant, matrices, scalars, device: torch.device, graph: bool):
    if variant.algorithm == "adamw":
        mode = {"fused": True} if device.type == "cuda" else {"foreach": True}
        return torch.optim.AdamW(matrices + scalars, lr=1e-3, weight_decay=0.01, capturable=graph, **mode)
    groups = [{"params": matrices}]
    if variant.allocation == "cost":  # one group per shape, each with its fraction by cost
        groups = cost_allocated_groups({"params": matrices, "orthogonalizer": variant.orthogonalizer,
                                        "ns_coefficients": variant.ns_coefficients}, variant.fraction)
    if scalars:
        groups.append({"params": scalars, "algorithm": "adamw", "lr": 1e-3})
    common = dict(lr=0.01, weight_decay=0.01, orthogonalizer=variant.orthogonalizer, momentum_dtype=variant.momentum_dtype,
                  ns_coefficients=variant.ns_coefficients)
    if variant.algorithm == "dion3":
        return Dion3(groups, fraction=variant.fraction, **common)
    return (Muon if variant.algorithm == "muon" else NorMuon)(groups, **common)


@contextmanager
def kernels_switched_off(off: bool):
    """Turn dion3's Triton kernels off for one run (the cuBLAS baseline), then restore them.
    Runs that want kernels leave the switch alone, so DION3_KERNELS=0 still applies to them."""
    previous = kernels.kernels_enabled()
    if off:
        kernels.set_kernels_enabled(False)
    try:
        yield
    finally:
        kernels.set_kernels_enabled(previous)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------ measuring
def timed_calls(step: Callable[[], object], count: int, device: torch.device, progress: Callable[[int], None]):
    """(device ms, host ms) per call: CUDA events around each call on GPU, perf_counter on CPU."""
    cuda = device.type == "cuda"
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)] if cuda else []
    host = []
    for i in range(count):
        if cuda:
            events[i][0].record()
        start = time.perf_counter()
        step()
        host.append((time.perf_counter() - start) * 1e3)
        if cuda:
            events[i][1].record()
        progress(i + 1)
    synchronize(device)
    device_ms = [begin.elapsed_time(end) for begin, end in events] if cuda else host
    return device_ms, host


def measure(variant: Variant, graph: bool, preset: Preset, args, device: torch.device, progress) -> dict:
    """Run warm-up and timed steps of one variant; return its measurements."""
    torch.manual_seed(0)
    matrices, scalars = make_parameters(preset, device, args.scalars)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    optimizer = make_optimizer(variant, matrices, scalars, device, graph)
    step = optimizer.step
    if graph:
        from ...optim.graph import CapturedStep  # the lead's capture wrapper

        step = CapturedStep(optimizer, warmup_steps=GRAPH_WARMUP)
    if variant.warmup_steps:  # the schedule: every one of its steps timed, from its first
        from ...optim.fraction_schedule import FractionScheduler, FractionWarmup

        scheduler = FractionScheduler(optimizer, FractionWarmup(variant.fraction, steps=variant.warmup_steps))
        plain_step = step

        def step():
            plain_step()
            scheduler.step()

        first = ready = time.perf_counter() - start
        device_ms, host_ms = timed_calls(step, variant.warmup_steps, device,
                                         lambda i: progress(f"step {i}/{variant.warmup_steps}"))
        return dict(device_ms=statistics.mean(device_ms), host_ms=statistics.mean(host_ms), device_ms_all=device_ms,
                    first_step_s=first, ready_s=ready, bytes_sent=0.0, bytes_sent_source="none (a schedule)",
                    statistic="mean over the warm-up's steps", **_peak(device))
    step()
    synchronize(device)
    first = time.perf_counter() - start
    for i in range(1, args.warmup):
        progress(f"warm-up {i + 1}/{args.warmup}")
        step()
    synchronize(device)
    ready = time.perf_counter() - start
    device_ms, host_ms = timed_calls(step, args.steps, device, lambda i: progress(f"step {i}/{args.steps}"))
    sent = getattr(optimizer, "communication_bytes", None)  # this rank, last step (dion3 optimizers)
    launches = launches_per_step(step, device)  # one more step, after the timed ones
    result = dict(
        device_ms=statistics.median(device_ms), host_ms=statistics.median(host_ms),
        device_ms_all=device_ms, first_step_s=first, ready_s=ready,
        bytes_sent=float(sent or 0),
        bytes_sent_source="optimizer.communication_bytes" if sent is not None else "none (not a dion3 optimizer)",
        launches=launches,
    )
    result.update(_peak(device))
    return result


def _peak(device: torch.device) -> dict:
    return {"peak_gb": torch.cuda.max_memory_allocated(device) / 1e9} if device.type == "cuda" else {}


def shape_fractions(variant: Variant, preset: Preset):
    """The fraction the variant runs at: variant.fraction, or for allocation "cost" one per entry
    of preset.matrices, as make_optimizer's cost_allocated_groups gives them to its groups (chosen
    under the H200 dispatch of dion3.optim.cost_fractions, as for training, whatever the bench's device)."""
    if variant.allocation == "cost":
        return cost_allocated_fractions(preset.matrices, variant.fraction, method=variant.orthogonalizer,
                                        schedule=variant.ns_coefficients)
    if variant.warmup_steps:  # the warm-up's mean step: priced at its mean fraction
        return (1.0 + variant.fraction) / 2
    return variant.fraction


def cost_of(variant: Variant, preset: Preset, device: torch.device, with_scalars: bool) -> flops.StepCost:
    def symmetric(n: int) -> bool:  # the dispatch rule of dion3.kernels, asked as the run will ask it
        return variant.kernels and kernels.symmetric_kernels_available(device, n)

    return flops.step_cost(
        preset.matrices, variant.algorithm, shape_fractions(variant, preset), variant.orthogonalizer, symmetric,
        scalar_numel=preset.scalar_numel if with_scalars else 0, momentum_bytes=2 if variant.momentum_dtype else 4,
        schedule=variant.ns_coefficients,
    )


def run_variant(variant: Variant, graph: bool, preset: Preset, args, device: torch.device, progress) -> dict:
    row = dict(name=variant.name, mode="graph" if graph else "eager", variant=asdict(variant))
    try:
        with kernels_switched_off(not variant.kernels):
            cost = cost_of(variant, preset, device, args.scalars)
            row["model"] = asdict(cost)
            row.update(measure(variant, graph, preset, args, device, progress))
        if preset.layers:
            row["layer_ms"] = row["device_ms"] / preset.layers
        seconds = row["device_ms"] / 1e3
        row["tflops"] = cost.dense_flops / seconds / 1e12 if cost.dense_flops else None
        row["gbps"] = cost.bytes_moved / seconds / 1e9
    except Exception as error:  # a failing variant must not stop the others
        row["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
        row["traceback"] = traceback.format_exc()
    finally:
        free_memory(device)
    return row


def add_speedups(rows: list[dict]) -> None:
    """Speedup of every row vs the baseline measured in the same run (eager preferred)."""
    baseline = [r for r in rows if r["name"] == BASELINE and "device_ms" in r]
    baseline.sort(key=lambda r: r["mode"] != "eager")
    for row in rows:
        ok = baseline and "device_ms" in row
        row["speedup"] = baseline[0]["device_ms"] / row["device_ms"] if ok else None


# ------------------------------------------------------------------------ command line
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dion3 bench", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="llama-1b", metavar="NAME",
                        help=f"model shapes, one of {', '.join(sorted(PRESETS))} (default llama-1b)")
    source.add_argument("--shapes", help="custom matrices ROWSxCOLS[:COUNT],... e.g. 4096x4096:32,1024x4096:64")
    parser.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS,
                        help=f"comma list (default {DEFAULT_OPTIMIZERS}); dion3-F takes any fraction F in (0, 1], "
                        "dion3-F-cost (e.g. dion3-1/4-cost) fractions per matrix shape within dion3-F's modeled "
                        "H200 step time (dion3.ortho.cost.modeled_seconds), dion3-F-warmupN the fraction warmed up "
                        "from 1 over N steps; `dion3 compare` names the same settings alike")
    parser.add_argument("--ns-coefficients", default="polar_express", metavar="NAME",
                        help="the Newton–Schulz schedule of every Muon, NorMuon and Dion3 variant, the muon baseline "
                             f"included (one of {', '.join(SCHEDULES)}; default polar_express); fractions by cost and "
                             "the FLOP model follow its steps")
    parser.add_argument("--skip", default="", help="comma list of optimizers to leave out (e.g. adamw on llama-8b)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (median reported; default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, the first step included (default 5)")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                        help="also run each variant graph-captured (default: on for CUDA)")
    parser.add_argument("--scalars", action="store_true", help="add embedding/LM head/norm params in an AdamW group")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be ≥ 1, got {args.steps}")
    if args.warmup < 1:
        parser.error(f"--warmup must be ≥ 1 (the first step is always untimed), got {args.warmup}")
    try:
        args.device = torch.device(args.device)
        args.source = parse_shapes(args.shapes) if args.shapes else get_preset(args.preset)
        skip = {canonical_name(name.strip()) for name in args.skip.split(",") if name.strip()}
        given = [n.strip() for n in args.optimizers.split(",") if n.strip() and canonical_name(n.strip()) not in skip]
        if args.ns_coefficients not in SCHEDULES:
            raise ValueError(f"--ns-coefficients: unknown schedule {args.ns_coefficients!r}; expected one of "
                             f"{sorted(SCHEDULES)}")
        args.variants = [parse_variant(name) for name in given]
        args.variants = [v if v.algorithm == "adamw" else dataclasses.replace(v, ns_coefficients=args.ns_coefficients)
                         for v in args.variants]
        for name, variant in zip(given, args.variants):
            if variant.name != name:  # another spelling of the setting: tables and records use its name
                print(f"note: {name} is written {variant.name}", file=sys.stderr)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    if args.graph is None:
        args.graph = args.device.type == "cuda"
    if args.graph and args.device.type != "cuda":
        parser.error("--graph needs a CUDA device (use --no-graph with --device cpu)")
    if args.graph and args.warmup <= GRAPH_WARMUP:
        args.warmup = GRAPH_WARMUP + 1  # so that every timed step is a graph replay
    return args


def environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.steps < 10:
        print(f"note: --steps {args.steps} < 10; medians of so few steps are noisy", file=sys.stderr)
    modes = [False, True] if args.graph else [False]
    runs = [(v, g) for v in args.variants for g in modes]
    report = {
        "command": "dion3 bench " + shlex.join(argv), "environment": environment(args.device),
        "source": asdict(args.source), "steps": args.steps, "warmup": args.warmup, "scalars": args.scalars,
        "ns_coefficients": args.ns_coefficients,
        "results": [],
    }
    progress = Progress(len(runs))
    for variant, graph in runs:
        progress.start(f"{variant.name} {'graph' if graph else 'eager'}")
        row = run_variant(variant, graph, args.source, args, args.device, progress)
        progress.finish(row)
        report["results"].append(row)
        add_speedups(report["results"])
        if args.json:  # rewritten after every run so a crash keeps what was measured
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
    schedule = get_schedule(args.ns_coefficients)
    print(f"{args.source.name}: {args.source.description}; {args.source.matrix_numel:,} matrix params, "
          f"fp32, {args.steps} timed steps, Newton–Schulz {schedule.name} ({len(schedule)} steps), "
          f"device {report['environment'].get('device_name', args.device)}")
    print(format_table(report["results"]))
    return 1 if all("error" in r for r in report["results"]) and runs else 0


if __name__ == "__main__":
    raise SystemExit(main())
