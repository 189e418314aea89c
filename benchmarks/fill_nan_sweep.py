"""Does every kernel of an orthogonalization write its whole output? Runs Gram (and standard)
Newton–Schulz on batches of tall [k, cols] selections for every k in a range, once as usual and
once with new tensors starting as NaN (torch.utils.deterministic.fill_uninitialized_memory):
an element that no kernel writes is NaN in the second run and whatever the memory held in the
first. Prints, per k, the matrices that came out not finite or with ‖O‖_F/√n > 1.5, and whether
the two runs agree bit for bit.

    python benchmarks/fill_nan_sweep.py --rows 896-1024 --cols 384 --batch 24 --device cuda
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from dion3.ortho import orthogonalize  # noqa: E402


def low_rank_batch(batch: int, rows: int, cols: int, generator: torch.Generator, device) -> torch.Tensor:
    """Tall matrices with a few strong directions over a floor 1e-4 below them (early momentum)."""
    strong = 16
    u = torch.randn(batch, rows, strong, generator=generator)
    v = torch.randn(batch, strong, cols, generator=generator)
    floor = torch.randn(batch, rows, cols, generator=generator) * 1e-4
    return (u @ v / math.sqrt(rows * cols) + floor).to(device)


def bad(out: torch.Tensor) -> list[int]:
    n = min(out.shape[-2:])
    ratios = torch.linalg.vector_norm(out.double(), dim=(-2, -1)) / math.sqrt(n)
    return [i for i, r in enumerate(torch.nan_to_num(ratios, nan=math.inf).tolist()) if not r <= 1.5]


def run(x: torch.Tensor, method: str, fill_nan: bool) -> torch.Tensor:
    torch.use_deterministic_algorithms(fill_nan, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_nan
    try:
        return orthogonalize(x, method, out_dtype=torch.float16 if x.is_cuda else None)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="896-1024", help="k range, inclusive (a-b), or a comma list")
    parser.add_argument("--cols", type=int, default=384)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--methods", default="gram,newton_schulz")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if "-" in args.rows:
        low, high = (int(v) for v in args.rows.split("-"))
        rows = range(low, high + 1)
    else:
        rows = [int(v) for v in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    problems = 0
    for k in rows:
        x = low_rank_batch(args.batch, k, args.cols, generator, args.device)
        for method in args.methods.split(","):
            plain, filled = run(x, method, False), run(x, method, True)
            same = torch.equal(torch.nan_to_num(plain, nan=7.0), torch.nan_to_num(filled, nan=7.0))
            bad_plain, bad_filled = bad(plain), bad(filled)
            if bad_plain or bad_filled or not same:
                problems += 1
                print(f"k={k} {method}: bad {bad_plain}, with NaN-filled memory bad {bad_filled}, identical {same}", flush=True)
    print(f"{problems} problems over {len(rows)} sizes × {args.methods}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
