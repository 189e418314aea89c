"""Owner balance of the distributed step: the busiest rank's load (orthogonalization FLOPs and
the bytes its owned matrices move, in seconds) over the mean load, with owners by count (the
rule before owners by cost: blocks of ⌈N/W⌉ from where the previous bucket stopped) and by cost
(LPT, dion3.distributed.owners), for Llama-8B/70B/405B on 8, 64 and 512 ranks under FSDP2 and
FSDP2 + TP (tp = 8). No GPU and no process group:

    python3 -m dion3.tools.plan.owner_balance --out benchmarks/results/owner-balance.md

The buckets are those build_buckets makes for these layouts (FSDP2: one per matrix shape;
FSDP2 + TP: one per shape and placements, the column-parallel q, k/v, gate/up apart from the
row-parallel o and down), in parameter order (q, k, v, o, gate, down, up per layer). Each
member's rows come from dion3.distributed.layout.matrix_layout on the layout's placements, K
(a matrix's rows on its owner) from the same rule as the planner's owner_cost, each matrix's
cost from dion3.ortho.cost.step_flops on the meta device (an H200's method choice, symmetric
kernels from n = 1024; what the planner prices parameters on the meta device at) and
owners.owner_bytes in half precision, and the owners from owners.assign_owners. The planner
itself is not instantiated: 512 ranks would need 512 processes or a fake process group.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dion3.tools.bench.presets import MODELS
from dion3.distributed.layout import matrix_layout
from dion3.distributed.owners import Owners, assign_owners, matrix_cost, owner_bytes
from dion3.ortho.cost import step_flops
from dion3.rules import selected_row_count

ALGORITHMS = {"Muon": (None, None), "Dion3 f=1/4 local": (0.25, "local"), "Dion3 f=1/4 global": (0.25, "global")}
WIRE_BYTES = 2  # bf16 / fp16 rows on a GPU


def layer_matrices(preset) -> list[tuple[str, tuple[int, int]]]:
    """(name, (rows, cols)) of one layer's weights in parameter order."""
    shape = {m.name: (m.rows, m.cols) for m in preset.matrices}
    return [("q", shape["q,o"]), ("k", shape["k,v"]), ("v", shape["k,v"]), ("o", shape["q,o"]),
            ("gate", shape["gate,up"]), ("down", shape["down"]), ("up", shape["gate,up"])]


def placements(name: str, tp: int):
    """(placements, mesh shape) of a weight: FSDP2 rows over all ranks, or FSDP2 + TP with
    q, k, v, gate, up column-parallel and o, down row-parallel (torchtitan's Llama plan)."""
    if tp == 1:
        return [Shard(0)]
    return [_StridedShard(0, split_factor=tp), Shard(0)] if name not in ("o", "down") else [Shard(0), Shard(1)]


class Bucket(Owners):
    def __init__(self, shape, count, held_rows, row_sets, world):
        self.shape, self.count, self.held_rows, self.row_sets = shape, count, held_rows, row_sets
        self.world_size, self.mesh = world, "group"

    def holder(self):
        return None


