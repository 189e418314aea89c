"""Eager optimizer steps of two source trees of dion3 in one process, in many short turns.

Between processes the same eager step on a small model moves by up to 2x on a GPU machine (host
clock, allocator and launch-queue state), far more than the difference between two versions of
the code. This script loads both trees into one process (each tree's `dion3` modules are swapped
into `sys.modules` before its turn, so lazy imports resolve within the tree) and alternates them
in short turns (A B B A ...), each turn `--steps` steps on fixed gradients. It reports, per
optimizer and tree, the median over turns of the wall time per step (host and device together,
synchronized at the end of each turn) and of the CUDA-event device time, with the ratio B / A.

    PYTHONPATH=src python benchmarks/eager_ab.py --trees OLD/src src --preset llama-384 \
        --optimizers muon-gram,normuon,dion3-1/4 --turns 40 --steps 5 --json OUT.json

--scalars adds the preset's embedding, LM head and norm gains as an AdamW group (--vocab V: a
vocabulary of V rows instead of the preset's bytes), so the step includes the AdamW group's.

Trees: each a folder holding a `dion3` package (a checkout's `src`, e.g. from
`git worktree add /tmp/old fcb460d`). Optimizers: muon-gram (Muon, Gram NS where it pays),
normuon, dion3-F (Dion3 at fraction F on every matrix). On the CPU the device column is the wall
time.

--cuda-path (on the CPU): each tree takes the branches a CUDA device takes, its Triton launches
counted and not run (`eager_ops.py`'s replay), on the preset's matrices scaled down to a few rows
and columns (the same buckets and counts): what is left is the host time of an eager GPU step,
to compare two trees without a GPU. Muon only for trees whose selection reads kernel outputs on
the host side (fcb460d's Dion3 and NorMuon do).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

sys.path.insert(0, "src")
from dion3.tools.bench.presets import PRESETS  # noqa: E402 (shapes only; the timed code is the trees')

sys.path.pop(0)


def _drop_dion3() -> None:
    for name in [n for n in sys.modules if n == "dion3" or n.startswith("dion3.")]:
        del sys.modules[name]


def load_tree(path: str) -> dict:
    """Import the `dion3` package under `path` and return its modules (name -> module)."""
    if not (Path(path) / "dion3" / "__init__.py").is_file():
        # Without this, the import below finds the installed dion3 and both sides time one tree.
        raise SystemExit(f"--trees: {path} holds no dion3/__init__.py (give the folder above dion3)")
    _drop_dion3()
    sys.path.insert(0, path)
    try:
        importlib.import_module("dion3")
        importlib.import_module("dion3.optim")
    finally:
        sys.path.remove(path)
    return {n: m for n, m in sys.modules.items() if n == "dion3" or n.startswith("dion3.")}


def activate(modules: dict) -> None:
    """Make `modules` (one tree's) the `dion3` that imports inside its code find."""
    _drop_dion3()
    sys.modules.update(modules)


def build(modules: dict, variant: str, shapes, device, seed: int, scalars=()):
    """The variant's optimizer over fresh matrices of `shapes` (and, with `scalars`, an AdamW group
    of those shapes), every parameter with a fixed random gradient."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def leaf(shape):
        p = torch.nn.Parameter(torch.randn(shape, generator=generator).to(device))
        p.grad = torch.randn(shape, generator=generator).to(device) * 0.01
        return p

    params = [leaf((shape.rows, shape.cols)) for shape in shapes for _ in range(shape.count)]
    extra = [leaf(shape.shape) for shape in scalars for _ in range(shape.count)]
    if extra:
        params = [{"params": params}, {"params": extra, "algorithm": "adamw", "lr": 1e-3}]
    dion3 = modules["dion3"]
    common = dict(lr=0.01, weight_decay=0.01)
    if variant == "muon-gram":
        return dion3.Muon(params, **common)
    if variant == "normuon":
        return dion3.NorMuon(params, **common)
    if variant.startswith("dion3-"):
        return dion3.Dion3(params, fraction=float(Fraction(variant.removeprefix("dion3-"))), **common)
    raise SystemExit(f"eager_ab: unknown optimizer {variant!r} (muon-gram, normuon, dion3-F)")


def tiny_shapes(shapes):
    """The shapes with every dimension divided by 32 (at least 8): distinct shapes stay distinct, so
    the buckets and their counts are the preset's."""
    return [dataclasses.replace(s, rows=max(8, s.rows // 32), cols=max(8, s.cols // 32)) for s in shapes]


def turn(optimizer, steps: int, device) -> tuple[float, float]:
    """Seconds per step: wall (synchronized at the end) and device (CUDA events; wall on the CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
    wall = (time.perf_counter() - t0) / steps
    return wall, (start.elapsed_time(end) / 1e3 / steps if cuda else wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"))
    parser.add_argument("--preset", default="llama-384", choices=sorted(PRESETS))
    parser.add_argument("--optimizers", default="muon-gram,normuon,dion3-1/4")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5, help="steps per turn")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cuda-path", action="store_true",
                        help="CPU: replay the CUDA path on tiny matrices (module docstring)")
    parser.add_argument("--scalars", action="store_true",
                        help="also the preset's embedding, LM head and norm gains, in an AdamW group")
    parser.add_argument("--vocab", type=int, help="with --scalars: this vocabulary instead of the preset's")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = PRESETS[args.preset].matrices
    scalars = PRESETS[args.preset].scalars if args.scalars else ()
    if args.vocab:
        if not args.scalars:
            parser.error("--vocab sets the embedding's rows: use it with --scalars")
        scalars = tuple(dataclasses.replace(s, shape=(args.vocab,) + s.shape[1:]) if len(s.shape) == 2 else s
                        for s in scalars)
    if args.cuda_path:
        if device.type != "cpu":
            parser.error("--cuda-path replays the CUDA path on the CPU: use --device cpu")
        shapes = tiny_shapes(shapes)
    trees = [load_tree(path) for path in args.trees]
    if args.cuda_path:
        sys.path.insert(0, str(Path(__file__).parent))
        import eager_ops  # noqa: E402 (the replay)

        for modules in trees:
            activate(modules)
            eager_ops.emulate_cuda_path([None], execute=False)
    for label, modules in zip("AB", trees):
        print(f"tree {label}: {modules['dion3'].__file__}", flush=True)
    variants = [v.strip() for v in args.optimizers.split(",") if v.strip()]
    results = {}
    for variant in variants:
        optimizers = []
        for modules in trees:
            activate(modules)
            optimizers.append(build(modules, variant, shapes, device, seed=0, scalars=scalars))
            for _ in range(args.warmup):
                optimizers[-1].step()
        times = [[], []]
        for t in range(args.turns):
            for side in ((0, 1) if t % 2 == 0 else (1, 0)):
                activate(trees[side])
                times[side].append(turn(optimizers[side], args.steps, device))
        row = {}
        for side, label in ((0, "A"), (1, "B")):
            row[label] = {"wall_ms": 1e3 * statistics.median(w for w, _ in times[side]),
                          "device_ms": 1e3 * statistics.median(d for _, d in times[side]),
                          "wall_ms_all": [1e3 * w for w, _ in times[side]]}
        row["wall_ratio"] = row["B"]["wall_ms"] / row["A"]["wall_ms"]
        row["device_ratio"] = row["B"]["device_ms"] / row["A"]["device_ms"]
        results[variant] = row
        print(f"{variant:12s} wall A {row['A']['wall_ms']:8.3f} B {row['B']['wall_ms']:8.3f} ms  B/A {row['wall_ratio']:.3f}"
              f" | device A {row['A']['device_ms']:8.3f} B {row['B']['device_ms']:8.3f} ms  B/A {row['device_ratio']:.3f}",
              flush=True)
        del optimizers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        meta = {"trees": [modules["dion3"].__file__ for modules in trees], "preset": args.preset,
                "scalars": [dataclasses.asdict(s) for s in scalars],
                "turns": args.turns, "steps": args.steps, "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
