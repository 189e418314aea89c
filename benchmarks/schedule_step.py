"""A fraction warm-up's steps against the same steps at aligned row counts, eager and with
CapturedStep: what a schedule costs once no k leaves the tensor cores (dion3.ortho.padding).

    PYTHONPATH=src python3 benchmarks/schedule_step.py --preset llama-1b --steps 200 --out schedule.json

Dion3 with FractionWarmup(1/4, steps) from f = 1 on a preset's matrices (fp32, fixed random
gradients), one group per matrix shape so that the aligned reference can set each shape's k:
  schedule   the warm-up's own fractions, k = ⌈f·rows⌉ (unaligned on most steps);
  aligned    at every step each shape's k rounded up to a multiple of 128 (at most its rows):
             the kernels' aligned speed for at least as many rows.
Each arm first runs once untimed (kernel compilation for its shapes), then eagerly and through
CapturedStep (which captures a graph once a k set has had its
warm-up steps, and counts its captures); every step is timed with CUDA events, and the arms'
totals are compared: schedule ≤ 1.15 × aligned is the target.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def run_arm(preset, steps: int, aligned: bool, captured: bool, device: torch.device) -> dict:
    from dion3 import Dion3, FractionWarmup
    from dion3.optim.graph import CapturedStep
    from dion3.rules import selected_row_count

    torch.manual_seed(0)
    groups = []
    for shape in preset.matrices:
        params = [torch.nn.Parameter(torch.randn(shape.rows, shape.cols, device=device) * 0.02) for _ in range(shape.count)]
        for p in params:
            p.grad = torch.randn_like(p)
        groups.append({"params": params})
    opt = Dion3(groups, lr=0.01, fraction=1.0)
    warmup = FractionWarmup(0.25, steps=steps)
    step = CapturedStep(opt, warmup_steps=3) if captured else opt.step
    cuda = device.type == "cuda"
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)] if cuda else []
    host, ks = [], []
    for t in range(steps):
        f = warmup(t)
        chosen = []
        for group, shape in zip(opt.param_groups, preset.matrices):
            k = selected_row_count(shape.rows, f)
            if aligned:
                k = min(shape.rows, -(-k // 128) * 128)
            group["fraction"] = k / shape.rows
            chosen.append(k)
        ks.append(chosen)
        if cuda:
            events[t][0].record()
        start = time.perf_counter()
        step()
        host.append((time.perf_counter() - start) * 1e3)
        if cuda:
            events[t][1].record()
    if cuda:
        torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in events] if cuda else host
    out = dict(aligned=aligned, captured=captured, total_ms=sum(times), step_ms=times, ks=ks)
    if captured:
        out["graphs_captured"] = step.captures
        step.release()
    del opt, groups
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for an eager smoke run")
    parser.add_argument("--shapes", help="custom ROWSxCOLS[:COUNT],... instead of the preset (smoke runs)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from dion3.tools.bench.presets import get_preset, parse_shapes

    preset = parse_shapes(args.shapes) if args.shapes else get_preset(args.preset)
    device = torch.device(args.device)
    for aligned in (True, False):  # untimed: compiles what each arm's shapes need
        run_arm(preset, args.steps, aligned, False, device)
    arms = {}
    for captured in (False, True) if device.type == "cuda" else (False,):
        for aligned in (True, False, False, True):  # aligned, schedule, schedule, aligned: drift cancels
            key = f"{'captured' if captured else 'eager'}/{'aligned' if aligned else 'schedule'}"
            result = run_arm(preset, args.steps, aligned, captured, device)
            arms.setdefault(key, []).append(result)
            print(f"{key}: {result['total_ms']:.1f} ms total"
                  + (f", {result['graphs_captured']} graphs" if captured else ""), flush=True)
    summary = {}
    for mode in ("eager", "captured") if device.type == "cuda" else ("eager",):
        schedule = [a["total_ms"] for a in arms[f"{mode}/schedule"]]
        aligned = [a["total_ms"] for a in arms[f"{mode}/aligned"]]
        summary[mode] = dict(schedule_ms=schedule, aligned_ms=aligned,
                             ratio=sum(schedule) / sum(aligned),
                             graphs=[a.get("graphs_captured") for a in arms[f"{mode}/schedule"]])
        print(f"{mode}: schedule / aligned = {summary[mode]['ratio']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(command=" ".join(sys.argv), preset=args.preset, steps=args.steps,
                           device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           torch=torch.__version__, summary=summary,
                           arms={k: [{x: y for x, y in a.items() if x != "ks"} | {"ks_first_last": [a["ks"][0], a["ks"][-1]]}
                                     for a in v] for k, v in arms.items()}), handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
