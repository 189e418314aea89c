"""`dion3 bench kernels`: symmetric-matmul and post-update kernels against cuBLAS, and standard
vs Gram Newton–Schulz end to end, on one CUDA device.

Per symmetric shape: cuBLAS ms (torch.matmul / baddbmm on the full product), ours ms, effective
TFLOP/s (FLOPs of the full product, 2·B·n²·k, over our time), speedup, and each one's max
relative error vs a float64 product of the same inputs. Times are medians of
triton.testing.do_bench (CUDA events; eager launches, so a kernel shorter than its host-side
launch shows the host's time), and, for both sides, the GPU time alone: the median per call of
a CUDA graph that replays several calls (what a captured optimizer step sees). --sweep times
every config in SWEEP_CONFIGS instead of the table's choice (how configs.py was filled in).
Writes everything as JSON with --json PATH.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict
from typing import Callable

import torch

from ... import kernels
from ...kernels.configs import TileConfig, pick_config
from ...kernels.reference import post_update_reference, symmetric_matmul_reference

# (label, batch, n, k, product): "gram" is A·Aᵀ with A [B, n, k]; "square" is c·R·R + b·R with
# R [B, n, n] symmetric (the bA + cA² term of NS and the Z, P, R products of Gram NS).
SYMMETRIC_SHAPES = (
    ("A·Aᵀ 8192×8192", 1, 8192, 8192, "gram"),
    ("A·Aᵀ 4096×16384", 1, 4096, 16384, "gram"),
    ("A·Aᵀ 32×1024×4096", 32, 1024, 4096, "gram"),
    ("A·Aᵀ 16×2048×8192", 16, 2048, 8192, "gram"),
    ("R·R+R 4096", 1, 4096, 4096, "square"),
    ("R·R+R 16×2048", 16, 2048, 2048, "square"),
    ("R·R+R 32×1024", 32, 1024, 1024, "square"),
    ("A·Aᵀ 64×512×2048", 64, 512, 2048, "gram"),
    ("A·Aᵀ 64×256×1024", 64, 256, 1024, "gram"),
)
# (label, batch, rows, cols): Llama-shaped batches for NS vs Gram NS end to end.
NS_SHAPES = (
    ("16×2048×8192 (1B gate/up)", 16, 2048, 8192),
    ("1×4096×4096 (8B q/o)", 1, 4096, 4096),
    ("16×2048×2048 (1B q/o)", 16, 2048, 2048),
    ("32×1024×4096 (8B k/v)", 32, 1024, 4096),
    ("8×4096×14336 (8B gate/up)", 8, 4096, 14336),
)
SWEEP_CONFIGS = tuple(
    TileConfig(bm, bn, 64, num_warps=8, num_stages=s, descriptors=d)
    for bm, bn in ((128, 128), (128, 256))
    for s in (3, 4)
    for d in (False, True)
) + (TileConfig(64, 64, 64, num_warps=4, num_stages=4), TileConfig(128, 128, 64, num_warps=4, num_stages=4))


def _median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))


def graph_median_ms(fn: Callable[[], object], calls: int = 10, replays: int = 20) -> float:
    """GPU time per call of fn, without host time: `calls` calls captured in one CUDA graph,
    the median over `replays` replays (CUDA events) divided by calls. fn must be capturable
    (no host syncs) and already warmed up (kernels compiled)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # capture wants its first call on a side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / calls)
    del graph
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def _graph_ms_or_none(fn: Callable[[], object], **options) -> float | None:
    """graph_median_ms, or None (with a warning) where fn cannot be captured: the eager
    figures still stand."""
    try:
        return graph_median_ms(fn, **options)
    except Exception as error:  # capture is an extra measurement, never the end of a run
        import warnings

        warnings.warn(f"dion3 bench kernels: no CUDA-graph timing ({type(error).__name__}: {str(error)[:200]})",
                      RuntimeWarning, stacklevel=2)
        return None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def _max_rel_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-300))


def _symmetric_inputs(batch: int, n: int, k: int, product: str, dtype: torch.dtype):
    """(a, b, c, alpha, beta) for one benchmark shape, on the current CUDA device."""
    if product == "gram":
        a = torch.randn(batch, n, k, device="cuda").div_(k ** 0.5).to(dtype)
        return a, a.mT, None, 1.0, 0.0
    x = torch.randn(batch, n, 2 * n, device="cuda").div_((2 * n) ** 0.5)
    r = (x @ x.mT).div_(2.0).to(dtype)  # symmetric, spectrum within about [0, 3]
    return r, r, r, 0.9, -1.7


