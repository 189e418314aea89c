"""One-job sweep of symmetric-matmul kernel variants against cuBLAS (H200; the kernel targets of
results/kernels-h200-2026-11-29.md).

    PYTHONPATH=src python3 benchmarks/sweep_symmetric.py            # GPU: check + time
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/sweep_symmetric.py --dry   # CPU logic check

Phase 0: tests/test_kernels.py runs in the background (log under $OUT). Phase 1: one process per
variant checks it against float64 on odd shapes, batches, alpha/beta·C, contiguous and
transposed B, fp16 and bf16 (error ≤ 2× cuBLAS's, output exactly symmetric, every element
written), and warms Triton's disk cache for the timed shapes. Phase 2: this process times every
variant and cuBLAS (do_bench medians) on the optimizer shapes, re-checking each output against
float64 on the first and last matrix of the batch. Full JSON goes to $OUT/sweep.json; a compact
table prints last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from dion3.kernels.configs import TileConfig
from dion3.kernels.split import split_symmetric_matmul
from dion3.kernels.symmetric_matmul import diagonal_blocks_triton, symmetric_matmul_triton
from dion3.kernels.hopper_tiling import WIDE, WIDE_LONG, Tiling
from dion3.kernels.symmetric_matmul_hopper import symmetric_matmul_hopper
from dion3.kernels.transpose import transpose_into_triton

STARTED = time.time()
BUDGET_S = 290
# Acceptance: error no worse than 2× cuBLAS's; Triton's interpreter truncates fp32→bf16 (one ulp,
# not half), so the --dry logic check allows 3×.
ERROR_FACTOR = 3.0 if os.environ.get("TRITON_INTERPRET") == "1" else 2.0  # stop timing new shapes after this many seconds (the job's limit is 330)


def _cfg(bm, bn, stages=3, **flags):
    return TileConfig(bm, bn, 64, num_warps=8, num_stages=stages, descriptors=True, **flags)


# What the variants are for (H200 sweeps of 2026-11-29; findings in
# benchmarks/results/kernels-h200-2026-11-29.md, "Findings behind the kernels' configuration"):
# store / reg128 / reg128_s2 / s4: the Triton kernel's Hopper config with TMA stores (commit
# 3f8ebe1), with and without the 128-register cap (04783f0), with 2 or 4 stages (77ed8ec).
# split / split_r128 / gluon_split: split products (7d878cf; kernels/split.py: dense
# off-diagonal block on cuBLAS, the two diagonal blocks on the kernel with this config).
# gluon / gluon3 / gluon4: the warp-specialized Gluon kernel's 128×256 tiles (0d0a9f3, epilogue
# of 5aa30bb), ring depth from K or forced to 3 or 4 stages.
# narrowS / narrowSr / pair: 128×128 Gluon tiles (37fc15a) with S stages and an epilogue tile of
# their own, or the epilogue in the drained rings; pair: one consumer warpgroup per tile, 3 stages
# and 96 KB, so that two programs share an SM.
@dataclass(frozen=True)
class Gluon:
    """Config slot of a Gluon variant: its tiling (None: the module's choice from K)."""
    tiling: Optional[Tiling] = None


STORE = _cfg(128, 128, tma_store=True)
VARIANTS = {
    "gluon": (Gluon(), False),  # name: (diagonal/whole-product config, split)
    "gluon3": (Gluon(WIDE), False),
    "gluon4": (Gluon(WIDE_LONG), False),
    "narrow4": (Gluon(Tiling(128, 4, False, 168)), False),
    "narrow5": (Gluon(Tiling(128, 5, False, 168)), False),
    "narrow6": (Gluon(Tiling(128, 6, False, 168)), False),
    "narrow6r": (Gluon(Tiling(128, 6, True, 168)), False),
    "narrow7r": (Gluon(Tiling(128, 7, True, 168)), False),
    "pair": (Gluon(Tiling(128, 3, True, 128, consumer_warps=4)), False),  # two programs per SM
    "gluon_split": (Gluon(), True),
    "store": (STORE, False),  # the table's config before the register cap
    "reg128": (_cfg(128, 128, tma_store=True, max_registers=128), False),  # the table's config now
    "reg112": (_cfg(128, 128, tma_store=True, max_registers=112), False),
    "reg144": (_cfg(128, 128, tma_store=True, max_registers=144), False),
    "reg128_s2": (_cfg(128, 128, stages=2, tma_store=True, max_registers=128), False),
    "s4": (_cfg(128, 128, stages=4, tma_store=True), False),
    "split": (STORE, True),
    "split_r128": (_cfg(128, 128, tma_store=True, max_registers=128), True),
}
# (label, batch, n, k, product, dtype): "gram" is A·Aᵀ (b = a.mT); "square" is 0.9·R·R − 1.7·R.
TIMED_SHAPES = (
    ("AAt 8192x8192", 1, 8192, 8192, "gram", torch.bfloat16),
    ("AAt 4096x16384", 1, 4096, 16384, "gram", torch.bfloat16),
    ("AAt 32x1024x4096", 32, 1024, 4096, "gram", torch.bfloat16),
    ("AAt 4096x4096", 1, 4096, 4096, "gram", torch.bfloat16),
    ("RR+R 1x4096 bf16", 1, 4096, 4096, "square", torch.bfloat16),
    ("RR+R 32x1024 bf16", 32, 1024, 1024, "square", torch.bfloat16),
    ("AAt 16x2048x8192", 16, 2048, 8192, "gram", torch.bfloat16),
    ("AAt 64x3584x4096", 64, 3584, 4096, "gram", torch.bfloat16),
    ("RR+R 64x3584 f16", 64, 3584, 3584, "square", torch.float16),
    ("AAt 32x4096x14336", 32, 4096, 14336, "gram", torch.bfloat16),
    ("RR+R 64x4096 f16", 64, 4096, 4096, "square", torch.float16),
)
# (batch, n, k, product): odd sizes (777: no TMA; 1000: TMA with clipped edge tiles), batches
# that make persistent programs cross matrices, contiguous B, alpha/beta·C.
CHECK_SHAPES = (
    (3, 512, 320, "gram"), (2, 768, 256, "square"), (2, 1024, 448, "gram_c"), (2, 1024, 512, "contig"),
    (1, 1024, 2048, "gram"), (4, 777, 1000, "gram"), (3, 1000, 1024, "gram"), (6, 1000, 520, "contig"),
    (2, 1536, 1536, "square"), (1, 2304, 4096, "gram"), (5, 640, 640, "square"), (2, 1000, 1000, "gram_c"),
)
DRY_TIMED = (("AAt 2x80x48", 2, 80, 48, "gram", torch.bfloat16), ("RR+R 2x64 f16", 2, 64, 64, "square", torch.float16))
DRY_CHECKS = ((1, 48, 40, "gram"), (3, 40, 24, "contig"), (2, 48, 48, "square"), (2, 56, 32, "gram_c"))


def operands(batch, n, k, product, dtype, device, seed):
    """(a, b, c, alpha, beta), fresh random data for every call."""
    g = torch.Generator(device=device).manual_seed(seed)
    if product in ("gram", "contig", "gram_c"):
        a = (torch.randn(batch, n, k, device=device, generator=g) / k ** 0.5).to(dtype)
        b = a.mT.contiguous() if product == "contig" else a.mT
        if product != "gram_c":
            return a, b, None, 1.0, 0.0
        s = torch.randn(batch, n, n, device=device, generator=g)
        return a, b, (s + s.mT).to(dtype), 0.5, 2.0
    x = torch.randn(batch, n, 2 * n, device=device, generator=g) / (2 * n) ** 0.5
    r = (x @ x.mT / 2).to(dtype)
    return r, r, r, 0.9, -1.7


def cublas(a, b, c, alpha, beta):
    """The full product through cuBLAS, epilogue fused (baddbmm) when there is a C."""
    if c is None:
        return torch.matmul(a, b) if alpha == 1.0 else alpha * torch.matmul(a, b)
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)


