"""Symmetric products side by side: cuBLAS, dion3's dispatch and the public Dion code's Triton
kernels (`ns_line_1`: A·Aᵀ, `ns_line_2`: α·A·A + β·A), every time a `triton.testing.do_bench`
median (it clears L2 between calls), all in one process on one GPU.

    PYTHONPATH=src python3 benchmarks/kernels_vs_public.py --public PATH/TO/dion/newton_schulz_triton.py \
        [--shapes llama] [--configs] [--json out.json]

--public names the public module's file (from a checkout of the public Dion repository; it is
not part of dion3). Its kernels autotune on first use of each shape; the configuration they
pick is reported. --configs also times dion3's Triton kernel with each config of CONFIGS
(where a tile shape, warp count or pipeline depth of the table might be the difference).
--rounds N times every column N times, round-robin (each round in a rotated order), and reports
the median of the N medians with their range: for rows whose columns differ by about the
run-to-run spread.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys

import torch

from dion3 import kernels
from dion3.kernels import hopper_tiling
from dion3.kernels.configs import TileConfig
from dion3.kernels.reference import symmetric_matmul_reference
from dion3.kernels.symmetric_matmul import symmetric_matmul_triton

# (label, batch, n, k, product) — "gram": A·Aᵀ with A [B, n, k]; "square": 0.9·R·R − 1.7·R.
# The kernel targets' comparison shapes (A·Aᵀ against cuBLAS, kernels-h200-2026-11-29.md), then the Llama-8B/70B optimizer shapes (Dion3 f=¼ selects a
# quarter of the rows; Muon orthogonalizes whole matrices in the wide orientation).
SHAPES = {
    "compare": (
        ("A·Aᵀ 8192²", 1, 8192, 8192, "gram"),
        ("A·Aᵀ 4096×16384", 1, 4096, 16384, "gram"),
        ("A·Aᵀ 32×1024×4096", 32, 1024, 4096, "gram"),
        ("A·Aᵀ 4096²", 1, 4096, 4096, "gram"),
        ("A·Aᵀ 2048×8192", 1, 2048, 8192, "gram"),
    ),
    "llama": (
        ("A·Aᵀ 8192×28672", 1, 8192, 28672, "gram"),
        ("A·Aᵀ 2×4096×14336", 2, 4096, 14336, "gram"),
        ("A·Aᵀ 8×3584×4096", 8, 3584, 4096, "gram"),
        ("A·Aᵀ 4×2048×28672", 4, 2048, 28672, "gram"),
        ("A·Aᵀ 16×2048×8192", 16, 2048, 8192, "gram"),
        ("A·Aᵀ 16×1024×14336", 16, 1024, 14336, "gram"),
        ("R·R+R 8192", 1, 8192, 8192, "square"),
        ("R·R+R 4096", 1, 4096, 4096, "square"),
        ("R·R+R 4×3584", 4, 3584, 3584, "square"),
        ("R·R+R 16×2048", 16, 2048, 2048, "square"),
        ("R·R+R 32×1024", 32, 1024, 1024, "square"),
        ("R·R+R 64×1024", 64, 1024, 1024, "square"),
        ("A·Aᵀ 64×1024×4096", 64, 1024, 4096, "gram"),
    ),
}
CONFIGS = (
    TileConfig(128, 128, 64, num_warps=8, num_stages=3, descriptors=True, tma_store=True, max_registers=128),
    TileConfig(128, 128, 64, num_warps=8, num_stages=4, descriptors=True, tma_store=True, max_registers=128),
    TileConfig(128, 128, 64, num_warps=4, num_stages=3, descriptors=True, tma_store=True),
    TileConfig(128, 128, 64, num_warps=4, num_stages=4, descriptors=True, tma_store=True),
    TileConfig(128, 128, 64, num_warps=4, num_stages=3),
    TileConfig(128, 128, 64, num_warps=4, num_stages=4),
    TileConfig(128, 256, 64, num_warps=8, num_stages=3, descriptors=True, tma_store=True),
)
# The Hopper Gluon kernel's tilings (kernels/hopper_tiling.py), each forced where it fits.
TILINGS = ("wide", "wide_long", "narrow")


def load_public(path: str):
    spec = importlib.util.spec_from_file_location("public_newton_schulz_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def inputs(batch: int, n: int, k: int, product: str):
    if product == "gram":
        a = torch.randn(batch, n, k, device="cuda").div_(k ** 0.5).bfloat16()
        return a, a.mT, None, 1.0, 0.0
    x = torch.randn(batch, n, 2 * n, device="cuda").div_((2 * n) ** 0.5)
    r = (x @ x.mT).div_(2.0)
    r = (r + r.mT).div_(2.0).bfloat16()  # exactly symmetric, as the symmetric kernels' outputs are
    return r, r, r, 0.9, -1.7


def dispatch_path(a, b, c, beta) -> str:
    """Which implementation dion3's dispatch runs for this product."""
    from dion3.kernels.configs import pick_config
    from dion3.kernels.symmetric_matmul_hopper import pick_tiling

    n, k = a.shape[-2], a.shape[-1]
    has_c = c is not None and beta != 0.0
    if not kernels.symmetric_kernels_available(a.device, n):
        return "cublas"
    if kernels.split_worth_it(a, has_c):
        return "split"
    tiling = pick_tiling(a, b, c if has_c else None, None, n)
    if tiling is not None:
        name = next(key for key, value in hopper_tiling.TILINGS.items() if value == tiling)
        return f"gluon {name}"
    config = pick_config(n, torch.cuda.get_device_capability()[0], k, has_c)
    return f"triton {config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages}"