def buckets_of(preset, world: int, tp: int) -> list[Bucket]:
    """The sharded buckets of the whole model, in the order the planner builds them."""
    mesh_shape = (world,) if tp == 1 else (world // tp, tp)
    coordinates = [(r,) if tp == 1 else (r // tp, r % tp) for r in range(world)]  # group-rank order
    keys: dict[tuple, list] = {}
    for name, shape in layer_matrices(preset):
        key = (shape, tuple(map(str, placements(name, tp))))
        keys.setdefault(key, [shape, placements(name, tp), 0])[2] += preset.layers
    out = []
    for shape, place, count in keys.values():
        members = [matrix_layout(shape, place, mesh_shape, c, False) for c in coordinates]
        out.append(Bucket(shape, count, [len(m.rows) for m in members], len({m.rows for m in members}), world))
        out[-1].first_of_set = list({m.rows: i for i, m in reversed(list(enumerate(members)))}.values())
    return out


def rows_on_owner(bucket: Bucket, fraction, scope) -> int:
    """K as the planner's _rows_on_owner: every row; k = ⌈f·rows⌉; or each row set's own
    min(⌈f·b⌉, rows held), b the most rows any member holds."""
    if fraction is None:
        return bucket.shape[0]
    if scope == "global":
        return selected_row_count(bucket.shape[0], fraction)
    b = max(bucket.held_rows)
    return sum(min(selected_row_count(b, fraction), bucket.held_rows[s]) for s in bucket.first_of_set)


def cost(bucket: Bucket, fraction, scope) -> float:
    k = rows_on_owner(bucket, fraction, scope)
    return matrix_cost(step_flops(k, bucket.shape[1], "meta"), owner_bytes(k, bucket.shape[1], bucket.world_size, WIRE_BYTES))


def by_count(buckets: list[Bucket]) -> list[list[int]]:
    """The rule before owners by cost, restated: blocks of ⌈N/W⌉ for consecutive members, each
    bucket starting where the previous one stopped, modulo the starts at which it fits."""
    out, next_owner = [], 0
    for b in buckets:
        block = -(-b.count // b.world_size)
        used = -(-b.count // block)
        first = next_owner % (b.world_size - used + 1)
        next_owner = first + used
        out.append([first + j // block for j in range(b.count)])
    return out


def lower_bound(buckets, costs, world: int) -> float:
    """No assignment of whole matrices does better: the largest matrix, the mean, and for every
    t, the (t·W + 1) largest matrices put t + 1 of them on one rank, each at least as heavy as
    the (t·W + 1)-th largest (over the mean load)."""
    items = sorted((c for b, c in zip(buckets, costs) for _ in range(b.count)), reverse=True)
    bound = max(items[0], sum(items) / world)
    for t in range(len(items) // world + 1):
        if t * world < len(items):
            bound = max(bound, (t + 1) * items[t * world])
    return bound / (sum(items) / world)


def imbalance(buckets, owners, costs, world: int) -> float:
    loads = [0.0] * world
    for bucket_owners, c in zip(owners, costs):
        for owner in bucket_owners:
            loads[owner] += c
    return max(loads) / (sum(loads) / world)


def rows(models, ranks, tps) -> list[dict]:
    out = []
    for model in models:
        preset = MODELS[model]
        for tp in tps:
            for world in ranks:
                buckets = buckets_of(preset, world, tp)
                for algorithm, (fraction, scope) in ALGORITHMS.items():
                    costs = [cost(b, fraction, scope) for b in buckets]
                    before = by_count(buckets)
                    assign_owners(buckets, lambda b: "all", lambda b: costs[buckets.index(b)])
                    out.append(dict(model=model, layout="FSDP2" if tp == 1 else f"FSDP2 + TP {tp}", ranks=world,
                                    algorithm=algorithm, matrices=sum(b.count for b in buckets),
                                    before=imbalance(buckets, before, costs, world),
                                    after=imbalance(buckets, [b.owner_of for b in buckets], costs, world),
                                    bound=lower_bound(buckets, costs, world)))
    return out


def markdown(table: list[dict], command: str, commit: str, date: str) -> str:
    lines = ["# Owner balance: busiest rank's load over the mean, owners by count vs by cost (LPT)", "",
             f"Command: `{command}`  ·  date {date}  ·  commit {commit}", "",
             "Load of a rank: the orthogonalization time (executed FLOPs at 790 TFLOP/s) and the bytes its",
             "owned matrices move (450 GB/s) of every matrix it owns (dion3.distributed.owners.matrix_cost),",
             "H200 model. 1.00 is perfect balance; the step waits for the busiest owner. The lower bound",
             "holds for any assignment of whole matrices (the largest one; t + 1 of the t·W + 1 largest",
             "on one rank): with fewer matrices than ranks, or a few heavy ones, no owner rule does better.", "",
             "| model | layout | ranks | algorithm | matrices | by count max/mean | by cost (LPT) max/mean | lower bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['model']} | {r['layout']} | {r['ranks']} | {r['algorithm']} | {r['matrices']} | "
                     f"{r['before']:.3f} | {r['after']:.3f} | {r['bound']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-8b,llama-70b,llama-405b")
    parser.add_argument("--ranks", default="8,64,512")
    parser.add_argument("--tp", default="1,8", help="tensor-parallel degrees (1: FSDP2 alone)")
    parser.add_argument("--out", help="markdown file to write (default: print)")
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    table = rows(args.models.split(","), [int(w) for w in args.ranks.split(",")], [int(t) for t in args.tp.split(",")])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = markdown(table, "PYTHONPATH=src python3 src/dion3/tools/plan/owner_balance.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    commit or "unknown", date)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
