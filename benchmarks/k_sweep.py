"""One bucket's optimizer step time against the selected row count k, and Muon/NorMuon on
unaligned shapes: the benchmark behind "no cliffs" (zero padding, dion3.ortho.padding).

    PYTHONPATH=src python3 benchmarks/k_sweep.py --out sweep.json            # on the GPU
    PYTHONPATH=src python3 benchmarks/k_sweep.py --report sweep.json --md OUT.md --plot OUT.png

For every shape (a bucket of COUNT fp32 rows × cols matrices with fixed random gradients):
Dion3's eager step at every k in windows around the Llama-8B fractions by cost and around
f = 1/4, at a coarse sweep over 1…rows, and at the next multiple of 128 at or above each of
them; Muon and NorMuon steps (every row) on the same shapes. Each point: `--warmup` untimed
steps, then the median of `--steps` steps timed with CUDA events, the GPU to itself.
--report checks time(k) ≤ 1.1 × time(next multiple of 128 ≥ k) for every point and the time
per executed FLOP (dion3.ortho.cost) of unaligned shapes against their aligned neighbours, and
writes the table and the plot.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

LLAMA_8B = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
UNALIGNED = [(1000, 3000), (1001, 3001), (1008, 3008), (5120, 13824), (3584, 18944)]
# (rows, cols) → the neighbours an unaligned shape's time per FLOP is compared with
NEIGHBOURS = {(1001, 3001): [(1000, 3000), (1008, 3008)]}
# Llama-8B's fractions by cost at f = 1/4 (param_groups(fraction_allocation="cost") under the FLOP rule used before 2026-12-03)
BY_COST_8B = {(4096, 4096): [0.653], (1024, 4096): [1.0], (14336, 4096): [0.187], (4096, 14336): [0.429]}


def ks_for(rows: int, window: int, coarse: int, fractions) -> list[int]:
    """The k of one shape: windows of ±window around each fraction's k, a coarse sweep over
    1…rows, and the next multiple of 128 of each."""
    ks = set()
    for f in fractions:
        centre = max(1, math.ceil(round(f * rows, 9)))
        ks.update(range(max(1, centre - window), min(rows, centre + window) + 1))
    ks.update(max(1, round(rows * (i / coarse) ** 1.5)) for i in range(1, coarse + 1))  # denser at small k
    ks.update([1, 2, 7, 8, 9, rows])
    ks.update(min(rows, -(-k // 128) * 128) for k in list(ks))
    return sorted(ks)


def time_steps(step, warmup: int, steps: int, device: torch.device) -> list[float]:
    """ms per step: CUDA events on a GPU, perf_counter on the CPU (smoke runs only)."""
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def stepper(opt, args, selections: int):
    """The step to time: eager, or with --graph a CapturedStep keeping one graph per k (a step's
    device time without the host's launches, which dominate eager steps of small matrices)."""
    if not args.graph:
        return opt.step
    from dion3.optim.graph import CapturedStep

    return CapturedStep(opt, warmup_steps=1, max_graphs=selections + 1)


def sweep(args, save=lambda data: None) -> dict:
    """The measurements; save(data so far) after every shape (a job cut short keeps them)."""
    from dion3 import Dion3, Muon, NorMuon
    from dion3.ortho.cost import step_flops
    from dion3.ortho.padding import padded_shape

    device = torch.device(args.device)
    results = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for index, (rows, cols) in enumerate(shapes):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(rows, cols, device=device) * 0.02) for _ in range(args.count)]
        for p in params:
            p.grad = torch.randn_like(p)
        for name, cls in (("muon", Muon), ("normuon", NorMuon)):
            if name not in args.algorithms:
                continue
            opt = cls(params, lr=0.01)
            times = time_steps(stepper(opt, args, 1), args.warmup, args.steps, device)
            results.append(dict(shape=[rows, cols], algorithm=name, k=rows, ms=statistics.median(times), all_ms=times,
                                flops=args.count * step_flops(rows, cols, device)))
            print(f"[{index + 1}/{len(shapes)}] {rows}x{cols} {name}: {results[-1]['ms']:.2f} ms", flush=True)
            del opt
        if "dion3" in args.algorithms:
            fractions = [0.25] + BY_COST_8B.get((rows, cols), [])
            opt = Dion3(params, lr=0.01, fraction=1.0)
            ks = ks_for(rows, args.window, args.coarse, fractions)
            step = stepper(opt, args, len(ks))
            started = time.perf_counter()
            # each k beside its next multiple of 128, measured in turns (rounds): slow drifts of the
            # GPU's clocks over a sweep then fall on a point and its reference alike
            groups: dict = {}
            for k in ks:
                groups.setdefault(min(rows, -(-k // 128) * 128), []).append(k)
            rounds: dict = {k: [] for k in ks}
            done = 0
            for members in groups.values():
                for _ in range(args.rounds):
                    for k in members:
                        opt.param_groups[0]["fraction"] = k / rows
                        rounds[k].append(time_steps(step, args.warmup, args.steps, device))
                for k in members:
                    n, m = min(k, cols), max(k, cols)
                    results.append(dict(shape=[rows, cols], algorithm="dion3", k=k,
                                        ms=statistics.median(statistics.median(r) for r in rounds[k]),
                                        all_ms=[t for r in rounds[k] for t in r], rounds=args.rounds,
                                        flops=args.count * step_flops(k, cols, device),
                                        padded=list(padded_shape(n, m, device, torch.float16))))
                done += len(members)
                print(f"[{index + 1}/{len(shapes)}] {rows}x{cols} dion3: {done}/{len(ks)} k "
                      f"({time.perf_counter() - started:.0f} s), k={members[-1]}: {results[-1]['ms']:.2f} ms", flush=True)
            del opt
        del params
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save(_record(args, device, results))
    return _record(args, device, results)


def _record(args, device, results) -> dict:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return dict(command=" ".join(sys.argv), count=args.count, steps=args.steps, warmup=args.warmup, graph=args.graph,
                device=name, torch=torch.__version__, results=results)


def report(data: dict, md_path: str, plot_path: str) -> bool:
    rows = data["results"]
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault(tuple(r["shape"]), {}).setdefault(r["algorithm"], {})[r["k"]] = r
    lines = [f"Device {data['device']}, torch {data['torch']}; a bucket of {data['count']} fp32 matrices per shape, "
             f"{'graph-captured' if data.get('graph') else 'eager'} steps, median of {data['steps']} after {data['warmup']} warm-up (CUDA events).", "",
             "| shape | k measured | worst time(k) / time(⌈k⌉₁₂₈) (at k) | time(k) ms at f = 1/4 | Muon ms | NorMuon ms |",
             "|---|---|---|---|---|---|"]
    ok = True
    for (r, c), algorithms in by_shape.items():
        dion3 = algorithms.get("dion3", {})
        worst, worst_k = 0.0, None
        for k, point in dion3.items():
            aligned = min(r, -(-k // 128) * 128)
            if aligned in dion3:
                ratio = point["ms"] / dion3[aligned]["ms"]
                if ratio > worst:
                    worst, worst_k = ratio, k
        ok &= worst <= 1.1 or not dion3
        quarter = dion3.get(max(1, math.ceil(round(0.25 * r, 9))), {}).get("ms")
        lines.append(f"| {r}×{c} | {len(dion3)} | {worst:.3f} (k={worst_k}) | "
                     f"{'-' if quarter is None else f'{quarter:.2f}'} | "
                     f"{algorithms.get('muon', {}).get(r, {}).get('ms', float('nan')):.2f} | "
                     f"{algorithms.get('normuon', {}).get(r, {}).get('ms', float('nan')):.2f} |")
    lines += ["", "Time per executed FLOP (ms per PFLOP) of unaligned shapes against their aligned neighbours:", "",
              "| shape | algorithm | ms/PFLOP | neighbour | ms/PFLOP | ratio |", "|---|---|---|---|---|---|"]
    for shape, neighbours in NEIGHBOURS.items():
        for algorithm in ("muon", "normuon", "dion3"):
            ks = by_shape.get(shape, {}).get(algorithm, {})
            if not ks:
                continue
            k = shape[0] if algorithm != "dion3" else max(1, math.ceil(0.25 * shape[0]))
            if k not in ks:
                continue
            mine = ks[k]["ms"] / ks[k]["flops"] * 1e15
            for other in neighbours:
                theirs_k = other[0] if algorithm != "dion3" else max(1, math.ceil(0.25 * other[0]))
                theirs = by_shape.get(other, {}).get(algorithm, {}).get(theirs_k)
                if theirs is None:
                    continue
                per = theirs["ms"] / theirs["flops"] * 1e15
                ok &= mine <= 1.2 * per
                lines.append(f"| {shape[0]}×{shape[1]} | {algorithm} | {mine:.2f} | {other[0]}×{other[1]} | {per:.2f} | "
                             f"{mine / per:.3f} |")
    lines.append("")
    lines.append(f"Every k within 1.1× of its next multiple of 128, unaligned shapes within 1.2× per FLOP: {'yes' if ok else 'NO'}")
    with open(md_path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in by_shape if "dion3" in by_shape[s]]
    fig, axes = plt.subplots(len(shapes), 1, figsize=(8, 2.6 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        points = sorted(by_shape[shape]["dion3"].items())
        ax.plot([k for k, _ in points], [p["ms"] for _, p in points], ".-", ms=3, lw=0.8, label="Dion3 step")
        aligned = [(k, p) for k, p in points if k % 128 == 0]
        ax.plot([k for k, _ in aligned], [p["ms"] for _, p in aligned], "o", ms=3, label="k multiple of 128")
        ax.set_title(f"{shape[0]}×{shape[1]}, {data['count']} matrices", fontsize=9)
        ax.set_xlabel("selected rows k")
        ax.set_ylabel("step ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)
    return ok


def busy_points(data: dict) -> dict:
    """{(rows, cols): [(k, ms)]}: the Dion3 points that keep the GPU busy (shapes of 4096² and up,
    k ≥ 1024 or every row), where step time follows the work and not the host's launches."""
    by_shape: dict = {}
    for r in data["results"]:
        rows, cols = r["shape"]
        if r["algorithm"] == "dion3" and rows * cols >= 4096 * 4096 and (r["k"] >= 1024 or r["k"] == rows):
            by_shape.setdefault((rows, cols), []).append((r["k"], r["ms"]))
    return by_shape


def fit(data: dict) -> str:
    """Least squares (relative errors) of ms = offset(shape) + count · Σ constant · feature, the
    features of dion3.ortho.cost.time_features, over busy_points."""
    from dion3.ortho.cost import TimeModel, time_features

    by_shape = busy_points(data)
    shapes = list(by_shape)
    design, target = [], []
    for i, (shape, points) in enumerate(by_shape.items()):
        for k, ms in points:
            features = [data["count"] * x * 1e3 for x in time_features(k, shape[1])]  # ms per second of constant
            design.append([1.0 / ms if j == i else 0.0 for j in range(len(shapes))] + [x / ms for x in features])
            target.append(1.0)
    a = torch.tensor(design, dtype=torch.float64)
    scale = a.abs().amax(dim=0)  # columns of ~1, so the solve is well conditioned
    solution = torch.linalg.lstsq(a / scale, torch.ones(len(target), 1, dtype=torch.float64))
    coefficients = (solution.solution[:, 0] / scale).tolist()
    model = TimeModel(*coefficients[len(shapes):])
    errors = []
    for i, (shape, points) in enumerate(by_shape.items()):
        for k, ms in points:
            predicted = coefficients[i] + sum(w * data["count"] * x * 1e3 for w, x in zip(model, time_features(k, shape[1])))
            errors.append(predicted / ms - 1)
    rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
    return (f"{model}\n{len(errors)} points of {len(shapes)} shapes: rms error {rms:.2%}, largest {max(map(abs, errors)):.1%}; "
            f"{1e-12 / model.square_flops:.0f} and {1e-12 / model.long_flops:.0f} TFLOP/s, "
            f"{1e-12 / model.product_bytes:.2f} TB/s of product traffic, {1e-12 / model.row_bytes:.2f} TB/s of selected rows")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in LLAMA_8B + UNALIGNED))
    parser.add_argument("--algorithms", default="dion3,muon,normuon")
    parser.add_argument("--count", type=int, default=32, help="matrices per bucket (default 32)")
    parser.add_argument("--window", type=int, default=12, help="k ± window around each fraction (default 12)")
    parser.add_argument("--coarse", type=int, default=16, help="points of the coarse sweep over 1…rows (default 16)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--graph", action="store_true",
                        help="time CUDA-graph replays (CapturedStep) instead of eager steps; --warmup ≥ 3 covers the capture")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns over each k and its next multiple of 128; a point is the median of its turns' medians (default 3)")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    parser.add_argument("--out", help="write the sweep's JSON here")
    parser.add_argument("--report", metavar="JSON", help="write the table (--md) and plot (--plot) of a sweep")
    parser.add_argument("--fit", metavar="JSON", help="print the time model's constants (dion3.ortho.cost.H200_TIME) fitted to a sweep")
    parser.add_argument("--md", default="k-sweep.md")
    parser.add_argument("--plot", default="k-sweep.png")
    args = parser.parse_args(argv)
    if args.fit:
        with open(args.fit) as handle:
            print(fit(json.load(handle)))
        return 0
    if args.report:
        with open(args.report) as handle:
            return 0 if report(json.load(handle), args.md, args.plot) else 1
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("the sweep times CUDA steps: run it on a GPU (--device cpu for a smoke run; --report works anywhere)")
    def save(data: dict) -> None:
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(data, handle)

    save(sweep(args, save))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