def bench_symmetric(dtype: torch.dtype, configs, shapes=SYMMETRIC_SHAPES) -> list[dict]:
    from ...kernels.symmetric_matmul import symmetric_matmul_triton
    from ...kernels.symmetric_matmul_hopper import pick_tiling

    major = torch.cuda.get_device_capability()[0]
    rows = []
    for label, batch, n, k, product in shapes:
        a, b, c, alpha, beta = _symmetric_inputs(batch, n, k, product, dtype)
        exact = symmetric_matmul_reference(a.double(), b.double(), None if c is None else c.double(), alpha, beta)
        cublas = lambda: symmetric_matmul_reference(a, b, c, alpha, beta)  # noqa: E731
        cublas_ms = _median_ms(cublas)
        cublas_graph_ms = _graph_ms_or_none(cublas)
        cublas_err = _max_rel_error(cublas(), exact)
        full_flops = 2.0 * batch * n * n * k
        # Without a sweep: what the optimizer runs (the dispatch: kernel, split product, or cuBLAS
        # itself below SYMMETRIC_MIN_N or with kernels off).
        has_c = c is not None and beta != 0.0
        on_kernel = bool(configs) or (kernels.kernels_enabled() and kernels.symmetric_kernels_available(a.device, n))
        split = not configs and on_kernel and kernels.split_worth_it(a, has_c)
        tiling = pick_tiling(a, b, c if has_c else None, None, n) if not configs and on_kernel and not split else None
        hopper = tiling is not None
        path = "split" if split else "hopper" if hopper else "whole" if on_kernel else "cublas"
        for config in configs or (pick_config(n // 2 if split else n, major, k, has_c),):
            row = dict(shape=label, batch=batch, n=n, k=k, product=product, dtype=str(dtype),
                       config=asdict(config) if on_kernel and not hopper else None, path=path, cublas_ms=cublas_ms,
                       tiling=asdict(tiling) if hopper else None,
                       cublas_graph_ms=cublas_graph_ms, cublas_max_rel_err=cublas_err,
                       cublas_tflops=full_flops / cublas_ms / 1e9)
            try:
                if configs:
                    ours = lambda: symmetric_matmul_triton(a, b, c, alpha, beta, config=config)  # noqa: E731
                else:
                    ours = lambda: kernels.symmetric_matmul(a, b, c, alpha, beta)  # noqa: E731
                out = ours()
                row.update(ours_ms=_median_ms(ours), ours_max_rel_err=_max_rel_error(out, exact),
                           symmetric_exact=bool(torch.equal(out, out.mT)))
                row.update(effective_tflops=full_flops / row["ours_ms"] / 1e9,
                           speedup=cublas_ms / row["ours_ms"], ours_graph_ms=_graph_ms_or_none(ours))
                row.update(graph_speedup=_ratio(cublas_graph_ms, row["ours_graph_ms"]),
                           graph_effective_tflops=_ratio(full_flops / 1e9, row["ours_graph_ms"]))
            except Exception as error:  # one failing config must not end a sweep
                row["error"] = f"{type(error).__name__}: {error}"[:300]
            rows.append(row)
            print(_format_symmetric(row), flush=True)
        del a, b, c, exact
        torch.cuda.empty_cache()
    return rows


def _format_symmetric(row: dict) -> str:
    cfg = row["config"]
    if row.get("path") == "hopper":
        tiling = row.get("tiling") or {}
        tag = f"gluon 128x{tiling.get('block_n', '?')} ws s{tiling.get('stages', '?')}"
    elif cfg is None:
        tag = "cuBLAS (dispatch)"
    else:
        tag = f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']}" + (
            " tma" if cfg["descriptors"] else "") + (" split" if row.get("path") == "split" else "")
    head = f"{row['shape']:<22} {tag:<24} cuBLAS {row['cublas_ms']:8.3f} ms"
    if "error" in row:
        return f"{head}  FAILED {row['error']}"
    graph = ("graph n/a" if row.get("graph_speedup") is None else
             f"graph x{row['graph_speedup']:.2f} ({row['graph_effective_tflops']:.0f})")
    return (f"{head}  ours {row['ours_ms']:8.3f} ms  {row['effective_tflops']:7.0f} TFLOP/s eff  "
            f"x{row['speedup']:.2f}  {graph}  "
            f"err ours {row['ours_max_rel_err']:.1e} cuBLAS {row['cublas_max_rel_err']:.1e}")


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"x{ratio:.2f}"


def float64_newton_schulz(x: torch.Tensor, coefficients: str = "polar_express") -> torch.Tensor:
    """Standard NS in float64 (the accuracy reference): normalize, wide orientation, iterate."""
    from ...ortho.coefficients import get_schedule

    schedule = get_schedule(coefficients)
    x = x.double()
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) * schedule.norm_scale + 1e-7)
    for a, b, c in schedule.steps:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def bench_newton_schulz(shapes=NS_SHAPES) -> list[dict]:
    """Standard NS on cuBLAS (the baseline) vs standard NS and Gram NS with kernels."""
    from ...ortho.newton_schulz import orthogonalize

    variants = (("ns_cublas", "newton_schulz", False), ("ns_kernels", "newton_schulz", True),
                ("gram_cublas", "gram", False), ("gram_kernels", "gram", True))
    rows = []
    for label, batch, rows_, cols in shapes:
        x = torch.randn(batch, rows_, cols, device="cuda")
        exact = float64_newton_schulz(x)
        row = dict(shape=label, batch=batch, rows=rows_, cols=cols)
        for name, method, use_kernels in variants:
            kernels.set_kernels_enabled(use_kernels)
            try:
                run = lambda: orthogonalize(x, method=method)  # noqa: E731
                out = run()
                row[f"{name}_ms"] = _median_ms(run)
                row[f"{name}_graph_ms"] = _graph_ms_or_none(run, calls=3, replays=10)
                row[f"{name}_rel_err"] = float((out.double() - exact).norm() / exact.norm())
            finally:
                kernels.set_kernels_enabled(True)
        row["ns_kernels_speedup"] = row["ns_cublas_ms"] / row["ns_kernels_ms"]
        row["gram_kernels_vs_ns_cublas"] = row["ns_cublas_ms"] / row["gram_kernels_ms"]
        row["graph_ns_kernels_speedup"] = _ratio(row["ns_cublas_graph_ms"], row["ns_kernels_graph_ms"])
        row["graph_gram_kernels_vs_ns_cublas"] = _ratio(row["ns_cublas_graph_ms"], row["gram_kernels_graph_ms"])
        rows.append(row)
        print(f"{label:<28} NS cuBLAS {row['ns_cublas_ms']:8.2f} ms  NS kernels {row['ns_kernels_ms']:8.2f} ms "
              f"(x{row['ns_kernels_speedup']:.2f})  Gram cuBLAS {row['gram_cublas_ms']:8.2f} ms  "
              f"Gram kernels {row['gram_kernels_ms']:8.2f} ms (x{row['gram_kernels_vs_ns_cublas']:.2f} vs NS cuBLAS)  "
              f"graph {_times(row['graph_ns_kernels_speedup'])} / {_times(row['graph_gram_kernels_vs_ns_cublas'])}  "
              f"rel err NS/Gram {row['ns_kernels_rel_err']:.1e}/{row['gram_kernels_rel_err']:.1e}", flush=True)
        del x, exact
        torch.cuda.empty_cache()
    return rows