def reference_product(a, b, c, alpha, beta, index):
    """float64 alpha·a·b + beta·c for the matrices of the batch in index."""
    exact = alpha * (a[index].double() @ b[index].double())
    return exact if c is None else exact + beta * c[index].double()


class NotFitting(Exception):
    """The Gluon kernel does not take this product (sizes or layout); the variant skips it."""


def _gluon_fill(variant):
    def fill(a, b, c, alpha, beta, out, panels):
        if not symmetric_matmul_hopper(a, b, c, alpha, beta, out, panels, any_size=True,
                                       tiling=variant.tiling):
            raise NotFitting(f"{tuple(a.shape)} panels={panels}")
    return fill


def variant_product(name, a, b, c, alpha, beta):
    """Variant `name`'s D = alpha·a·b + beta·c (split variants need an even n; odd n runs whole)."""
    config, split = VARIANTS[name]
    if isinstance(config, Gluon):
        if split and a.shape[1] % 2 == 0:
            return split_symmetric_matmul(a, b, c, alpha, beta, _gluon_fill(config), transpose_into_triton)
        out = torch.empty(a.shape[0], a.shape[1], a.shape[1], dtype=a.dtype, device=a.device)
        _gluon_fill(config)(a, b, c, alpha, beta, out, 1)
        return out
    if not split or a.shape[1] % 2:
        return symmetric_matmul_triton(a, b, c, alpha, beta, config=config)
    return split_symmetric_matmul(a, b, c, alpha, beta, diagonal_blocks_triton(config), transpose_into_triton)


