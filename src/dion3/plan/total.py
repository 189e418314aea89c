"""One step of one optimizer variant over the whole world: per-rank costs summed over buckets,
the collectives' times, peak memory, the critical path and the imbalance."""
from __future__ import annotations

from dataclasses import dataclass, field

from .buckets import BucketPlan
from .cost import (PIPELINE_BUDGET, PIPELINE_DEPTH, PIPELINE_MEMORY_SHARE, Hardware, Network, RankCost, Variant,
                   bucket_costs, collective_seconds)


@dataclass
class StepPlan:
    variant: Variant
    ranks: dict[int, RankCost]  # global rank → its costs (the ranks of the planned groups)
    collectives: dict[str, float] = field(default_factory=dict)  # kind → seconds, summed over buckets
    scalar_bytes: float = 0.0  # AdamW parameters, gradients and state per rank
    overhead_s: float = 0.0  # fixed time of the distributed buckets (Hardware.bucket_overhead each)

    @property
    def communication_s(self) -> float:
        return sum(self.collectives.values())

    def worst(self, key) -> float:
        return max((key(c) for c in self.ranks.values()), default=0.0)

    def mean(self, key) -> float:
        return sum(key(c) for c in self.ranks.values()) / max(len(self.ranks), 1)

    def imbalance(self, key=lambda c: c.compute_s) -> float:
        mean = self.mean(key)
        return self.worst(key) / mean if mean > 0 else 1.0

    def critical_path_s(self, overlap: bool) -> float:
        memory = self.worst(lambda c: c.memory_s)
        compute = self.worst(lambda c: c.compute_s)
        comm = self.communication_s
        return memory + (max(compute, comm) if overlap else compute + comm) + self.overhead_s

    def memory_per_rank(self, c: RankCost) -> float:
        return c.params + c.grads + c.state + c.transient + self.scalar_bytes


def plan_step(plans: list[BucketPlan], variant: Variant, hw: Hardware, net: Network,
              scalar_bytes: float = 0.0, wire_bytes=None) -> StepPlan:
    ranks: dict[int, RankCost] = {}
    collectives: dict[str, float] = {}
    transients: dict[int, list[tuple[float, float]]] = {}  # rank → per bucket (admission size, transient)
    for plan in plans:
        costs, links = bucket_costs(plan, variant, hw, net.node_size, wire_bytes)
        for kind, seconds in collective_seconds(plan, links, net).items():
            collectives[kind] = collectives.get(kind, 0.0) + seconds
        for member, cost in enumerate(costs):
            total = ranks.setdefault(plan.ranks[member], RankCost())
            _add(total, cost)
            transients.setdefault(plan.ranks[member], []).append((cost.state, cost.transient))
    pipelined = any(plan.kind != "local" for plan in plans)  # one device steps bucket after bucket
    for rank, entries in transients.items():
        ranks[rank].transient = (peak_in_flight(entries, hw.capacity) if pipelined
                                 else max(t for _, t in entries))
    distributed = sum(1 for plan in plans if plan.kind != "local")
    return StepPlan(variant, ranks, collectives, scalar_bytes, distributed * hw.bucket_overhead)


def _add(total: RankCost, part: RankCost) -> None:
    total.owned += part.owned
    total.dense_flops += part.dense_flops
    total.executed_flops += part.executed_flops
    total.compute_s += part.compute_s
    total.memory_bytes += part.memory_bytes
    total.memory_s += part.memory_s
    total.params += part.params
    total.grads += part.grads
    total.state += part.state
    for mine, theirs in ((total.sent, part.sent), (total.received, part.received)):
        for kind, nbytes in theirs.items():
            mine[kind] = mine.get(kind, 0.0) + nbytes


def peak_in_flight(entries: list[tuple[float, float]], capacity: float) -> float:
    """The most transient bytes of buckets in flight together: the step admits buckets in order
    while fewer than PIPELINE_DEPTH are active and their admission sizes (local state bytes)
    stay within max(PIPELINE_BUDGET × the largest, PIPELINE_MEMORY_SHARE × device memory)."""
    if not entries:
        return 0.0
    budget = max(PIPELINE_BUDGET * max(size for size, _ in entries), PIPELINE_MEMORY_SHARE * capacity)
    peak = 0.0
    for start in range(len(entries)):
        size = transient = 0.0
        for admitted, (s, t) in enumerate(entries[start : start + PIPELINE_DEPTH]):
            if admitted and size + s > budget:
                break
            size, transient = size + s, transient + t
        peak = max(peak, transient)
    return peak
