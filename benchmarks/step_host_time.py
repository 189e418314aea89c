"""Host time against device time of the distributed (FSDP2) optimizer step, one rank per GPU.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src torchrun --nproc_per_node=1 benchmarks/step_host_time.py --out OUT

Per variant, on fp32 Llama-shaped matrices under fully_shard (as benchmarks/distributed_step.py):
  step_ms     median CUDA-event time of an eager optimizer.step() (after a sync and a barrier)
  host_ms     median host time to issue one step while the GPU is held busy by a sleep kernel
              queued just before it: the host never waits for the device, so this is the step's
              own host cost (every dispatched op, kernel launch, collective call and line of
              Python). Variants that sync the host (global selection: one split-size copy per
              bucket) wait for the sleep there; their host_ms is left out.
  ops         aten ops dispatched in one step (views and allocations included), and those that
              start device work (launching: no views, no allocations)
  kernels     device kernels one step runs (torch.profiler: aten's, Triton's and NCCL's)
  busy_ms     the sum of those kernels' device times (no idle gaps: a lower bound of step_ms)

A step is launch-bound where host_ms reaches step_ms while busy_ms stays below it. The script
imports dion3 from PYTHONPATH, so an older tree of the package can be measured the same way.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dion3 import Dion3, Muon, NorMuon
from dion3.tools.bench.presets import get_preset

VARIANTS = {
    "muon": (Muon, {}),
    "normuon": (NorMuon, {}),
    "dion3-1/2 local": (Dion3, {"fraction": 0.5, "selection_scope": "local"}),
    "dion3-1/4 local": (Dion3, {"fraction": 0.25, "selection_scope": "local"}),
    "dion3-1/4 global": (Dion3, {"fraction": 0.25, "selection_scope": "global"}),
}
HOST_ONLY = {"empty.memory_format", "empty_strided.default", "empty_like.default", "detach.default",
             "alias.default", "lift_fresh.default", "_unsafe_view.default"}
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s at the H200's clock: longer than any step's host time here


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launching = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func._schema.name.split('::')[-1]}.{func._overloadname}"
        self.ops[name] += 1
        if not func.is_view and name not in HOST_ONLY:
            self.launching += 1
        return func(*args, **(kwargs or {}))


def model_params(preset: str, mesh, device):
    shapes = [(m.rows, m.cols) for m in get_preset(preset).matrices for _ in range(m.count)]
    gen = torch.Generator(device=device).manual_seed(0)
    module = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen, device=device) / s[1] ** 0.5)
                                    for s in shapes)
    fully_shard(module, mesh=mesh)
    params = list(module.parameters())
    for p in params:
        p.grad = DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements,
                                    run_check=False, shape=p.shape, stride=p.stride())
    return module, params


def measure(name: str, params, mesh, warmup: int, steps: int) -> dict:
    cls, options = VARIANTS[name]
    opt = cls(params, distributed_mesh=mesh, lr=0.01, weight_decay=0.01, **options)
    for _ in range(1 + warmup):
        opt.step()
    torch.cuda.synchronize()
    step_ms = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        opt.step()
        end.record()
        end.synchronize()
        step_ms.append(begin.elapsed_time(end))
    host_ms = []
    if "global" not in name:
        for _ in range(steps):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda._sleep(SLEEP_CYCLES)
            began = time.perf_counter()
            opt.step()
            host_ms.append((time.perf_counter() - began) * 1e3)
            torch.cuda.synchronize()
    counter = OpCounter()
    torch.cuda.synchronize()
    with counter:
        opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    row = dict(variant=name, step_ms=statistics.median(step_ms), step_ms_all=step_ms,
               host_ms=statistics.median(host_ms) if host_ms else None, host_ms_all=host_ms,
               ops=sum(counter.ops.values()), launching=counter.launching, kernels=len(kernels),
               nccl_kernels=sum("nccl" in e.name.lower() for e in kernels),
               busy_ms=sum(e.device_time_total for e in kernels) / 1e3,
               top_ops=counter.ops.most_common(25))
    del opt
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="write PREFIX.json (rank 0)")
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--label", default="", help="a name for the code measured (e.g. its commit)")
    args = parser.parse_args(argv)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    _, params = model_params(args.preset, mesh, torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        row = measure(name, params, mesh, args.warmup, args.steps)
        rows.append(row)
        if rank == 0:
            host = "—" if row["host_ms"] is None else f"{row['host_ms']:.2f}"
            print(f"{args.label} {args.preset} {name:17s} step {row['step_ms']:8.2f} ms  host {host} ms  "
                  f"busy {row['busy_ms']:8.2f} ms  ops {row['ops']} ({row['launching']} launching)  "
                  f"kernels {row['kernels']}", flush=True)
    if rank == 0:
        report = dict(command=" ".join([os.path.basename(sys.executable), *sys.argv]), label=args.label,
                      preset=args.preset, world_size=dist.get_world_size(), torch=torch.__version__,
                      device_name=torch.cuda.get_device_name(), rows=rows)
        Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