def bench_post_update(count: int = 32, rows: int = 4096, cols: int = 4096, fraction: float = 0.25) -> dict:
    """Fused post-update vs the PyTorch reference on one bucket of fp32 params, f = fraction."""
    from ...kernels.post_update import post_update_triton

    params = [torch.randn(1, rows, cols, device="cuda") for _ in range(count)]
    k = max(1, int(fraction * rows))
    update = torch.randn(count, k, cols, device="cuda")
    selected = torch.rand(count, rows, device="cuda").topk(k, dim=1).indices
    decay, step = torch.tensor(0.999, device="cuda"), torch.tensor(0.01, device="cuda")
    row = dict(count=count, rows=rows, cols=cols, k=k,
               reference_ms=_median_ms(lambda: post_update_reference(params, update, selected, decay, step)),
               fused_ms=_median_ms(lambda: post_update_triton(params, update, selected, decay, step)))
    row["speedup"] = row["reference_ms"] / row["fused_ms"]
    row["fused_gb_per_s"] = (count * rows * cols * 8 + update.numel() * 4) / row["fused_ms"] / 1e6
    print(f"post-update {count}×{rows}×{cols} fp32, k={k}: reference {row['reference_ms']:.3f} ms, "
          f"fused {row['fused_ms']:.3f} ms (x{row['speedup']:.2f}, {row['fused_gb_per_s']:.0f} GB/s)", flush=True)
    return row


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, capability=list(torch.cuda.get_device_capability()),
                multiprocessors=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, date=datetime.date.today().isoformat())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dion3 bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON to PATH")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="time every config in SWEEP_CONFIGS")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: symmetric,ns,post")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("dion3 bench kernels: needs a CUDA device (this machine has none)", file=sys.stderr)
        return 2
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    unknown = skip - {"symmetric", "ns", "post"}
    if unknown:
        parser.error(f"--skip: unknown part(s) {sorted(unknown)}; expected symmetric, ns, post")
    kernels.set_kernels_enabled(True)
    results = dict(environment=environment())
    print(json.dumps(results["environment"]), flush=True)
    if "symmetric" not in skip:
        results["symmetric"] = bench_symmetric(getattr(torch, args.dtype), SWEEP_CONFIGS if args.sweep else None)
    if "post" not in skip:
        results["post_update"] = bench_post_update()
    if "ns" not in skip:
        results["newton_schulz"] = bench_newton_schulz()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
