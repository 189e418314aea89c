"""One step of one optimizer variant over the whole world: per-rank costs summed over buckets,
the collectives' times, peak memory, the critical path and the imbalance."""
from __future__ import annotations

from dataclasses import dataclass, field

from .buckets import BucketPlan
from .pricing import (PIPELINE_BUDGET, PIPELINE_DEPTH, PIPELINE_MEMORY_SHARE, Hardware, Network, RankCost, Stage,
                   Variant, bucket_costs, bucket_stages, collective_seconds, selection)


@dataclass
class StepPlan:
    variant: Variant
    ranks: dict[int, RankCost]  # global rank → its costs (the ranks of the planned groups)
    collectives: dict[str, float] = field(default_factory=dict)  # kind → seconds, summed over buckets
    scalar_bytes: float = 0.0  # AdamW parameters, gradients and state per rank
    overhead_s: float = 0.0  # fixed time of the distributed buckets (Hardware.bucket_overhead each)
    exposed_s: float = 0.0  # how much the slowest rank's device time + waits for its host exceed the slowest device time
    host_s: float = 0.0  # the most host time of a rank's launches (Hardware.launch_s each)

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
        if overlap:  # collectives proceed while the device computes or waits for the host
            return memory + max(compute + self.exposed_s, comm) + self.overhead_s
        return memory + compute + comm + self.overhead_s + self.exposed_s

    def memory_per_rank(self, c: RankCost) -> float:
        return c.params + c.grads + c.state + c.transient + self.scalar_bytes


def plan_step(plans: list[BucketPlan], variant: Variant, hw: Hardware, net: Network,
              scalar_bytes: float = 0.0, wire_bytes=None, piece_launches: int = 0) -> StepPlan:
    ranks: dict[int, RankCost] = {}
    collectives: dict[str, float] = {}
    transients: dict[int, list[tuple[float, float]]] = {}  # rank → per bucket (admission size, transient)
    stages: dict[int, list[tuple[float, list[Stage]]]] = {}  # rank → per distributed bucket (admission size, stages)
    for plan in plans:
        costs, links = bucket_costs(plan, variant, hw, net.node_size, wire_bytes)
        for kind, seconds in collective_seconds(plan, links, net).items():
            collectives[kind] = collectives.get(kind, 0.0) + seconds
        selected = selection(plan, variant)
        for member, cost in enumerate(costs):
            total = ranks.setdefault(plan.ranks[member], RankCost())
            _add(total, cost)
            transients.setdefault(plan.ranks[member], []).append((cost.state, cost.transient))
            if plan.kind != "local" and hw.launch_s > 0:
                stages.setdefault(plan.ranks[member], []).append(
                    (cost.state, bucket_stages(plan, variant, member, cost, hw, piece_launches, selected)))
    pipelined = any(plan.kind != "local" for plan in plans)  # one device steps bucket after bucket
    for rank, entries in transients.items():
        ranks[rank].transient = (peak_in_flight(entries, hw.capacity) if pipelined
                                 else max(t for _, t in entries))
    distributed = sum(1 for plan in plans if plan.kind != "local")
    # the slowest rank's device time plus its waits, beyond the slowest device time of any rank (a
    # rank that owns nothing waits for its host, but not beyond the owners' compute)
    device = {rank: sum(s.device_s for _, bucket in entries for s in bucket) for rank, entries in stages.items()}
    finish = {rank: device[rank] + exposed_host_s(issue_order(entries, hw.capacity), hw.launch_s)
              for rank, entries in stages.items()}
    exposed = max(max(finish.values(), default=0.0) - max(device.values(), default=0.0), 0.0)
    host = max((sum(s.launches for _, bucket in entries for s in bucket) * hw.launch_s for entries in stages.values()),
               default=0.0)
    return StepPlan(variant, ranks, collectives, scalar_bytes, distributed * hw.bucket_overhead, exposed, host)


def _admits(active_sizes: list[float], size: float, budget: float) -> bool:
    """The pipeline's admission rule (dion3.distributed.interleave.interleave): one bucket always; more
    while fewer than PIPELINE_DEPTH are active and their sizes stay within the budget."""
    return not active_sizes or (len(active_sizes) < PIPELINE_DEPTH and sum(active_sizes) + size <= budget)


def _budget(sizes: list[float], capacity: float) -> float:
    return max(PIPELINE_BUDGET * max(sizes, default=0.0), PIPELINE_MEMORY_SHARE * capacity)


def issue_order(entries: list[tuple[float, list[Stage]]], capacity: float) -> list[Stage]:
    """The stages of a rank's buckets in the order the host issues them: the pipeline advances
    its active buckets round-robin, one stage each, admitting buckets in order (_admits)."""
    budget = _budget([size for size, _ in entries], capacity)
    waiting, active, order = list(range(len(entries))), [], []
    done = [0] * len(entries)
    while waiting or active:
        while waiting and _admits([entries[b][0] for b in active], entries[waiting[0]][0], budget):
            active.append(waiting.pop(0))
        bucket = active.pop(0)
        order.append(entries[bucket][1][done[bucket]])
        done[bucket] += 1
        if done[bucket] < len(entries[bucket][1]):
            active.append(bucket)
    return order


def exposed_host_s(order: list[Stage], launch_s: float) -> float:
    """How long the device waits for the host over stages issued in this order by one host
    (launches × launch_s each) and run in this order by one device. Between host syncs the
    device finishes at max over stages j of (host time before j + device time from j on) and of
    (host time up to j's end + device time after j): each stage's launches are spread over its
    device time, so a stage waits for the host only where the host is still issuing it. A host
    sync (Stage.sync) starts afresh once the device has finished everything issued before it.
    The result is that finish time minus the device time."""
    total = device_total = 0.0
    segment: list[Stage] = []
    for stage in order + [Stage(0.0, 0.0, True)]:
        if stage.sync and segment:
            device = sum(s.device_s for s in segment)
            host, finish = 0.0, device
            for s in segment:
                finish = max(finish, host + device, host + s.launches * launch_s + device - s.device_s)
                host += s.launches * launch_s
                device -= s.device_s
            total += finish
            device_total += sum(s.device_s for s in segment)
            segment = []
        segment.append(stage)
    return total - device_total


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
    budget = _budget([size for size, _ in entries], capacity)
    peak = 0.0
    for start in range(len(entries)):
        size = transient = 0.0
        for admitted, (s, t) in enumerate(entries[start : start + PIPELINE_DEPTH]):
            if admitted and size + s > budget:
                break
            size, transient = size + s, transient + t
        peak = max(peak, transient)
    return peak