def run_ours(name, a, b, c, alpha, beta):
    """Poison the allocator's next block of the output's size with NaN first, so that an element
    the kernel fails to write shows up as NaN."""
    batch, n = a.shape[0], a.shape[1]
    poison = torch.full((batch, n, n), float("nan"), dtype=a.dtype, device=a.device)
    del poison
    return variant_product(name, a, b, c, alpha, beta)


def compare(out, a, b, c, alpha, beta, index):
    exact = reference_product(a, b, c, alpha, beta, index)
    err = float((out[index].double() - exact).abs().max())
    blas = cublas(a[index], b[index], None if c is None else c[index], alpha, beta)
    blas_err = float((blas.double() - exact).abs().max())
    ok = bool(torch.isfinite(out).all()) and bool(torch.equal(out, out.mT)) and err <= ERROR_FACTOR * blas_err + 1e-30
    return ok, err / float(exact.abs().max()), blas_err / float(exact.abs().max())


def check_variant(name, device, dry):
    """Phase 1 (one worker process per variant): correctness on CHECK_SHAPES, compile warm-up
    on small-batch versions of the timed shapes."""
    results, failures = [], []
    try:
        seed = 1
        for batch, n, k, product in (DRY_CHECKS if dry else CHECK_SHAPES):
            for dtype in (torch.float16, torch.bfloat16):
                seed += 1
                a, b, c, alpha, beta = operands(batch, n, k, product, dtype, device, seed)
                try:
                    out = run_ours(name, a, b, c, alpha, beta)
                except NotFitting:
                    continue
                ok, err, blas_err = compare(out, a, b, c, alpha, beta, slice(None))
                results.append(dict(shape=[batch, n, k, product, str(dtype)], ok=ok, err=err, cublas_err=blas_err))
                if not ok:
                    failures.append(results[-1])
        for _, batch, n, k, product, dtype in (DRY_TIMED if dry else TIMED_SHAPES):
            seed += 1
            a, b, c, alpha, beta = operands(min(batch, 2), n, k, product, dtype, device, seed)
            ok, err, blas_err = compare(run_ours(name, a, b, c, alpha, beta), a, b, c, alpha, beta, slice(None))
            if not ok:
                failures.append(dict(shape=[min(batch, 2), n, k, product, str(dtype)], err=err, cublas_err=blas_err))
        return dict(variant=name, checks=len(results), failures=failures, ok=not failures)
    except Exception as error:  # a compile failure ends this variant only
        return dict(variant=name, checks=len(results), failures=failures, ok=False,
                    error=f"{type(error).__name__}: {error}"[:400])


