"""Distributed optimizer step on GPUs (NCCL) or CPU (gloo): an equivalence check, then a
step-time table for Llama-shaped matrices under FSDP2.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/distributed_step.py --out OUT
    torchrun --nproc_per_node=2 benchmarks/distributed_step.py --device cpu --shapes 256x192:4 --out /tmp/r  # smoke

1. Equivalence: mixed small shapes (repeated, tall, wide, fewer rows than ranks), sharded with
   fully_shard and replicated under a ProcessGroup; Muon, NorMuon, Dion3 (global scope) must
   match the same optimizer run on one process with the same full gradients: the same rows
   move (exact check) and the parameter changes agree within --tolerance (relative; on GPU the
   orthogonalization runs in bf16/fp16, so batches of different sizes round differently).
2. Timing: fp32 Llama-shaped matrices (--preset, default llama-1b), fully_shard on a 1-D mesh,
   random fp32 gradients; median device time of optimizer.step() over --steps after --warmup,
   the slowest rank reported, with the bytes each rank sent (max over ranks).

Writes distributed_step.json and distributed_step.md under --out (rank 0) and exits 1 if any
equivalence check fails. Global selection syncs the host once per bucket (split sizes), so it
cannot run inside a captured CUDA graph; the table times eager steps.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dion3 import Dion3, Muon, NorMuon
from dion3.tools.bench.presets import get_preset, parse_shapes
from dion3.tools.bench.step_time import kernels_switched_off

MIXED = [(64, 96), (96, 64), (3, 32), (64, 96), (5, 40), (64, 96), (128, 128)]
def adamw(params, distributed_mesh=None, **options):
    """torch's AdamW on the sharded parameters (FSDP2 needs no optimizer communication)."""
    return torch.optim.AdamW(params, foreach=True, **options)


VARIANTS = {  # name: (class, options); "muon-baseline" runs with dion3's kernels off
    "muon-baseline": (Muon, {"orthogonalizer": "newton_schulz"}),
    "muon": (Muon, {}),
    "normuon": (NorMuon, {}),
    "dion3-1/2 local": (Dion3, {"fraction": 0.5, "selection_scope": "local"}),
    "dion3-1/2 global": (Dion3, {"fraction": 0.5, "selection_scope": "global"}),
    "dion3-1/4 local": (Dion3, {"fraction": 0.25, "selection_scope": "local"}),
    "dion3-1/4 global": (Dion3, {"fraction": 0.25, "selection_scope": "global"}),
    # last: torch's AdamW state (2 × the parameters) outlived `del` in a 1-GPU Llama-8B run and
    # left the next variant out of memory
    "adamw": (adamw, {}),
}
EXACT = ("muon", "normuon", "dion3-1/2 global", "dion3-1/4 global")  # must match one process


class Matrices(torch.nn.Module):
    def __init__(self, shapes, device, seed: int = 0):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s, generator=gen, device=device) / s[1] ** 0.5) for s in shapes
        )


