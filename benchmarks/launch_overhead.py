"""Host time per launch against GPU time, for the symmetric products of one-matrix and small
batched shapes (where a 0.1–0.2 ms kernel can wait on the host). Usage (CUDA):

    PYTHONPATH=src python3 benchmarks/launch_overhead.py [--out DIR]

Per shape and path (cuBLAS, the Triton kernel, the Gluon kernel's 128×128 tiles, the dispatch):
  host_us   host time per call over 200 calls queued without a sync
  eager_ms  triton.testing.do_bench median (what `dion3 bench kernels` reports)
  graph_ms  GPU time per call from 10 calls captured in one CUDA graph (no host time at all)
then a cProfile of 200 Gluon launches (where the host time goes).
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
from dion3.bench.kernels import graph_median_ms
from dion3.kernels.configs import TileConfig
from dion3.kernels.symmetric_matmul import symmetric_matmul_triton
from dion3.kernels.symmetric_matmul_hopper import NARROW, symmetric_matmul_hopper

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


def paths(a, b, c, alpha, beta):
    def cublas():
        return torch.matmul(a, b) if c is None else torch.baddbmm(c, a, b, alpha=alpha, beta=beta)

    def gluon():
        out = torch.empty(a.shape[0], a.shape[1], a.shape[1], dtype=a.dtype, device=a.device)
        assert symmetric_matmul_hopper(a, b, c, alpha, beta, out, any_size=True, tiling=NARROW)
        return out

    return dict(cublas=cublas, triton=lambda: symmetric_matmul_triton(a, b, c, alpha, beta, config=TRITON_CONFIG),
                gluon=gluon, dispatch=lambda: kernels.symmetric_matmul(a, b, c, alpha, beta))


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
    for label, batch, n, k, product in SHAPES:
        ops = operands(batch, n, k, product)
        for name, fn in paths(*ops).items():
            fn()
            row = dict(shape=label, path=name, host_us=host_us(fn),
                       eager_ms=float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")),
                       graph_ms=graph_median_ms(fn))
            rows.append(row)
            print(f"{label:<18} {name:<9} host {row['host_us']:7.1f} us  eager {row['eager_ms']:.4f} ms  "
                  f"graph {row['graph_ms']:.4f} ms", flush=True)
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
