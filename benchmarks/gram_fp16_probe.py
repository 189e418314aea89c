"""Gram Newton–Schulz in half precision on ill-conditioned inputs: how often the output is
not finite or too large, and how negative the rounded Gram matrix's eigenvalues get.

    python benchmarks/gram_fp16_probe.py --out probe.json          # CUDA (or CPU, slowly)

For each shape and spectrum it orthogonalizes `--trials` random matrices U·diag(σ)·Vᵀ with the
library's defaults (Gram NS, fp16 on CUDA, one restart), with cuBLAS's reduced-precision fp16
reductions allowed (PyTorch's default) and not, and reports the worst ‖O‖_F/√n (≈ 1 for a good
polar factor), the number of non-finite outputs, and the most negative eigenvalue of R = XXᵀ
rounded in the compute dtype, relative to its largest (float64 eigenvalues).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from dion3.ortho import orthogonalize  # noqa: E402
from dion3.ortho.newton_schulz import default_compute_dtype  # noqa: E402

SHAPES = [(960, 384), (1024, 384), (384, 384), (256, 384), (1024, 4096)]


def spectrum(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    if kind == "geometric":  # 1 … 1e-8
        return 10.0 ** (-8.0 * i / (n - 1))
    if kind == "rank8":  # eight strong directions over a floor of 1e-4
        return torch.where(i < 8, 1.0, 1e-4)
    if kind == "dominant":  # one direction 100× the rest, which decay slowly
        return torch.where(i < 1, 100.0, 1.0 / (1.0 + i / 16))
    if kind == "zeros":  # rank 4, the rest exactly zero
        return torch.where(i < 4, 1.0, 0.0)
    raise ValueError(kind)


def matrices(rows: int, cols: int, kind: str, count: int, generator: torch.Generator) -> torch.Tensor:
    n = min(rows, cols)
    out = []
    for _ in range(count):
        u, _ = torch.linalg.qr(torch.randn(rows, n, dtype=torch.float64, generator=generator))
        v, _ = torch.linalg.qr(torch.randn(cols, n, dtype=torch.float64, generator=generator))
        out.append((u * spectrum(kind, n, generator)) @ v.T)
    return torch.stack(out)


def probe(x: torch.Tensor, device: torch.device) -> dict:
    batch = x.to(device, torch.float32)
    out = orthogonalize(batch, method="gram")
    n = min(x.shape[-2:])
    ratios = torch.linalg.vector_norm(out.float(), dim=(-2, -1)) / math.sqrt(n)
    wide = batch.mT if batch.shape[-2] > batch.shape[-1] else batch
    dtype = default_compute_dtype(device, "gram")
    scaled = (wide / (1.02 * torch.linalg.vector_norm(wide, dim=(-2, -1), keepdim=True))).to(dtype)
    gram = (scaled @ scaled.mT).double()
    eig = torch.linalg.eigvalsh(gram.cpu())
    relative = eig[:, 0] / eig[:, -1]
    return {
        "nonfinite": int((~torch.isfinite(out)).flatten(1).any(1).sum()),
        "worst_ratio": float(torch.nan_to_num(ratios, nan=math.inf).max()),
        "median_ratio": float(ratios.median()),
        "most_negative_relative_eigenvalue": float(relative.min()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(0)
    rows = []
    started = time.perf_counter()
    for (r, c) in SHAPES:
        for kind in ("geometric", "rank8", "dominant", "zeros"):
            x = matrices(r, c, kind, args.trials, generator)
            for reduced in ((True, False) if device.type == "cuda" else (None,)):
                if reduced is not None:
                    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
                row = {"shape": [r, c], "spectrum": kind, "reduced_precision_reduction": reduced, **probe(x, device)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                    "torch": torch.__version__, "trials": args.trials, "rows": rows,
                                    "seconds": time.perf_counter() - started}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
