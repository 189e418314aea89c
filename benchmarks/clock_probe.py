"""SM clock and board power while one product runs back to back, cuBLAS against our symmetric
kernel (does the kernel lose to cuBLAS per clock, or run at lower clocks?). Usage (CUDA):

    PYTHONPATH=src python3 benchmarks/clock_probe.py [--out DIR] [--seconds 4]

Per shape and side: ms per call (CUDA events over the run), effective TFLOP/s (2·B·n²·k over the
time), and the median SM clock (MHz) and power (W) that `nvidia-smi` sampled every 50 ms while
the calls ran; work per clock = effective TFLOP/s per GHz.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from dion3 import kernels

SHAPES = (("A·Aᵀ 8192×8192", 1, 8192, 8192), ("A·Aᵀ 4096×16384", 1, 4096, 16384))


def sampled(fn, seconds):
    """Run fn back to back for about `seconds` while nvidia-smi samples clock and power."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50", "-i", str(torch.cuda.current_device())],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, start = 0, time.perf_counter()
    begin.record()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    smi.terminate()
    lines = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    samples = [(float(mhz), float(watts)) for mhz, watts in lines[len(lines) // 4:]]  # past the ramp
    return begin.elapsed_time(end) / calls, samples


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    rows = []
    for label, batch, n, k in SHAPES:
        a = (torch.randn(batch, n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        sides = dict(cublas=lambda: torch.matmul(a, a.mT), ours=lambda: kernels.symmetric_matmul(a, a.mT))
        for side, fn in sides.items():
            fn()
            ms, samples = sampled(fn, args.seconds)
            mhz = statistics.median(s[0] for s in samples)
            watts = statistics.median(s[1] for s in samples)
            tflops = 2 * batch * n * n * k / ms / 1e9
            rows.append(dict(shape=label, side=side, ms=ms, effective_tflops=tflops, sm_mhz=mhz, watts=watts,
                             tflops_per_ghz=tflops / (mhz / 1000), samples=len(samples)))
            print(f"{label:<18} {side:<7} {ms:.3f} ms  {tflops:6.0f} TFLOP/s eff  SM {mhz:6.0f} MHz  "
                  f"{watts:5.0f} W  {tflops / (mhz / 1000):6.0f} TFLOP/s per GHz  ({len(samples)} samples)", flush=True)
    with open(os.path.join(args.out, "clock-probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
