"""Standard vs Gram Newton–Schulz, with and without split symmetric products, on the batches
the optimizers actually orthogonalize (GPU). Sets the measured side of ortho.choose_method
and kernels.SPLIT_MIN_N / SPLIT_MIN_WAVES.

    PYTHONPATH=src python3 benchmarks/method_choice.py --json $OUT/method_choice.json

Every cell is the median of CUDA-event times of orthogonalize() on fresh bf16-range data,
and each output is checked against float64 standard NS (relative Frobenius error).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import dion3.kernels as kernels
from dion3.bench.kernels import float64_newton_schulz
from dion3.ortho.newton_schulz import orthogonalize

# (label, batch, rows, cols) in the wide orientation
SHAPES = (
    ("8B dion3-1/4 gate/up", 64, 3584, 4096),
    ("8B dion3-1/4 q/o", 64, 1024, 4096),
    ("8B dion3-1/4 down", 32, 1024, 14336),
    ("8B dion3-1/2 gate/up", 64, 4096, 7168),
    ("8B muon q/o", 64, 4096, 4096),
    ("8B muon gate/up", 64, 4096, 14336),
    ("1B dion3-1/4 gate/up", 32, 2048, 2048),
    ("1B dion3-1/4 q/o", 32, 512, 2048),
    ("1B muon gate/up", 32, 2048, 8192),
)
# (name, method, kernels on, split allowed)
RUNS = (
    ("ns_cublas", "newton_schulz", False, False),
    ("ns", "newton_schulz", True, False),
    ("ns_split", "newton_schulz", True, True),
    ("gram", "gram", True, False),
    ("gram_split", "gram", True, True),
)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    split_min_n = kernels.SPLIT_MIN_N
    rows_out = []
    for label, batch, rows, cols in SHAPES:
        x = torch.randn(batch, rows, cols, device="cuda")
        exact = float64_newton_schulz(x[:1])
        row = dict(shape=label, batch=batch, rows=rows, cols=cols, runs={})
        for name, method, use_kernels, split in RUNS:
            kernels.set_kernels_enabled(use_kernels)
            kernels.SPLIT_MIN_N = split_min_n if split else 1 << 40
            try:
                run = lambda: orthogonalize(x, method, out_dtype=torch.bfloat16)  # noqa: E731
                out = run()
                error = float((out[:1].double() - exact).norm() / exact.norm())
                ms = median_ms(run, args.reps)
                row["runs"][name] = dict(ms=ms, rel_error=error)
            finally:
                kernels.set_kernels_enabled(True)
                kernels.SPLIT_MIN_N = split_min_n
        base = row["runs"]["ns_cublas"]["ms"]
        print(f"{label:24s} " + "  ".join(f"{n} {r['ms']:8.2f} ms ({base / r['ms']:.2f}×, err {r['rel_error']:.1e})"
                                          for n, r in row["runs"].items()), flush=True)
        rows_out.append(row)
        del x
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
