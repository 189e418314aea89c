"""Host time per launch against GPU time, for the symmetric products of one-matrix and small
batched shapes (where a 0.1–0.2 ms kernel can wait on the host). Usage (CUDA):

    PYTHONPATH=src python3 benchmarks/launch_overhead.py [--out DIR]

Per shape and path (cuBLAS, the Triton kernel, the Gluon kernel's 128×128 tiles launched directly
after the first launch and through Triton's JIT every time, the Gluon path without its launch,
the dispatch), and for standard Newton–Schulz at 4096² (cuBLAS, kernels with and without direct
launches):
  host_us   host time per call over 200 calls queued without a sync (NS: 5 calls, so a full
            launch queue never makes the host wait on the GPU)
  eager_ms  triton.testing.do_bench median (what `dion3 bench kernels` reports)
  graph_ms  GPU time per call from 10 calls captured in one CUDA graph (no host time at all)
then a cProfile of 200 Gluon launches (where the host time goes).
"gluon_prep" and "ns" rows have no graph time (nothing to capture / not needed).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import triton.testing

from dion3 import kernels
from dion3.tools.bench.kernel_time import graph_median_ms
from dion3.kernels.configs import TileConfig
from dion3.kernels.symmetric_matmul import symmetric_matmul_triton
from dion3.kernels import symmetric_matmul_hopper as hopper
from dion3.kernels.hopper_tiling import NARROW
from dion3.kernels.symmetric_matmul_hopper import symmetric_matmul_hopper
from dion3.ortho.newton_schulz import orthogonalize

TRITON_CONFIG = TileConfig(128, 128, 64, num_warps=8, num_stages=3, descriptors=True, tma_store=True, max_registers=128)
SHAPES = (("AAt 4096x4096", 1, 4096, 4096, "gram"), ("RR+R 1x4096", 1, 4096, 4096, "square"),
          ("RR+R 32x1024", 32, 1024, 1024, "square"), ("AAt 32x1024x4096", 32, 1024, 4096, "gram"))


def operands(batch, n, k, product):
    if product == "gram":
        a = (torch.randn(batch, n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        return a, a.mT, None, 1.0, 0.0
    x = torch.randn(batch, n, 2 * n, device="cuda") / (2 * n) ** 0.5
    r = (x @ x.mT / 2).to(torch.bfloat16)
    return r, r, r, 0.9, -1.7


def through_jit(fn):
    """fn with the Gluon kernel launched through Triton's JIT every time (no direct launch)."""
    def call():
        saved = hopper.DIRECT_LAUNCH
        hopper.DIRECT_LAUNCH = False
        try:
            return fn()
        finally:
            hopper.DIRECT_LAUNCH = saved
    return call


class _NoLaunch:
    """Stands in for every compiled kernel: a direct launch that does nothing."""
    def get(self, key):
        return self

    def __getitem__(self, grid):
        return lambda *args: None


def without_launch(fn):
    """fn with everything of the (direct) Gluon path but the kernel launch: our Python part."""
    def call():
        saved = hopper._launched, hopper.DIRECT_LAUNCH
        hopper._launched, hopper.DIRECT_LAUNCH = _NoLaunch(), True
        try:
            return fn()
        finally:
            hopper._launched, hopper.DIRECT_LAUNCH = saved
    return call


def paths(a, b, c, alpha, beta):
    def cublas():
        return torch.matmul(a, b) if c is None else torch.baddbmm(c, a, b, alpha=alpha, beta=beta)

    def gluon():
        out = torch.empty(a.shape[0], a.shape[1], a.shape[1], dtype=a.dtype, device=a.device)
        assert symmetric_matmul_hopper(a, b, c, alpha, beta, out, any_size=True, tiling=NARROW)
        return out

    return dict(cublas=cublas, triton=lambda: symmetric_matmul_triton(a, b, c, alpha, beta, config=TRITON_CONFIG),
                gluon=gluon, gluon_jit=through_jit(gluon), gluon_prep=without_launch(gluon),
                dispatch=lambda: kernels.symmetric_matmul(a, b, c, alpha, beta))


def ns_paths(x):
    def run(use_kernels):
        def call():
            kernels.set_kernels_enabled(use_kernels)
            try:
                return orthogonalize(x, method="newton_schulz")
            finally:
                kernels.set_kernels_enabled(True)
        return call

    return dict(ns_cublas=run(False), ns_kernels=run(True), ns_kernels_jit=through_jit(run(True)))


def host_us(fn, calls=200):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    return queued / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    rows = []

    def measure(label, name, fn, graph=True, calls=200):
        fn()
        row = dict(shape=label, path=name, host_us=host_us(fn, calls),
                   eager_ms=float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")),
                   graph_ms=graph_median_ms(fn) if graph else None)
        rows.append(row)
        graph_text = f"{row['graph_ms']:.4f} ms" if graph else "-"
        print(f"{label:<18} {name:<14} host {row['host_us']:7.1f} us  eager {row['eager_ms']:.4f} ms  "
              f"graph {graph_text}", flush=True)

    for label, batch, n, k, product in SHAPES:
        for name, fn in paths(*operands(batch, n, k, product)).items():
            measure(label, name, fn, graph=name != "gluon_prep")
    for name, fn in ns_paths(torch.randn(1, 4096, 4096, device="cuda")).items():
        # 5 calls: ~100 launches, so the launch queue never fills and blocks the host on the GPU
        measure("NS 1x4096x4096", name, fn, graph=False, calls=5)
    a, b, c, alpha, beta = operands(1, 4096, 4096, "square")
    gluon = paths(a, b, c, alpha, beta)["gluon"]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        gluon()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue()[-6000:])
    with open(os.path.join(args.out, "launch-overhead.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows, profile=text.getvalue()), f, indent=1)


if __name__ == "__main__":
    main()
