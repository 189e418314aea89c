"""Dion3's row selection on CUDA: the selecting launch of kernels/selection.py against PyTorch.

    PYTHONPATH=src python3 benchmarks/selection_kernel.py [--json PATH]

Per bucket shape (N matrices of R rows, k = ⌈R/4⌉):
  topk+sort     scores.topk(k, sorted=False).indices.sort() (the selection before the kernel)
  stable sort   reference.top_rows_reference (the PyTorch path now: ties to the lower row)
  kernel        selection.top_rows_triton (rows only)
  +norm, PyTorch  topk+sort, then selection_norm's kernel (the step's launches before)
  +norm, kernel   top_rows_triton with squares (one launch)
Columns: eager ms (triton.testing.do_bench median: includes host time where the launch is
host-bound), graph ms (GPU time alone, from calls captured in a CUDA graph) and host µs per
call (200 calls queued without a sync). Every kernel result is checked against the reference.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dion3.bench.kernels import _median_ms, environment, graph_median_ms
from dion3.kernels import selection
from dion3.kernels.reference import top_rows_reference

SHAPES = ((32, 512), (8, 2048), (64, 1024), (32, 4096), (64, 14336), (32, 28672))


def host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("selection_kernel.py needs a CUDA device", file=sys.stderr)
        return 2
    rows_out = []
    print(f"{'N x R':>12} {'variant':<16} {'eager ms':>9} {'graph ms':>9} {'host us':>8}")
    for n, r in SHAPES:
        k = (r + 3) // 4
        scores = torch.rand(n, r, device="cuda") * 4
        squares = torch.rand(n, r, device="cuda")
        expected = top_rows_reference(scores, k)
        assert torch.equal(selection.top_rows_triton(scores, k)[0], expected), (n, r)
        rows, norm, _ = selection.top_rows_triton(scores, k, squares, 0.5, 1e-7)
        assert torch.equal(rows, expected), (n, r)
        torch.testing.assert_close(norm.view(-1), squares.gather(1, expected).sum(1).sqrt(), rtol=1e-5, atol=0)
        variants = {
            "topk+sort": lambda: scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values,
            "stable sort": lambda: top_rows_reference(scores, k),
            "kernel": lambda: selection.top_rows_triton(scores, k),
            "+norm, PyTorch": lambda: selection.selection_norm_triton(
                squares, scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values, 0.5, 1e-7, positions=True),
            "+norm, kernel": lambda: selection.top_rows_triton(scores, k, squares, 0.5, 1e-7),
        }
        for name, fn in variants.items():
            fn()
            row = dict(n=n, r=r, k=k, variant=name, eager_ms=_median_ms(fn), graph_ms=graph_median_ms(fn),
                       host_us=host_us(fn))
            rows_out.append(row)
            print(f"{f'{n} x {r}':>12} {name:<16} {row['eager_ms']:9.4f} {row['graph_ms']:9.4f} {row['host_us']:8.1f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), environment=environment(), rows=rows_out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
