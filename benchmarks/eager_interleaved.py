"""Eager optimizer steps where they are host-bound (small matrices), every variant in one
process, interleaved step by step, so that drift in the host's speed (which moved one variant's
median by ±40% between separate `dion3 bench` runs on the H200 machine) hits all of them alike.

    PYTHONPATH=src python3 benchmarks/eager_interleaved.py [--shapes 512x512:32,...] [--rounds 400]
        [--optimizers normuon,dion3-1/4] [--json PATH]

Each step is timed alone: synchronize, perf_counter, step(), synchronize, perf_counter.
Reported: the median and quartiles per variant, and per pair of variants the median of the
per-round ratios (the paired comparison). Defaults: the matrices of `dion3 compare --preset
gpu-small` (48 matrices, 25 M parameters).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dion3.bench.presets import parse_shapes
from dion3.bench.step import make_optimizer, make_parameters, parse_variant
import triton

GPU_SMALL = "512x512:32,2048x512:8,512x2048:8"


def quartiles(values):
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=GPU_SMALL)
    parser.add_argument("--optimizers", default="muon-gram,normuon,dion3-1/4")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("eager_interleaved.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    preset = parse_shapes(args.shapes)
    runs = {}
    for name in args.optimizers.split(","):
        variant = parse_variant(name)
        matrices, scalars = make_parameters(preset, device, with_scalars=False)
        runs[name] = make_optimizer(variant, matrices, scalars, device, graph=False)

    def step(optimizer):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    for _ in range(args.warmup):
        for optimizer in runs.values():
            step(optimizer)
    times = {label: [] for label in runs}
    for round_ in range(args.rounds):
        labels = list(runs)
        labels = labels[round_ % len(labels):] + labels[:round_ % len(labels)]  # rotate who goes first
        for label in labels:
            times[label].append(step(runs[label]))
        if (round_ + 1) % 100 == 0:
            print(f"[{round_ + 1}/{args.rounds}] rounds", file=sys.stderr, flush=True)

    print(f"{args.rounds} interleaved eager steps per variant, shapes {args.shapes}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, Triton {triton.__version__}")
    print(f"{'variant':<12} {'q1 ms':>7} {'median':>7} {'q3 ms':>7}")
    summary = {}
    for label, values in times.items():
        q1, median, q3 = quartiles(values)
        summary[label] = dict(q1_ms=q1, median_ms=median, q3_ms=q3)
        print(f"{label:<12} {q1:7.3f} {median:7.3f} {q3:7.3f}")
    labels = list(times)
    ratios = {}
    print("paired: median over rounds of (first / second)")
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            ratio = statistics.median(x / y for x, y in zip(times[a], times[b]))
            ratios[f"{a} / {b}"] = ratio
            print(f"  {a} / {b}: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), shapes=args.shapes, rounds=args.rounds,
                           gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, summary=summary, paired_ratios=ratios,
                           times_ms=times), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
