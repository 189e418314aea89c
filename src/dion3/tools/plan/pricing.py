"""The cost of one optimizer step on every rank, from the buckets the real planner built.

Per member s of a bucket of N matrices of R×C (it holds h_s rows × w_s columns of each and
owns n_s of them; K rows of each matrix reach its owner, k_s of them from s):
  selection  Muon/NorMuon: k_s = h_s, K = R. Dion3 local: k_s = min(⌈f·b⌉, h_s) with b the
             most rows a member holds, K = Σ k over the distinct row sets. Dion3 global:
             K = ⌈f·R⌉, k_s = K·h_s/R (the selection depends on the data: its mean).
  compute    n_s × the executed FLOPs of orthogonalizing a K×C matrix (dion3.tools.bench.step_cost: the
             method "auto" picks, symmetric products at their lower-triangle tiles) at a
             sustained rate; Muon's baseline (standard NS on cuBLAS) at its own rate.
  memory     N × the fused elementwise bytes of the local piece (bench.flops.elementwise_bytes,
             with k_s selected rows), plus, on an owner of a distributed bucket, placing the
             received rows and reordering the result (read + write each, 4·e bytes per element
             of its n_s·K·C), at one memory-pass bandwidth.
  traffic    exactly what dion3.distributed counts (exchange.Traffic): all-to-all of the rows
             (e bytes each, the compute dtype) and of their variances (4 B, NorMuon/Dion3) to the
             owners and back; all-reduce of per-matrix norms (a ring: 2·(G−1)/G of the data);
             Dion3: all-reduce of partial row scores over column shards, global scope an
             all-gather of padded row scores; DDP: all-gather of each rank's ⌈N/W⌉ results.
  host       the eager distributed step's kernel launches, stage by stage (STAGE_LAUNCHES: the
             pipeline's generator yields between stages), each costing the host Hardware.launch_s.
A collective takes latency + max over its members of max(bytes within the node / NVLink rate,
bytes across nodes / fabric rate), each link class counting the larger of what a member sends
and receives; a ring over more than one node runs at the fabric's rate.
Critical path: the slowest rank's memory passes + max(the slowest owner's compute + the time
its device waits for the host, the sum of all collectives) — the pipeline keeps buckets in
flight, so collectives of one bucket overlap another's compute and the host's launches
(overlap=False adds them instead) — + a fixed device time per distributed bucket (small copies
and waits the bytes and FLOPs leave out; 0 on one device, where the step is captured). The
waits: total.exposed_host_s, stages issued in the pipeline's order by one host and run in that
order by one device; a host sync makes the host wait for the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from ..bench.step_cost import elementwise_bytes, h200_symmetric, orthogonalize_flops
from ...rules import selected_row_count
from .buckets import BucketPlan

# The pipeline of the distributed step (buckets in flight and their admission budget): its own constants
from ...distributed.interleave import PIPELINE_BUDGET, PIPELINE_DEPTH, PIPELINE_MEMORY_SHARE  # noqa: E402,F401


@dataclass(frozen=True)
class Variant:
    label: str
    algorithm: str  # "muon", "normuon", "dion3"
    fraction: Optional[float] = None
    scope: str = "local"
    orthogonalizer: str = "auto"
    symmetric: bool = True  # symmetric kernels serve n×n products (GPU with Triton)
    momentum_dtype: Optional[str] = None  # the groups' momentum_dtype (None: the parameters', float32)
    allocation: str = "uniform"  # Dion3: "cost" spends `fraction` as a budget, a fraction per matrix shape

    @property
    def momentum_bytes(self) -> int:
        return 2 if self.momentum_dtype == "bfloat16" else 4

    @property
    def normalizes(self) -> bool:
        return self.algorithm in ("normuon", "dion3")


@dataclass(frozen=True)
class Hardware:
    name: str
    symmetric_flops: float  # sustained executed FLOP/s of "auto" orthogonalization on dion3's kernels
    dense_flops: float  # sustained FLOP/s of standard NS on cuBLAS (Muon's baseline)
    memory_bytes: float  # bytes/s of the fused elementwise passes
    capacity: float  # device memory, bytes (pipeline budget)
    wire_bytes: int = 2  # compute dtype of orthogonalization (rows travel in it): bf16 / fp16
    param_bytes: int = 4  # parameters, gradients and momentum (fp32)
    bucket_overhead: float = 0.0  # s of device time per distributed bucket per step: small copies, waits
    launch_s: float = 0.0  # host s per kernel launch of the eager distributed step (0: no host term)


@dataclass(frozen=True)
class Network:
    node_size: int = 8
    nvlink: float = 360e9  # bytes/s per GPU per direction within a node
    fabric: float = 40e9  # bytes/s per GPU per direction between nodes
    latency: float = 15e-6  # per collective within a node, s
    fabric_latency: float = 40e-6  # per collective spanning nodes, s
    overlap: bool = True


@dataclass
class Collective:
    kind: str  # "rows", "variance", "norms", "scores"
    op: str  # "all_to_all", "all_reduce", "all_gather"
    bucket: int
    seconds: float = 0.0


@dataclass
class RankCost:
    owned: int = 0
    dense_flops: float = 0.0
    executed_flops: float = 0.0
    compute_s: float = 0.0
    memory_bytes: float = 0.0
    memory_s: float = 0.0
    sent: dict = field(default_factory=dict)  # kind → bytes
    received: dict = field(default_factory=dict)
    params: float = 0.0  # bytes on this rank
    grads: float = 0.0
    state: float = 0.0
    transient: float = 0.0

    @property
    def total_sent(self) -> float:
        return sum(self.sent.values())


# Kernel launches of one bucket's distributed step on a GPU, stage by stage (the pipeline's
# generator yields after each collective it starts): pre-step (+ Dion3's selection) and the norms'
# all-reduce · the rows' exchange · placing, orthogonalizing (+ normalization) and sending back ·
# apply. Counted on the step of 95c7675 with its CUDA branches replayed on the CPU, one bucket on
# 2 ranks (benchmarks/distributed_ops.py); the kernels per step the H200 ran on Llama-1B and 8B
# were within 14% of 4 buckets of these (steps-h200-2026-12-02.md). Global selection sends
# its row scores first, so it has one stage more; its plan syncs the host once (the split sizes)
# after the first 19 launches of its second stage, which therefore counts in two parts.
STAGE_LAUNCHES = {"muon": (5, 7, 30, 11), "normuon": (5, 9, 49, 12), "dion3": (10, 11, 54, 16),
                  "dion3 global": (5, 19, 15, 11, 54, 30)}
SYNC_BEFORE = {"dion3 global": 2}  # the stage (index) the host issues only after the device caught up


@dataclass(frozen=True)
class Stage:
    launches: float
    device_s: float
    sync: bool = False  # the host waits for the device before issuing this stage


def bucket_stages(plan: BucketPlan, variant: Variant, member: int, cost: RankCost, hw: Hardware,
                  piece_launches: int = 0, selected: Optional[tuple[list[float], int]] = None) -> list[Stage]:
    """One member's stages of a distributed bucket: launches and device time of each, in the
    order the step issues them. Device time: the member's memory passes split as the fused passes
    run (momentum 12 B per element in the pre-step; the half-precision copy of every row, 6 B, or
    Dion3's snapshot, 10 B per selected element, before the exchange; the owner's placement and
    NorMuon's read of O, 2 B, with the orthogonalization; the rest in the apply), plus its
    compute, plus Hardware.bucket_overhead spread evenly over the stages. piece_launches: launches
    per matrix of the bucket in the pre-step (code that read each gradient with its own launch).
    selected: selection(plan, variant) when the caller has it (it is the same for every member:
    computing it once per bucket keeps a plan of W ranks linear in W)."""
    key = "dion3 global" if variant.algorithm == "dion3" and variant.scope == "global" else variant.algorithm
    launches = list(STAGE_LAUNCHES[key])
    launches[0] += piece_launches * plan.count
    ks, K = selected if selected is not None else selection(plan, variant)
    held, width = plan.held[member]
    local = plan.count * held * width
    pre = 12 * local
    exchange = 10 * plan.count * ks[member] * width if variant.fraction is not None else 6 * local
    orth = (4 * hw.wire_bytes * cost.owned * K * plan.shape[1] if plan.kind == "rows" and plan.members > 1 else 0)
    orth += 2 * local if variant.algorithm == "normuon" else 0
    device = [pre / hw.memory_bytes, exchange / hw.memory_bytes, orth / hw.memory_bytes + cost.compute_s,
              max(cost.memory_bytes - pre - exchange - orth, 0.0) / hw.memory_bytes]
    if plan.kind == "replicated":  # DDP: pre-step, orthogonalize 1/W and all-gather · apply
        launches, device = [sum(launches[:-1]), launches[-1]], [sum(device[:-1]), device[-1]]
    elif len(launches) == 6:  # global selection: scores' all-gather, then the plan in two parts
        device = [device[0], 0.0, 0.0, device[1], device[2], device[3]]
    share = hw.bucket_overhead / len(device)
    sync = SYNC_BEFORE.get(key) if plan.kind != "replicated" else None
    return [Stage(n, d + share, i == sync) for i, (n, d) in enumerate(zip(launches, device))]


def selection(plan: BucketPlan, variant: Variant) -> tuple[list[float], int]:
    """(k_s per member, K): rows each member contributes to each matrix, rows on its owner."""
    rows = plan.shape[0]
    if plan.kind != "rows":
        k = rows if variant.fraction is None else selected_row_count(rows, variant.fraction)
        return [float(k)] * plan.members, k
    held = [h for h, _ in plan.held]
    if variant.fraction is None:
        return [float(h) for h in held], rows
    if variant.scope == "global":
        total = selected_row_count(rows, variant.fraction)
        return [total * h / rows for h in held], total
    quota = selected_row_count(plan.chunk, variant.fraction) if plan.chunk else 0
    per = [float(min(quota, h)) for h in held]
    first = {}
    for s, c in enumerate(plan.row_class):
        first.setdefault(c, s)
    return per, int(sum(per[s] for s in first.values()))


@lru_cache(maxsize=4096)
def ortho_flops(rows: int, cols: int, orthogonalizer: str, symmetric: bool) -> tuple[int, float]:
    if rows == 0:
        return 0, 0.0
    return orthogonalize_flops(rows, cols, orthogonalizer, h200_symmetric if symmetric else False)


def ring_bytes(values: int, element: int, group: int) -> int:
    """Bytes a member sends in an all-reduce (counted as a ring, as exchange.sum_across does)."""
    return 2 * values * element * (group - 1) // max(group, 1)


def bucket_costs(plan: BucketPlan, variant: Variant, hw: Hardware, node_size: int = 8,
                 wire_bytes: Optional[int] = None):
    """Per member: (RankCost of this bucket, {collective kind: (sent, received, sent within the
    node, received within the node)}), and the collectives' (kind, op, spans nodes?) list."""
    e = hw.wire_bytes if wire_bytes is None else wire_bytes
    rows, cols = plan.shape
    count, world = plan.count, plan.members
    ks, K = selection(plan, variant)
    dense, executed = ortho_flops(K, cols, variant.orthogonalizer, variant.symmetric)
    rate = hw.symmetric_flops if variant.symmetric else hw.dense_flops
    costs = []
    for s, (h, w) in enumerate(plan.held):
        c = RankCost(owned=plan.owned[s])
        c.dense_flops, c.executed_flops = c.owned * dense, c.owned * executed
        c.compute_s = c.executed_flops / rate
        c.memory_bytes = count * elementwise_bytes(variant.algorithm, h, w, ks[s], variant.momentum_bytes)
        if plan.kind == "rows" and world > 1:
            c.memory_bytes += 4 * e * c.owned * K * cols
        c.memory_s = c.memory_bytes / hw.memory_bytes
        local = count * h * w
        c.params = c.grads = local * hw.param_bytes
        c.state = local * variant.momentum_bytes + (count * h * 4 if variant.normalizes else 0)
        costs.append(c)
    links = _traffic(plan, variant, ks, K, e, node_size)
    for s, c in enumerate(costs):
        c.sent = {kind: v[s][0] for kind, v in links.items() if v[s][0]}
        c.received = {kind: v[s][1] for kind, v in links.items() if v[s][1]}
        c.transient = _transient(plan, s, ks, K, e)
    return costs, links


def _traffic(plan: BucketPlan, variant: Variant, ks: list[float], K: int, e: int, node_size: int) -> dict:
    """{kind: per member [sent, received, sent within node, received within node]} (bytes)."""
    world, count, cols = plan.members, plan.count, plan.shape[1]
    if world == 1 or plan.kind == "local":
        return {}
    zero = lambda: [[0.0, 0.0, 0.0, 0.0] for _ in range(world)]  # noqa: E731
    out: dict = {}
    if plan.kind == "replicated":
        block = math.ceil(count / world) * K * cols * e
        out["rows"] = [[block * (world - 1)] * 2 + [0.0, 0.0] for _ in range(world)]
        return out
    out["norms"] = [[ring_bytes(count, 4, world)] * 2 + [0.0, 0.0] for _ in range(world)]
    if variant.fraction is not None and plan.col_group > 1:
        out["scores"] = [[ring_bytes(count * h, 4, plan.col_group)] * 2 + [0.0, 0.0] for h, _ in plan.held]
    if variant.fraction is not None and variant.scope == "global":
        gather = count * plan.chunk * 4 * (plan.row_group - 1)
        scores = out.setdefault("scores", zero())
        for entry in scores:
            entry[0] += gather
            entry[1] += gather
    node = [r // node_size for r in plan.ranks]
    widths = [w for _, w in plan.held]
    kinds = [("rows", widths, e)] + ([("variance", [1] * world, 4)] if variant.normalizes else [])
    for kind, width, size in kinds:
        contrib = [ks[s] * width[s] * size for s in range(world)]  # bytes of one matrix from s
        owned_in, contrib_in = {}, {}
        for s in range(world):
            owned_in[node[s]] = owned_in.get(node[s], 0) + plan.owned[s]
            contrib_in[node[s]] = contrib_in.get(node[s], 0.0) + contrib[s]
        total = sum(contrib)
        table = out.setdefault(kind, zero())
        for s in range(world):
            n = plan.owned[s]
            to_owners = contrib[s] * (count - n)  # forward: s's rows of every matrix it does not own
            to_owners_in = contrib[s] * (owned_in[node[s]] - n)
            back = n * (total - contrib[s])  # backward: its results to every other contributor
            back_in = n * (contrib_in[node[s]] - contrib[s])
            entry = table[s]
            entry[0] += to_owners + back
            entry[1] += back + to_owners  # symmetric: what goes out one way comes in the other
            entry[2] += to_owners_in + back_in
            entry[3] += to_owners_in + back_in
    return out


def _transient(plan: BucketPlan, s: int, ks: list[float], K: int, e: int) -> float:
    """Buffers a member holds while the bucket is in flight (e bytes per element): as an owner,
    its n_s matrices four times over (received or snapshot input, Newton–Schulz's iterate and its
    successor, the result in the order it goes back) and two n×n matrices each (n = min(K, C));
    in a distributed bucket also its rows to send and their results. On one H200 this matches the
    measured peaks of the single-device step to 10% (plan-validation-2026-12-02.md)."""
    count, cols = plan.count, plan.shape[1]
    n = plan.owned[s]
    owner = n * (4 * K * cols + 2 * min(K, cols) ** 2) * e
    if plan.kind == "local":
        return owner
    if plan.kind == "replicated":
        return math.ceil(count / plan.members) * plan.members * K * cols * e + owner
    return 2 * count * ks[s] * plan.held[s][1] * e + owner


def collective_seconds(plan: BucketPlan, links: dict, net: Network) -> dict:
    """{kind: seconds} of a bucket's collectives: latency + the slowest member's busiest link."""
    spans = len({r // net.node_size for r in plan.ranks}) > 1
    latency = net.fabric_latency if spans else net.latency
    out = {}
    for kind, table in links.items():
        ring = kind in ("norms", "scores") or plan.kind == "replicated"
        worst = 0.0
        for sent, received, sent_in, received_in in table:
            if ring:
                seconds = max(sent, received) / (net.fabric if spans else net.nvlink)
            else:
                inside = max(sent_in, received_in) / net.nvlink
                outside = max(sent - sent_in, received - received_in) / net.fabric
                seconds = max(inside, outside)
            worst = max(worst, seconds)
        # forward and back of the row exchanges are two collectives each
        out[kind] = worst + latency * (2 if kind in ("rows", "variance") and not ring else 1)
    return out