def _gluon(a, b, c, alpha, beta, out, tiling):
    from dion3.kernels.symmetric_matmul_hopper import symmetric_matmul_hopper

    has_c = c is not None and beta != 0.0
    if not symmetric_matmul_hopper(a, b, c if has_c else None, alpha, beta, out, tiling=tiling):
        raise RuntimeError("the Gluon kernel does not fit this product with this tiling")
    return out


def max_rel_error(out, exact) -> float:
    return float((out.double() - exact).abs().max() / exact.abs().max())


def bench_shape(public, label, batch, n, k, product, with_configs: bool, rounds: int = 1) -> dict:
    a, b, c, alpha, beta = inputs(batch, n, k, product)
    exact = symmetric_matmul_reference(a.double(), b.double(), None if c is None else c.double(), alpha, beta)
    flops = 2.0 * batch * n * n * k
    out = torch.empty(batch, n, n, device="cuda", dtype=a.dtype)
    runs = {
        "cublas": lambda: symmetric_matmul_reference(a, b, c, alpha, beta),
        # as Newton–Schulz calls it: R·R with R symmetric is read as R·Rᵀ (both operands along K)
        "dion3": lambda: kernels.symmetric_matmul(a, b, c, alpha, beta, b_symmetric=product == "square"),
    }
    if product == "square":  # R read row-major as the right factor (Newton–Schulz before 2026-12-01)
        runs["dion3 B row-major"] = lambda: kernels.symmetric_matmul(a, b, c, alpha, beta)
    if public is not None:
        if product == "gram":
            runs["public"] = lambda: public.ns_line_1(a, out=out)
        else:
            runs["public"] = lambda: public.ns_line_2(a, alpha=alpha, beta=beta, out=out)
    if with_configs:
        for config in CONFIGS:
            name = (f"triton {config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} "
                    f"s{config.num_stages}{' tma' if config.descriptors else ''}")
            runs[name] = (lambda cfg: lambda: symmetric_matmul_triton(a, b, c, alpha, beta, config=cfg))(config)
        for name in TILINGS:
            runs[f"gluon {name}"] = (lambda t: lambda: _gluon(a, b, c, alpha, beta, out, t))(hopper_tiling.TILINGS[name])
    row = dict(shape=label, batch=batch, n=n, k=k, product=product, path=dispatch_path(a, b, c, beta), ms={}, error={})
    for name, fn in runs.items():
        try:
            result = fn()
            row["error"][name] = max_rel_error(result, exact)
        except Exception as error:  # one failing variant must not end the run
            row["error"][name] = f"{type(error).__name__}: {error}"[:200]
    timed = [name for name in runs if not isinstance(row["error"][name], str)]
    samples = {name: [] for name in timed}
    for round_number in range(rounds if timed else 0):
        shift = round_number % len(timed)
        for name in timed[shift:] + timed[:shift]:
            samples[name].append(median_ms(runs[name]))
    row["ms"] = {name: (statistics.median(samples[name]) if name in samples else None) for name in runs}
    if rounds > 1:
        row["rounds"] = samples
    if public is not None:
        kernel = public.ns_line_1_kernel if product == "gram" else public.ns_line_2_kernel
        best = getattr(kernel, "best_config", None)
        row["public_config"] = str(best) if best is not None else None
    base = row["ms"]["cublas"]
    row["speedup"] = {name: (base / ms if ms else None) for name, ms in row["ms"].items()}
    row["effective_tflops"] = {name: (flops / ms / 1e9 if ms else None) for name, ms in row["ms"].items()}
    spread = {name: f" [{min(times):.3f}–{max(times):.3f}]" for name, times in row.get("rounds", {}).items()}
    cells = "  ".join(f"{name} {ms:.3f} ms{spread.get(name, '')} (x{base / ms:.2f})"
                      for name, ms in row["ms"].items() if ms)
    print(f"{label} [dion3: {row['path']}]: {cells}  public config: {row.get('public_config')}", flush=True)
    del a, b, c, exact, out
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", help="path of the public dion/newton_schulz_triton.py (optional)")
    parser.add_argument("--shapes", default="compare,llama", help="comma list of shape sets: " + ",".join(SHAPES))
    parser.add_argument("--match", default="", help="only the shapes whose label contains this text")
    parser.add_argument("--configs", action="store_true", help="also time dion3's Triton kernel with CONFIGS")
    parser.add_argument("--rounds", type=int, default=1, help="time every column this many times, round-robin")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    public = load_public(args.public) if args.public else None
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.date.today().isoformat(), timing="triton.testing.do_bench median, L2 cleared")
    print(json.dumps(env), flush=True)
    rows = []
    for name in args.shapes.split(","):
        for shape in (s for s in SHAPES[name] if args.match in s[0]):
            rows.append(bench_shape(public, *shape, with_configs=args.configs, rounds=args.rounds))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(environment=env, rows=rows), handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
