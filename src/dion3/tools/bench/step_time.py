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
from dataclasses import asdict
from typing import Callable, Optional

import torch

from ... import kernels
from ...optim import Dion3, Muon, NorMuon
from ...optim.cost_fractions import cost_allocated_fractions, cost_allocated_groups
from ...optim.param_groups import BY_COST
from ...ortho.coefficients import SCHEDULES, get_schedule
from . import step_cost as flops
from .launches import launches_per_step
from .report import Progress, format_table
from .presets import PRESETS, Preset, check_fits, config_matrices, get_preset, parse_shapes
from ..setting_names import canonical_name
from .variants import BASELINE, DEFAULT_OPTIMIZERS, NAMED_VARIANTS, Variant, parse_variant  # noqa: F401 (users import them here)

GRAPH_WARMUP = 3  # eager steps CapturedStep runs before capturing


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
    if variant.allocation in BY_COST:  # one group per shape, each with its fraction by cost
        groups = cost_allocated_groups({"params": matrices, "orthogonalizer": variant.orthogonalizer,
                                        "ns_coefficients": variant.ns_coefficients}, variant.fraction,
                                       most_rows=variant.allocation == "most_rows")
    if scalars:
        groups.append({"params": scalars, "algorithm": "adamw", "lr": 1e-3})
    common = dict(lr=0.01, weight_decay=0.01, orthogonalizer=variant.orthogonalizer, momentum_dtype=variant.momentum_dtype,
                  ns_coefficients=variant.ns_coefficients)
    if variant.algorithm == "dion3":
        return Dion3(groups, fraction=variant.fraction, unselected_decay=variant.unselected_decay, **common)
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
    if variant.full_every:
        return _measure_periodic(optimizer, step, variant, args, device, start, progress)
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


def _measure_periodic(optimizer, step, variant: Variant, args, device: torch.device, start: float, progress) -> dict:
    """Periodic full steps (PeriodicFull): warm-up and timed steps in whole K-step cycles, the
    warm-up long enough for a captured step to capture both selections (the full one comes once a
    cycle); the row's time is the median over the timed cycles of the cycle's mean step."""
    from ...optim.fraction_schedule import FractionScheduler, PeriodicFull

    every = variant.full_every
    scheduler = FractionScheduler(optimizer, PeriodicFull(variant.fraction, every=every))
    plain_step = step

    def step():
        plain_step()
        scheduler.step()

    warmup = every * max(-(-args.warmup // every), GRAPH_WARMUP + 1)
    cycles = max(1, -(-args.steps // every))
    step()
    synchronize(device)
    first = time.perf_counter() - start
    for i in range(1, warmup):
        progress(f"warm-up {i + 1}/{warmup}")
        step()
    synchronize(device)
    ready = time.perf_counter() - start
    device_ms, host_ms = timed_calls(step, cycles * every, device, lambda i: progress(f"step {i}/{cycles * every}"))

    def cycle_medians(times):
        return statistics.median(statistics.mean(times[c * every:(c + 1) * every]) for c in range(cycles))

    return dict(device_ms=cycle_medians(device_ms), host_ms=cycle_medians(host_ms), device_ms_all=device_ms,
                first_step_s=first, ready_s=ready, bytes_sent=0.0, bytes_sent_source="none (a schedule)",
                statistic=f"median over {cycles} cycles of {every} steps of the cycle's mean", **_peak(device))


def _peak(device: torch.device) -> dict:
    return {"peak_gb": torch.cuda.max_memory_allocated(device) / 1e9} if device.type == "cuda" else {}


def shape_fractions(variant: Variant, preset: Preset):
    """The fraction the variant runs at: variant.fraction, or for an allocation by cost one per entry
    of preset.matrices, as make_optimizer's cost_allocated_groups gives them to its groups (chosen
    under the H200 dispatch of dion3.optim.cost_fractions, as for training, whatever the bench's device)."""
    if variant.allocation in BY_COST:
        return cost_allocated_fractions(preset.matrices, variant.fraction, method=variant.orthogonalizer,
                                        schedule=variant.ns_coefficients, most_rows=variant.allocation == "most_rows")
    if variant.warmup_steps:  # the warm-up's mean step: priced at its mean fraction
        return (1.0 + variant.fraction) / 2
    return variant.fraction


def cost_of(variant: Variant, preset: Preset, device: torch.device, with_scalars: bool) -> flops.StepCost:
    def symmetric(n: int) -> bool:  # the dispatch rule of dion3.kernels, asked as the run will ask it
        return variant.kernels and kernels.symmetric_kernels_available(device, n)

    def cost(fractions) -> flops.StepCost:
        return flops.step_cost(
            preset.matrices, variant.algorithm, fractions, variant.orthogonalizer, symmetric,
            scalar_numel=preset.scalar_numel if with_scalars else 0, momentum_bytes=2 if variant.momentum_dtype else 4,
            schedule=variant.ns_coefficients, decays_unselected=variant.unselected_decay != 1.0,
        )

    selected = cost(shape_fractions(variant, preset))
    if not variant.full_every:
        return selected
    full, every = cost(1.0), variant.full_every  # a cycle: one full step, every − 1 selecting ones
    dense, executed, moved, sent = ((a + (every - 1) * b) / every
                                    for a, b in zip(dataclasses.astuple(full), dataclasses.astuple(selected)))
    return flops.StepCost(round(dense), executed, moved, sent)


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
    source.add_argument("--hf-config", metavar="PATH",
                        help="a Hugging Face config.json of a Llama-family decoder (as `dion3 plan --hf-config`): "
                             "every matrix of the model, each expert one matrix, on one device")
    parser.add_argument("--layers", type=int, metavar="N",
                        help="with --preset: time N of the model's layers (a slice that fits a smaller GPU; the "
                             "same shapes, so the same fractions by cost; the report names it PRESET-Nl)")
    parser.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS,
                        help=f"comma list (default {DEFAULT_OPTIMIZERS}); dion3-F takes any fraction F in (0, 1], "
                        "dion3-F-cost (e.g. dion3-1/4-cost) fractions per matrix shape within dion3-F's modeled "
                        "H200 step time (dion3.ortho.cost.modeled_seconds), dion3-F-warmupN the fraction warmed up "
                        "from 1 over N steps; `dion3 compare` names the same settings alike. Rule variants of a fixed "
                        "Dion3 setting (bench only): -unselectedD (unselected momentum rows ×D a step) and "
                        "-full-everyK (every row on every K-th step), e.g. dion3-1/2-cost-full-every8")
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
        if args.layers is not None and (args.shapes or args.hf_config):
            raise ValueError("--layers slices a --preset's layers; --shapes and --hf-config set every matrix")
        args.source = (parse_shapes(args.shapes) if args.shapes else
                       config_matrices(args.hf_config) if args.hf_config else get_preset(args.preset, args.layers))
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
    try:
        check_fits(args.source, args.device, args.scalars)
    except ValueError as error:
        print(f"dion3 bench: error: {error}", file=sys.stderr)
        return 2
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
