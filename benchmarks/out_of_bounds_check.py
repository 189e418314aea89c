"""Do the kernels of Newton–Schulz write outside their outputs? Each output is placed inside a
larger buffer filled with a sentinel; after the kernel, any sentinel changed before or after the
output is an out-of-bounds write (which would corrupt whatever tensor lies there). Runs the
tall → wide transposed copy, the Gram product X·Xᵀ (K = k, every k of a range) and the n×n
symmetric products with C, at the gate/up shapes of the llama-384 study.

    python benchmarks/out_of_bounds_check.py --rows 880-1024 --cols 384 --batch 24
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from dion3.kernels.symmetric_matmul import symmetric_matmul_triton  # noqa: E402
from dion3.kernels.transpose import transpose_into_triton  # noqa: E402

SENTINEL = 1234.0
PAD = 8192  # elements on each side (16 KB in fp16: a multiple of every alignment in play)


def guarded(shape, dtype, device):
    numel = 1
    for s in shape:
        numel *= s
    buffer = torch.full((numel + 2 * PAD,), SENTINEL, dtype=dtype, device=device)
    return buffer, buffer[PAD:PAD + numel].view(shape)


def damage(buffer, numel) -> int:
    outside = torch.cat([buffer[:PAD], buffer[PAD + numel:]])
    return int((outside != SENTINEL).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="880-1024")
    parser.add_argument("--cols", type=int, default=384)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    low, high = (int(v) for v in args.rows.split("-"))
    device, n, b = torch.device(args.device), args.cols, args.batch
    dtype = torch.float16
    generator = torch.Generator(device="cpu").manual_seed(0)
    problems = 0
    for k in range(low, high + 1):
        tall = (torch.randn(b, k, n, generator=generator) / 30).to(device, dtype)
        buffer, wide = guarded((b, n, k), dtype, device)
        transpose_into_triton(wide, tall)
        report = {"transpose": (damage(buffer, wide.numel()), not torch.equal(wide, tall.mT))}
        buffer, gram = guarded((b, n, n), dtype, device)
        symmetric_matmul_triton(wide, wide.mT, out=gram)
        reference = (wide.float() @ wide.float().mT)
        report["gram"] = (damage(buffer, gram.numel()), float((gram.float() - reference).abs().max()) > 1e-2 * float(reference.abs().max()))
        r = (gram / gram.diagonal(dim1=-2, dim2=-1).amax(-1).view(-1, 1, 1)).contiguous()
        buffer, z = guarded((b, n, n), dtype, device)
        symmetric_matmul_triton(r, r, r, alpha=0.5, beta=-2.7, out=z, b_symmetric=True)
        reference = 0.5 * (r.float() @ r.float()) - 2.7 * r.float()
        report["symmetric_with_c"] = (damage(buffer, z.numel()), float((z.float() - reference).abs().max()) > 1e-2 * float(reference.abs().max()))
        bad = {name: value for name, value in report.items() if value[0] or value[1]}
        if bad:
            problems += 1
            print(f"k={k}: " + ", ".join(f"{name}: {hits} elements written outside, wrong {wrong}" for name, (hits, wrong) in bad.items()), flush=True)
    print(f"{problems} sizes with problems over k = {low}..{high}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
