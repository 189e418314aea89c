"""Kernel launches of the distributed (FSDP2) step, stage by stage, counted on the CPU.

    PYTHONPATH=src python3 -m torch.distributed.run --nproc_per_node=2 benchmarks/distributed_ops.py

The step of a sharded bucket is a generator that yields after each collective it launches
(dion3.distributed.sharded); the pipeline interleaves the buckets' stages. This script runs
that step on 2 gloo ranks with the CUDA branches replayed on the CPU (benchmarks/eager_ops.py:
the kernel gate accepts CPU tensors, Triton kernels run in the interpreter and count one launch
each, Newton–Schulz computes in the GPU's dtypes) and counts, per bucket and stage, the aten ops
dispatched and the launches (ops that start device work, Triton kernels and collectives),
and where the host syncs (Tensor.tolist). `dion3 plan` prices the host time of a step from
these counts (dion3.tools.plan.pricing.STAGE_LAUNCHES).

--shapes sets the matrices (one bucket per shape); the default is one bucket of 8 matrices of
16×16, whose stage counts do not depend on the matrices' size on the CPU path (the GPU's
Newton–Schulz may choose another method at other shapes: compare with the kernels per step
that benchmarks/step_host_time.py counts on a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before Triton loads

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eager_ops  # noqa: E402

from dion3 import Dion3, Muon, NorMuon  # noqa: E402
from dion3.tools.bench.presets import parse_shapes  # noqa: E402
from dion3.distributed import step as distributed_step  # noqa: E402

VARIANTS = {
    "muon": (Muon, {}),
    "normuon": (NorMuon, {}),
    "dion3 local": (Dion3, {"fraction": 0.25, "selection_scope": "local"}),
    "dion3 global": (Dion3, {"fraction": 0.25, "selection_scope": "global"}),
}


class StageLog:
    """Counts of the current OpCounter at each stage boundary and host sync."""

    def __init__(self, counter_ref: list):
        self.counter_ref = counter_ref
        self.events: list = []

    def now(self) -> tuple[int, int]:
        c = self.counter_ref[0]
        if c is None:
            return 0, 0
        return sum(c.ops.values()), c.launching + sum(c.triton.values())

    def wrap(self, index: int, body):
        stage = 0
        while True:
            before = self.now()
            try:
                next(body)
            except StopIteration:
                self._close(index, stage, before)
                return
            self._close(index, stage, before)
            stage += 1
            yield

    def _close(self, index: int, stage: int, before) -> None:
        if self.counter_ref[0] is not None:
            ops, launches = self.now()
            self.events.append(dict(bucket=index, stage=stage, ops=ops - before[0], launches=launches - before[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16x16:8")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="write the counts here (rank 0)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counter_ref: list = [None]
    eager_ops.emulate_cuda_path(counter_ref, execute=True)
    log = StageLog(counter_ref)
    interleave = distributed_step.interleave
    distributed_step.interleave = lambda steps, *rest: interleave(
        [log.wrap(i, s) for i, s in enumerate(steps)], *rest)
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if counter_ref[0] is not None:
            ops, launches = log.now()
            log.events.append(dict(sync=True, ops_before=ops, launches_before=launches))
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    mesh = init_device_mesh("cpu", (world,))
    shapes = [(m.rows, m.cols) for m in parse_shapes(args.shapes).matrices for _ in range(m.count)]
    out = {}
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        gen = torch.Generator().manual_seed(0)
        module = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes)
        fully_shard(module, mesh=mesh)
        params = list(module.parameters())
        for p in params:
            p.grad = DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements,
                                        run_check=False, shape=p.shape, stride=p.stride())
        cls, options = VARIANTS[name]
        optimizer = cls(params, distributed_mesh=mesh, lr=0.01, weight_decay=0.01, **options)
        optimizer.step()
        optimizer.step()
        log.events.clear()
        counter = eager_ops.count_step(optimizer, counter_ref)
        out[name] = dict(ops=sum(counter.ops.values()), launches=counter.launching + sum(counter.triton.values()),
                         syncs=sum(1 for e in log.events if e.get("sync")), events=list(log.events))
        if rank == 0:
            stages = [(e["ops"], e["launches"]) for e in log.events if not e.get("sync")]
            syncs = [e["launches_before"] for e in log.events if e.get("sync")]
            print(f"{name:13s} ops {out[name]['ops']:4d}  launches {out[name]['launches']:4d}  "
                  f"per stage (ops, launches) {stages}  host syncs after launch {syncs}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shapes=args.shapes, world_size=world, torch=torch.__version__, variants=out), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
