"""CPU optimizer step time on small Llama-like shapes (the CPU step-time target: Dion3 f=¼ no slower
than the public code and ≥ 3× our Muon).

Default shapes: 4 layers of d=256, ffn 1024, kv dim 64, i.e. per layer q,o 256×256, k,v 64×256,
gate,up 1024×256 and down 256×1024 (fp32 parameters, fixed random fp32 gradients, matrices only).
Each optimizer is built fresh, warmed up, then timed for --steps steps with perf_counter.
--repeats runs the whole list several times, interleaved (A, B, A, B, ...), so a neighbour's
load on a shared machine hits every row alike. The table gives the median over all timed steps
of all repeats with its interquartile range, and the quietest repeat's median (the smallest of
the per-repeat medians): on a shared 2-core machine, two OpenMP threads slow down many times
over whenever a neighbour takes a core, and that column shows the step without it.

    PYTHONPATH=src python benchmarks/cpu_step.py
    PYTHONPATH=src python benchmarks/cpu_step.py --optimizers dion3-1/4,muon --steps 60 --repeats 5
    DION3_CPU_NS_DTYPE=float32 PYTHONPATH=src python benchmarks/cpu_step.py   # the float32 path
    PYTHONPATH=src python benchmarks/cpu_step.py --public PATH --steps 10 --repeats 10   # beside the public code

--public PATH names a folder holding the public Dion code's `dion` package (from a checkout of
its repository; not part of dion3): its Dion3, Muon and NorMuon are then timed in the same
interleaved repeats (the first repeat's warm-up pays its torch.compile). Name public variants
in --optimizers (e.g. `dion3-1/4,public-dion3-1/4`) to time only those: on a CPU without native
bf16 products the public Muon and NorMuon take seconds a step.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import torch

from dion3.tools.bench.presets import llama
from dion3.tools.bench.step_time import make_optimizer, make_parameters, parse_variant
try:
    from dion3.ortho import cpu_compute_dtype
except ImportError:  # commits before the CPU dtype choice: always float32
    def cpu_compute_dtype() -> torch.dtype:
        return torch.float32


def commit() -> str:
    """The commit of the dion3 package being timed (not of this script), +dirty if modified."""
    import dion3

    where = os.path.dirname(dion3.__file__)
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no", "."],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return f"unknown ({where} is not in a git checkout)"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


PUBLIC_PREFIX = "public-"


def public_optimizer(name: str, params):
    """The public Dion code's optimizer for a `public-` variant (imported from --public's
    folder): Dion3 (its NorDion2) with fraction F, lr 0.01 and weight decay 0.01, or Muon /
    NorMuon with their defaults (also lr 0.01, weight decay 0.01)."""
    import dion  # the public package, on sys.path from --public

    if not torch.cuda.is_available():  # its step asks this, which a CPU-only torch cannot answer
        torch.cuda.is_current_stream_capturing = lambda: False
    variant = name[len(PUBLIC_PREFIX):]
    if variant.startswith("dion3-"):
        return dion.Dion3(params, lr=0.01, fraction=parse_variant(variant).fraction, weight_decay=0.01)
    return {"muon": dion.Muon, "normuon": dion.NorMuon}[variant](params)


def timed_steps(name: str, preset, warmup: int, steps: int) -> list[float]:
    torch.manual_seed(0)
    matrices, _ = make_parameters(preset, torch.device("cpu"), with_scalars=False)
    if name.startswith(PUBLIC_PREFIX):
        optimizer = public_optimizer(name, matrices)
    else:
        optimizer = make_optimizer(parse_variant(name), matrices, [], torch.device("cpu"), graph=False)
    for _ in range(warmup):
        optimizer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default="dion3-1/4,muon-gram,muon,normuon",
                        help="comma list of dion3 bench variants (muon = standard NS everywhere; "
                             "muon-gram = dion3.Muon() defaults)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--kv-dim", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per optimizer and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes over the optimizer list")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--public", metavar="PATH",
                        help="folder holding the public Dion code's `dion` package: adds public-dion3-1/4, "
                             "public-muon and public-normuon to the list, timed interleaved with ours (unless "
                             "--optimizers names public- variants: then those alone)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = llama("cpu-step", args.layers, args.dim, args.kv_dim, args.hidden, vocab=1, tied=True)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if args.public:
        sys.path.insert(0, args.public)
        if not any(n.startswith(PUBLIC_PREFIX) for n in names):  # else: the public variants named
            names += [PUBLIC_PREFIX + n for n in ("dion3-1/4", "muon", "normuon")]
    times: dict[str, list[float]] = {n: [] for n in names}
    repeat_medians: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            steps = timed_steps(name, preset, args.warmup, args.steps)
            times[name] += steps
            repeat_medians[name].append(statistics.median(steps))

    def quartiles(values):
        q = statistics.quantiles(values, n=4)
        return q[0], statistics.median(values), q[2]

    medians = {n: statistics.median(t) for n, t in times.items()}
    print(f"# CPU optimizer step, {args.layers} layers of d={args.dim}, ffn {args.hidden}, kv {args.kv_dim}\n")
    print(f"Command: `{' '.join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])}`"
          + (f" with DION3_CPU_NS_DTYPE={os.environ['DION3_CPU_NS_DTYPE']}" if "DION3_CPU_NS_DTYPE" in os.environ else ""))
    print(f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit()}")
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"Newton–Schulz compute dtype on this CPU: {str(cpu_compute_dtype()).replace('torch.', '')}")
    print(f"Steps: {args.warmup} warm-up, then {args.steps} timed × {args.repeats} interleaved repeats per optimizer\n")
    print("| optimizer | median ms | p25 ms | p75 ms | quietest repeat ms | vs dion3-1/4 (median) | vs dion3-1/4 (quietest) |")
    print("|---|---|---|---|---|---|---|")
    ref = medians.get("dion3-1/4")
    quiet = {n: min(m) for n, m in repeat_medians.items()}
    for name in names:
        low, mid, high = quartiles(times[name])
        ratios = [f"{mid / ref:.2f}×", f"{quiet[name] / quiet['dion3-1/4']:.2f}×"] if ref else ["—", "—"]
        print(f"| {name} | {mid:.2f} | {low:.2f} | {high:.2f} | {quiet[name]:.2f} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
