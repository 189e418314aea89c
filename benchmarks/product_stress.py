"""Repeat the products of Gram Newton–Schulz on fixed operands and count results that differ
from the first one: a deterministic product that changes from one launch to the next is a fault
of the product, not of its input. Several copies of this script sharing one GPU reproduce the
conditions of the non-finite runs (many short runs on one H200, time-sliced).

    python benchmarks/product_stress.py --rows 967,928 --seconds 60 --out F.json [--tag crowd]

Operations (`--ops`), on a batch of B matrices X [B, n, k] (the wide iterate after the restart)
and Q [B, n, n] (symmetric):
  restart       Q·X                       cuBLAS bmm, output [B, n, k]
  final         Xᵀ·Q                      cuBLAS bmm reading X transposed (leading dimension k)
  final_padded  Xᵀ·Q with X stored in a [B, n, k'] buffer, k' = k rounded up to 64
  gram          X·Xᵀ                      dion3.kernels.symmetric_matmul (Triton/Gluon or cuBLAS)
  ortho         orthogonalize(Xᵀ, "gram")  the whole fp16 Gram NS of a tall [B, k, n] input
  ns_torch      five steps of standard NS on X in fp16, torch.bmm/baddbmm only (no dion3 code)
  add_chain     Y ← Y + 1 forty times on a float32 copy of X, a new tensor each time (no dion3,
                no cuBLAS: an ordering fault between dependent kernels shows as a wrong count)
  burn          a 4096² fp16 product (load for the GPU; its result is checked like the others)
With fixed operands a product that reads its input before the previous launch finished writing
it still sees the right values; only the chains (ortho, ns_torch, add_chain) can show a fault of
ordering between dependent kernels.
Each round launches every (operation, k) `--repeats` times; the host syncs once per round.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from dion3.kernels import symmetric_matmul  # noqa: E402
from dion3.ortho import orthogonalize  # noqa: E402

OPS = ("restart", "final", "final_padded", "gram", "ortho", "ns_torch", "add_chain", "burn")
DEFAULT_OPS = ("restart", "final", "final_padded", "gram", "ortho")
_NS_STEP = (3.4445, -4.7750, 2.0315)  # a fixed quintic step (Jordan et al.'s Muon coefficients)


def operands(batch: int, n: int, k: int, device: torch.device, seed: int) -> dict:
    """A momentum-like tall input (a few strong directions, ~3/4 of the spectrum tiny), its
    normalized wide fp16 form X, a symmetric Q of the size Gram NS's Q reaches, and X stored
    with its rows padded to a multiple of 64 elements."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    strong = torch.randn(batch, k, 96, generator=g) @ torch.randn(batch, 96, n, generator=g)
    tall = (strong + 1e-4 * torch.randn(batch, k, n, generator=g)).to(device=device, dtype=torch.bfloat16)
    wide = tall.mT.float()
    wide = (wide / torch.linalg.vector_norm(wide, dim=(-2, -1), keepdim=True)).half().contiguous()
    half = torch.randn(batch, n, n, generator=g)
    q = (4.0 * (half + half.mT) / n ** 0.5).to(device=device, dtype=torch.float16)
    padded_k = -(-k // 64) * 64
    store = torch.zeros(batch, n, padded_k, device=device, dtype=torch.float16)
    store[..., :k].copy_(wide)
    burn = torch.randn(4096, 4096, generator=g).to(device=device, dtype=torch.float16) / 64
    return {"tall": tall, "x": wide, "q": q, "x_padded": store[..., :k], "burn": burn}


def ns_torch(x: torch.Tensor) -> torch.Tensor:
    a, b, c = _NS_STEP
    for _ in range(5):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x


def add_chain(x: torch.Tensor) -> torch.Tensor:
    y = x.float()
    for _ in range(40):
        y = y + 1.0
    return y


def run_op(op: str, t: dict) -> torch.Tensor:
    if op == "restart":
        return torch.bmm(t["q"], t["x"])
    if op == "final":
        return torch.bmm(t["x"].mT, t["q"])
    if op == "final_padded":
        return torch.bmm(t["x_padded"].mT, t["q"])
    if op == "gram":
        return symmetric_matmul(t["x"], t["x"].mT)
    if op == "ortho":
        return orthogonalize(t["tall"], method="gram")
    if op == "ns_torch":
        return ns_torch(t["x"])
    if op == "add_chain":
        return add_chain(t["x"])
    if op == "burn":
        return torch.mm(t["burn"], t["burn"])
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="967,928", help="k values (rows of the tall input), comma-separated")
    ap.add_argument("--cols", type=int, default=384)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--ops", default=",".join(DEFAULT_OPS), help=f"comma list of {OPS}")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=20, help="launches of each (op, k) per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    for op in ops:
        if op not in OPS:
            ap.error(f"--ops: unknown op {op!r}; expected some of {OPS}")
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) < 1 or args.cols < 1 or args.batch < 1 or args.repeats < 1:
        ap.error("--rows, --cols, --batch and --repeats must be positive")
    device = torch.device(args.device)
    cases = []
    for k in rows:
        t = operands(args.batch, args.cols, k, device, args.seed + k)
        for op in ops:
            ref = run_op(op, t).clone()
            cases.append({"op": op, "k": k, "t": t, "ref": ref,
                          "differ": torch.zeros((), dtype=torch.int64, device=device),
                          "nonfinite": torch.zeros((), dtype=torch.int64, device=device),
                          "max_diff": torch.zeros((), dtype=torch.float32, device=device),
                          "launches": 0, "events": []})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, rounds = time.time(), 0
    while time.time() - start < args.seconds:
        for case in cases:
            before = int(case["differ"])
            for _ in range(args.repeats):
                out = run_op(case["op"], case["t"])
                case["differ"] += (out != case["ref"]).flatten(1).any(1).sum()
                case["nonfinite"] += (~torch.isfinite(out)).flatten(1).any(1).sum()
                case["max_diff"] = torch.maximum(case["max_diff"], (out.float() - case["ref"].float()).abs().amax())
            case["launches"] += args.repeats
            after = int(case["differ"])  # one sync per (op, k) and round
            if after > before and len(case["events"]) < 20:
                case["events"].append({"round": rounds, "seconds": round(time.time() - start, 2),
                                       "matrices": after - before, "max_diff": float(case["max_diff"])})
        rounds += 1
    report = {"tag": args.tag, "pid": os.getpid(), "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "kernels": os.environ.get("DION3_KERNELS", "1"),
              "seconds": round(time.time() - start, 1), "rounds": rounds, "batch": args.batch, "cols": args.cols,
              "cases": [{"op": c["op"], "k": c["k"], "launches": c["launches"], "matrices": c["launches"] * args.batch,
                         "differ": int(c["differ"]), "nonfinite": int(c["nonfinite"]),
                         "max_diff": float(c["max_diff"]), "events": c["events"]} for c in cases]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    faults = sum(c["differ"] for c in report["cases"])
    print(f"{args.tag or 'run'}: {rounds} rounds, {faults} matrices differing from their first result", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