def full(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()


def equivalence(name: str, layout: str, mesh, device, steps: int = 3) -> dict:
    cls, options = VARIANTS[name]
    options = dict(options, lr=0.02, weight_decay=0.0)
    model, ref = Matrices(MIXED, device), Matrices(MIXED, device)
    if layout == "fsdp":
        fully_shard(model, mesh=mesh)
    group_or_mesh = mesh if layout == "fsdp" else mesh.get_group()
    start = [full(p) for p in ref.parameters()]
    opt = cls(list(model.parameters()), distributed_mesh=group_or_mesh, **options)
    ref_opt = cls(list(ref.parameters()), **options)
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(steps):
        grads = [torch.randn(s, generator=gen, device=device) for s in MIXED]
        set_grads(list(model.parameters()), grads)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        ref_opt.step()
    got = [full(p) - s for p, s in zip(model.parameters(), start)]
    want = [p.detach() - s for p, s in zip(ref.parameters(), start)]
    error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
    same_rows = all(torch.equal((a != 0).any(dim=1), (b != 0).any(dim=1)) for a, b in zip(got, want))
    return {"variant": name, "layout": layout, "relative_error": error, "same_rows_moved": same_rows}


def time_variant(name: str, params, mesh, device, warmup: int, steps: int) -> dict:
    with kernels_switched_off(name == "muon-baseline"):
        return _time_variant(name, params, mesh, device, warmup, steps)


def _time_variant(name: str, params, mesh, device, warmup: int, steps: int) -> dict:
    cls, options = VARIANTS[name]
    began = time.perf_counter()
    opt = cls(params, distributed_mesh=mesh, lr=0.01, weight_decay=0.01, **options)
    opt.step()
    sync(device)
    first = time.perf_counter() - began
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        sync(device)
        dist.barrier()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
    row = {
        "variant": name,
        "step_ms": max_over_ranks(statistics.median(times), device),
        "first_step_s": max_over_ranks(first, device),
        "bytes_sent": int(max_over_ranks(getattr(opt, "communication_bytes", 0), device)),
        "bytes_by_kind": getattr(opt, "communication_bytes_by_kind", {}),
    }
    del opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(value: float, device) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def markdown(report: dict) -> str:
    lines = [
        f"# Distributed step: {report['preset']} under FSDP2, {report['world_size']} × {report['device_name']}",
        "",
        f"Command: `{report['command']}`  ·  torch {report['torch']}",
        "",
        "| variant | step ms (median, slowest rank) | speedup vs Muon baseline | first step s | MB sent per rank | bytes vs Muon |",
        "|---|---|---|---|---|---|",
    ]
    muon = next((r["bytes_sent"] for r in report["timing"] if r["variant"] == "muon"), 0)
    baseline = next((r["step_ms"] for r in report["timing"] if r["variant"] == "muon-baseline"), 0)
    for r in report["timing"]:
        ratio = f"{r['bytes_sent'] / muon:.3f}" if muon else "—"
        speedup = f"{baseline / r['step_ms']:.2f}×" if baseline else "—"
        lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {speedup} | {r['first_step_s']:.2f} | "
                     f"{r['bytes_sent'] / 1e6:.1f} | {ratio} |")
    lines += ["", "Equivalence with one process (relative error of the parameter change; same rows moved):", "",
              "| variant | layout | relative error | same rows moved | ok |", "|---|---|---|---|---|"]
    for r in report["equivalence"]:
        lines.append(f"| {r['variant']} | {r['layout']} | {r['relative_error']:.2e} | {r['same_rows_moved']} | {r['ok']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for distributed_step.json / .md")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--preset", default="llama-1b", help="shape preset for the timing table")
    parser.add_argument("--shapes", default=None, help="custom shapes instead of --preset, e.g. 2048x2048:4")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=None, help="relative error bound (default 3e-2 on CUDA, 1e-5 on CPU)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected names from {list(VARIANTS)}")

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    tolerance = args.tolerance if args.tolerance is not None else (3e-2 if use_cuda else 1e-5)
    mesh = init_device_mesh(device.type, (world,))

    checks = []
    for layout in ("fsdp", "ddp"):
        for name in EXACT:
            result = equivalence(name, layout, mesh, device)
            result["ok"] = bool(result["same_rows_moved"] and result["relative_error"] <= tolerance)
            checks.append(result)
            if rank == 0:
                print(f"equivalence {layout:4s} {name:18s} rel err {result['relative_error']:.2e} "
                      f"same rows {result['same_rows_moved']}  {'ok' if result['ok'] else 'MISMATCH'}", flush=True)

    preset = parse_shapes(args.shapes) if args.shapes else get_preset(args.preset)
    shapes = [(m.rows, m.cols) for m in preset.matrices for _ in range(m.count)]
    model = Matrices(shapes, device)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    for p in params:
        p.grad = DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements,
                                    run_check=False, shape=p.shape, stride=p.stride())
    timing = []
    for name in names:
        row = time_variant(name, params, mesh, device, args.warmup, args.steps)
        timing.append(row)
        if rank == 0:
            print(f"{name:18s} {row['step_ms']:9.2f} ms  first {row['first_step_s']:.2f} s  "
                  f"sent {row['bytes_sent'] / 1e6:9.1f} MB/rank", flush=True)

    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "world_size": world, "backend": dist.get_backend(), "preset": preset.name,
        "device_name": torch.cuda.get_device_name(device) if use_cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "tolerance": tolerance, "equivalence": checks, "timing": timing,
    }
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "distributed_step.json").write_text(json.dumps(report, indent=1))
        table = markdown(report)
        (out / "distributed_step.md").write_text(table)
        print(table)
    failed = [c for c in checks if not c["ok"]]
    dist.barrier()
    dist.destroy_process_group()
    if failed and rank == 0:
        print(f"FAILED: {len(failed)} equivalence check(s) mismatched", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
