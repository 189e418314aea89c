"""Could splitting a matrix's orthogonalization over two ranks bring Llama-70B's Dion3 owners
below max/mean 1.05 at 64 ranks? The costs of benchmarks/owner_balance.py (the H200 model of
dion3.distributed.owners), and for a split matrix (standard Newton–Schulz on a wide n×m
selection, its columns halved between two ranks) each half's cost: per step its half of XXᵀ
and of (bA + cA²)·X, the whole n×n square A² (both ranks need it), and an all-reduce of A
(n² half-precision values at the link rate), plus half the matrix's traffic.

For every number s of heavy matrices split (0 … all), the lower bound of any assignment of the
resulting pieces (owner_balance.lower_bound: the largest piece, the mean, and t + 1 of the
t·W + 1 largest on one rank) is compared with what owners by cost (LPT) reach without
splitting. The step waits for the busiest rank, so a split helps only if that bound drops below
LPT's busiest load.

    PYTHONPATH=src python3 benchmarks/owner_split_bound.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import owner_balance  # noqa: E402  (beside this file)

from dion3.bench.presets import MODELS  # noqa: E402
from dion3.distributed.owners import LINK_BYTES_PER_S, MATMUL_FLOPS_PER_S, assign_owners  # noqa: E402
from dion3.ortho.cost import symmetric_share  # noqa: E402
from dion3.ortho.newton_schulz import choose_method  # noqa: E402
from dion3.kernels import SYMMETRIC_SPEEDUP  # noqa: E402

STEPS = 5  # Polar Express


def half_cost(k: int, cols: int, whole_cost: float, whole_bytes_cost: float) -> float:
    n, m = min(k, cols), max(k, cols)
    share = symmetric_share(n)
    flops = STEPS * (2 * n * n * (m / 2) * share + 2 * n ** 3 * share + 2 * n * n * (m / 2))
    reduce_seconds = STEPS * n * n * owner_balance.WIRE_BYTES / LINK_BYTES_PER_S
    return flops / MATMUL_FLOPS_PER_S + reduce_seconds + whole_bytes_cost / 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-70b")
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args(argv)
    buckets = owner_balance.buckets_of(MODELS[args.model], args.ranks, 1)
    for algorithm, (fraction, scope) in owner_balance.ALGORITHMS.items():
        costs = [owner_balance.cost(b, fraction, scope) for b in buckets]
        assign_owners(buckets, lambda b: "all", lambda b: costs[buckets.index(b)])
        loads = [0.0] * args.ranks
        for b, c in zip(buckets, costs):
            for owner in b.owner_of:
                loads[owner] += c
        lpt_max, mean = max(loads), sum(loads) / args.ranks
        heavy = max(range(len(buckets)), key=lambda i: costs[i])
        b = buckets[heavy]
        k = owner_balance.rows_on_owner(b, fraction, scope)
        if choose_method(k, b.shape[1], SYMMETRIC_SPEEDUP) != "newton_schulz":
            print(f"{algorithm}: heaviest matrices use Gram NS; this model covers standard NS only")
            continue
        bytes_cost = owner_balance.owner_bytes(k, b.shape[1], b.world_size, owner_balance.WIRE_BYTES) / LINK_BYTES_PER_S
        half = half_cost(k, b.shape[1], costs[heavy], bytes_cost)
        others = [c for i, (bb, c) in enumerate(zip(buckets, costs)) if i != heavy for _ in range(bb.count)]
        best = None
        for s in range(b.count + 1):
            items = sorted([costs[heavy]] * (b.count - s) + [half] * (2 * s) + others, reverse=True)
            total = sum(items)
            bound = max(items[0], total / args.ranks)
            for t in range(len(items) // args.ranks + 1):
                if t * args.ranks < len(items):
                    bound = max(bound, (t + 1) * items[t * args.ranks])
            if best is None or bound < best[1]:
                best = (s, bound, total / args.ranks)
        print(f"{args.model}, FSDP2, {args.ranks} ranks, {algorithm}: {b.count} heaviest matrices {k}×{b.shape[1]} at "
              f"{costs[heavy] * 1e3:.2f} ms whole, {half * 1e3:.2f} ms per half when split; "
              f"LPT without splits: busiest {lpt_max * 1e3:.2f} ms, mean {mean * 1e3:.2f} ms ({lpt_max / mean:.3f}); "
              f"with s splits the busiest rank is at least {best[1] * 1e3:.2f} ms at best (s = {best[0]}, "
              f"mean then {best[2] * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
