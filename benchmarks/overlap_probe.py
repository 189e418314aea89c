"""Do memory-bound passes run alongside Newton–Schulz on the GPU? A probe for the step's schedule.

Times, with CUDA events (median of --repeats), Newton–Schulz on a batch of Dion3's gate/up
selections alone, a memory-bound pass alone (the fused momentum pass, or a grid-stride M += G
with a fixed number of programs), and the two launched together on two streams. If the pair
takes much less than the sum, running one bucket's memory passes while another is
orthogonalized shortens the step; the program count shows how much of the GPU the memory pass
needs to run at bandwidth.

    PYTHONPATH=src python3 benchmarks/overlap_probe.py [--batch 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from dion3 import kernels
from dion3.ortho import orthogonalize


@triton.jit
def _grid_stride_add(m_ptr, g_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for offset in range(start, n, step):
        offs = offset + tl.arange(0, BLOCK)
        inside = offs < n
        m = tl.load(m_ptr + offs, mask=inside)
        g = tl.load(g_ptr + offs, mask=inside)
        tl.store(m_ptr + offs, m + g, mask=inside)


def timed(work, repeats: int) -> float:
    """Median ms of running the (stream, fn) pairs of `work` together: every stream waits for
    a start event on the current stream, the current stream waits for all of them."""
    main = torch.cuda.current_stream()
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        done = []
        for stream, fn in work:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
                event = torch.cuda.Event()
                event.record(stream)
                done.append(event)
        for event in done:
            main.wait_event(event)
        end.record(main)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="gate/up selections (3584×4096) per NS batch")
    parser.add_argument("--rows", type=int, default=14336, help="momentum rows per matrix of the memory pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--programs", default="16,33,66,132,264,1056")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3584, 4096, device=device)
    x = (x / x.norm(dim=(-2, -1), keepdim=True)).to(torch.bfloat16)
    momentum = torch.randn(args.batch, args.rows, 4096, device=device)
    grads = torch.randn_like(momentum)
    flat_m, flat_g = momentum.view(-1), grads.view(-1)

    def ns():
        orthogonalize(x, "newton_schulz", dtype=torch.bfloat16, normalized=True)

    def fused_pass():
        kernels.accumulate_momentum(momentum, [grads], 1.0, scores=True, squares=True)

    def stride(programs):
        return lambda: _grid_stride_add[(programs,)](flat_m, flat_g, flat_m.numel(), BLOCK=4096, num_warps=8)

    main_stream = torch.cuda.current_stream()
    high = torch.cuda.Stream(priority=-1)
    low = torch.cuda.Stream(priority=0)
    nbytes = 3 * momentum.numel() * 4
    rows = []

    def record(label, ms, alone=None):
        row = {"case": label, "ms": ms}
        if alone is not None:
            row["sum_alone_ms"] = alone
            row["saved_ms"] = alone - ms
        rows.append(row)
        extra = f"  (alone {alone:.2f}, saved {alone - ms:+.2f})" if alone is not None else ""
        print(f"{label:44s} {ms:8.2f} ms{extra}", flush=True)

    t_ns = timed([(main_stream, ns)], args.repeats)
    record("NS alone", t_ns)
    t_fused = timed([(main_stream, fused_pass)], args.repeats)
    record(f"fused momentum pass alone ({nbytes / t_fused / 1e6:.0f} GB/s)", t_fused)
    record("NS || fused pass, side stream high priority", timed([(main_stream, ns), (high, fused_pass)], args.repeats), t_ns + t_fused)
    record("NS || fused pass, side stream low priority", timed([(main_stream, ns), (low, fused_pass)], args.repeats), t_ns + t_fused)
    for programs in [int(p) for p in args.programs.split(",")]:
        t_alone = timed([(main_stream, stride(programs))], args.repeats)
        record(f"grid-stride add, {programs} programs ({nbytes / t_alone / 1e6:.0f} GB/s)", t_alone)
        record(f"NS || grid-stride {programs}, high priority", timed([(main_stream, ns), (high, stride(programs))], args.repeats), t_ns + t_alone)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "batch": args.batch, "rows": args.rows, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