def median_ms(fn, dry):
    if dry:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_shapes(usable, device, dry):
    rows = []
    for label, batch, n, k, product, dtype in (DRY_TIMED if dry else TIMED_SHAPES):
        if time.time() - STARTED > BUDGET_S:
            rows.append(dict(shape=label, skipped="time budget"))
            continue
        a, b, c, alpha, beta = operands(batch, n, k, product, dtype, device, seed=zlib.crc32(label.encode()) % 10_000)
        flops = 2.0 * batch * n * n * k
        row = dict(shape=label, batch=batch, n=n, k=k, product=product, dtype=str(dtype),
                   cublas_ms=median_ms(lambda: cublas(a, b, c, alpha, beta), dry), variants={})
        row["cublas_tflops"] = flops / row["cublas_ms"] / 1e9
        ends = [0, batch - 1]
        for name in usable:
            try:
                out = run_ours(name, a, b, c, alpha, beta)
                ok, err, blas_err = compare(out, a, b, c, alpha, beta, ends)
                del out
                ms = median_ms(lambda: variant_product(name, a, b, c, alpha, beta), dry)
                row["variants"][name] = dict(ms=ms, ok=ok, err=err, cublas_err=blas_err,
                                             speedup=row["cublas_ms"] / ms, eff_tflops=flops / ms / 1e9)
            except Exception as error:
                row["variants"][name] = dict(error=f"{type(error).__name__}: {error}"[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del a, b, c
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled symmetric-kernel variant (which
    tells whether two programs fit on one SM: 65536 registers and ~227 KB shared per SM)."""
    from dion3.kernels.symmetric_matmul import _symmetric_matmul_kernel

    found = []
    try:
        for caches in _symmetric_matmul_kernel.device_caches.values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                found.append(dict(warps=meta.num_warps, stages=meta.num_stages, maxnreg=getattr(meta, "maxnreg", None),
                                  regs=compiled.n_regs, spills=compiled.n_spills, shared=meta.shared))
    except Exception as error:  # Triton internals differ between versions: report, don't fail
        found.append(dict(error=f"{type(error).__name__}: {error}"[:200]))
    return found


def _tiling_label(tiling):
    if tiling is None:
        return "128x256 stages by K"
    return (f"128x{tiling.block_n} s{tiling.stages}{' ring' if tiling.epilogue_in_ring else ''}"
            f"{'' if tiling.consumer_warps == 8 else f' {tiling.consumer_warps} warps'}")


def table(checks, rows):
    names = list(VARIANTS)
    lines = ["variants: " + "; ".join(f"{n}={cfg.block_m}x{cfg.block_n} s{cfg.num_stages}"
                                      f"{' st' if cfg.tma_store else ''}{' split' if split else ''}"
                                      if not isinstance(cfg, Gluon) else
                                      f"{n}=gluon {_tiling_label(cfg.tiling)}{' split' if split else ''}"
                                      for n, (cfg, split) in VARIANTS.items())]
    lines.append("checks: " + "  ".join(f"{c['variant']}={'ok' if c['ok'] else 'FAIL'}" for c in checks))
    for c in checks:
        if not c["ok"]:
            lines.append(f"  {c['variant']}: {c.get('error', '')} {json.dumps(c['failures'][:2])}"[:400])
    lines.append(f"{'shape':<18} {'cuBLAS':>7} " + " ".join(f"{n[:8]:>8}" for n in names) + "   best (eff TFLOP/s)")
    for row in rows:
        if "skipped" in row:
            lines.append(f"{row['shape']:<18} skipped ({row['skipped']})")
            continue
        cells, best = [], None
        for n in names:
            v = row["variants"].get(n)
            if v is None:
                cells.append(f"{'-':>8}")
            elif "error" in v:
                cells.append(f"{'err':>8}")
            else:
                cells.append(f"{v['speedup']:7.2f}{'' if v['ok'] else '!'}x"[-8:].rjust(8))
                if v["ok"] and (best is None or v["ms"] < row["variants"][best]["ms"]):
                    best = n
        tail = f"{best} {row['variants'][best]['eff_tflops']:.0f}" if best else "none"
        lines.append(f"{row['shape']:<18} {row['cublas_ms']:7.3f} " + " ".join(cells) + f"   {tail}")
    lines.append("cells: speedup over cuBLAS (cuBLAS ms column); '!' = failed the float64 check")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry", action="store_true", help="CPU interpreter run on tiny shapes (logic check)")
    parser.add_argument("--only", default="", help="comma list of variants")
    parser.add_argument("--shapes", default="", help="comma list of substrings: time only the matching shapes")
    parser.add_argument("--no-tests", action="store_true", help="skip the background tests/test_kernels.py run")
    args = parser.parse_args()
    global TIMED_SHAPES
    if args.shapes:
        TIMED_SHAPES = tuple(s for s in TIMED_SHAPES if any(part in s[0] for part in args.shapes.split(",")))
    out_dir = os.environ.get("OUT", "/tmp/sweep_out")
    os.makedirs(out_dir, exist_ok=True)
    device = "cpu" if args.dry else "cuda"
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    tests = None
    if not args.dry and not args.no_tests:
        log = open(os.path.join(out_dir, "pytest.log"), "w")
        tests = subprocess.Popen([sys.executable, "-m", "pytest", "tests/test_kernels.py", "-q", "-p", "no:cacheprovider"],
                                 stdout=log, stderr=subprocess.STDOUT)
    if not args.dry:
        import triton

        props = torch.cuda.get_device_properties(0)
        env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__)
    else:
        env = dict(gpu="cpu (interpreter)")
    print(json.dumps(env), flush=True)
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(len(names), 12), mp_context=ctx) as pool:
        checks = list(pool.map(check_variant, names, [device] * len(names), [args.dry] * len(names)))
    for c in checks:
        print(json.dumps(c)[:600], flush=True)
    print(f"phase 1 done at {time.time() - STARTED:.0f} s", flush=True)
    pytest_tail = ""
    if tests is not None:
        try:
            tests.wait(timeout=max(10, 150 - (time.time() - STARTED)))
        except subprocess.TimeoutExpired:
            tests.kill()
        log.close()
        with open(os.path.join(out_dir, "pytest.log")) as f:
            pytest_tail = f.read().strip().splitlines()[-1:] or [""]
        pytest_tail = pytest_tail[0]
    usable = [c["variant"] for c in checks if "error" not in c]
    rows = time_shapes(usable, device, args.dry)
    resources = compiled_resources()
    for entry in resources:
        print(json.dumps(entry))
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump(dict(env=env, checks=checks, rows=rows, pytest=pytest_tail, resources=resources,
                       variants={n: dict(asdict(VARIANTS[n][0]), kernel=type(VARIANTS[n][0]).__name__,
                                   split=VARIANTS[n][1]) for n in names}), f, indent=1)
    print(json.dumps(env))
    print(f"pytest tests/test_kernels.py: {pytest_tail}")
    print(table(checks, rows))
    print(f"total {time.time() - STARTED:.0f} s")


if __name__ == "__main__":
    main()
