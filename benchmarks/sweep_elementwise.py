"""Block sizes of the memory-bound kernels (momentum pass, snapshot, post-update, scale-cast):
GB/s of each (rows per program, columns per program, warps) on the optimizers' bucket shapes.

The launchers read their module's BLOCK_ROWS / BLOCK_COLS / NUM_WARPS at call time; this
script sets them, times each kernel with CUDA events (median of `triton.testing.do_bench`),
restores them, and prints one table per kernel and shape plus JSON under $OUT. Since commit
160640b the momentum pass reads a bucket's gradients through a pointer table in one launch, so
its rows here time that path (results/kernels-h200-2026-11-29.md predates it). Usage (CUDA):

    PYTHONPATH=src python3 benchmarks/sweep_elementwise.py
"""
import importlib
import itertools
import json
import os

import torch
import triton

# by module path: dion3.kernels re-exports a function named post_update over the module's name
momentum, post_update, scale = (importlib.import_module(f"dion3.kernels.{name}") for name in ("momentum", "post_update", "scale"))

# (label, params in the bucket, rows, cols): one Llama-8B gate/up-sized slice (16 of its 64
# matrices, to keep memory small) and the Llama-1B k/v bucket (small matrices: many launches).
SHAPES = (("8B gate/up ×16", 16, 14336, 4096), ("8B q/o ×32", 32, 4096, 4096), ("1B k/v ×32", 32, 512, 2048))
CONFIGS = tuple(itertools.product((1, 4, 8, 16), (512, 1024, 2048), (4, 8)))
FRACTION = 4  # Dion3 f = 1/4


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def cases(n, rows, cols, device):
    """(kernel name, module, function to time, bytes it moves) for one bucket shape."""
    m = torch.randn(n, rows, cols, device=device)
    grads = [torch.randn(1, rows, cols, device=device) for _ in range(n)]
    params = [torch.randn(1, rows, cols, device=device) for _ in range(n)]
    k = rows // FRACTION
    picked = torch.stack([torch.randperm(rows, device=device)[:k].sort().values for _ in range(n)])
    ortho = torch.randn(n, k, cols, device=device, dtype=torch.bfloat16)
    ortho_all = torch.randn(n, rows, cols, device=device, dtype=torch.bfloat16)
    factors = torch.rand(n, k, 1, device=device)
    norm = torch.rand(n, 1, 1, device=device)
    big, sel = n * rows * cols, n * k * cols
    return (
        ("accumulate+scores+squares", momentum, lambda: momentum.accumulate_momentum_triton(m, grads, 1.0, True, True), 12 * big),
        ("accumulate (Muon)", momentum, lambda: momentum.accumulate_momentum_triton(m, grads, 0.95, False, True), 12 * big),
        ("snapshot f=1/4", momentum, lambda: momentum.snapshot_rows_triton(m, picked, 0.95), 12 * sel),
        ("post-update rows+factors", post_update, lambda: post_update.post_update_triton(params, ortho, picked, 0.99, 1e-3, factors), 8 * big + 2 * sel),
        ("post-update all rows", post_update, lambda: post_update.post_update_triton(params, ortho_all, None, 0.99, 1e-3), 10 * big),
        ("scale-cast fp32→bf16", scale, lambda: scale.scale_cast_triton(m, norm, torch.bfloat16), 6 * big),
    )


def main() -> None:
    device = torch.device("cuda")
    out_dir = os.environ.get("OUT", ".")
    results = []
    for label, n, rows, cols in SHAPES:
        for name, module, fn, moved in cases(n, rows, cols, device):
            saved = (module.BLOCK_ROWS, module.BLOCK_COLS, module.NUM_WARPS)
            rates = {}
            try:
                for block_rows, block_cols, warps in CONFIGS:
                    module.BLOCK_ROWS, module.BLOCK_COLS, module.NUM_WARPS = block_rows, block_cols, warps
                    ms = timed(fn)
                    rates[(block_rows, block_cols, warps)] = moved / ms / 1e6
            finally:
                module.BLOCK_ROWS, module.BLOCK_COLS, module.NUM_WARPS = saved
            best = max(rates, key=rates.get)
            print(f"{label:16s} {name:28s} current {saved}: {rates[saved]:6.0f} GB/s   best {best}: {rates[best]:6.0f} GB/s")
            results.append(dict(shape=label, kernel=name, current=list(saved), gbps={str(c): r for c, r in rates.items()}))
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "sweep-elementwise.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       results=results), f, indent=1)


if __name__ == "__main__":
    main()
