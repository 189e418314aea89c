"""Spawned-worker side of tests/test_auto_dtype.py: FSDP2 on 4 gloo ranks with the CPU
Newton–Schulz dtype left on auto (no DION3_CPU_NS_DTYPE, no set_cpu_compute_dtype), on matrices
large enough for the rule to pick bf16 on a CPU whose bf16 products are fast (Gram sides of
≥ 96 rows), against one process with the same default. Then the same with the ranks made to
see different CPUs (rank 0 one whose rule says bf16, the others one whose rule says float32):
construction agrees on float32 everywhere. Rank 0 writes what it measured to a JSON file. Not
a test module."""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gloo
from dion3 import Dion3, Muon, NorMuon
from dion3.ortho import precision
from layouts_worker import cut, full, grads_for

SHAPES = [(128, 256), (128, 256), (256, 128)]
CASES = {"muon": (Muon, {}), "normuon": (NorMuon, {}), "dion3-global": (Dion3, dict(fraction=0.5, selection_scope="global"))}
AMD = precision.CpuIdentity("AuthenticAMD", frozenset({"avx512f", "avx512_bf16"}), "x86_64")
INTEL = precision.CpuIdentity("GenuineIntel", frozenset({"avx512f", "avx512_bf16"}), "x86_64")


def run(kind: str) -> dict:
    cls, options = CASES[kind]
    generator = torch.Generator().manual_seed(11)
    weights = [torch.randn(s, generator=generator) for s in SHAPES]
    sharded = torch.nn.ParameterList(torch.nn.Parameter(w.clone()) for w in weights)
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    fully_shard(sharded, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    settings = dict(lr=0.02, weight_decay=0.1, **options)
    opt, ref = cls(list(sharded.parameters()), **settings), cls(plain, **settings)
    for step in range(3):
        for p, q, g in zip(sharded.parameters(), plain, grads_for(SHAPES, step)):
            p.grad, q.grad = cut(g, p), g.clone()
        opt.step()
        ref.step()
    change = [(full(p) - w) for p, w in zip(sharded.parameters(), weights)]
    want = [(q.detach() - w) for q, w in zip(plain, weights)]
    return {"error": max(float((a - b).norm() / b.norm()) for a, b in zip(change, want)),
            "skipped": int(opt.nonfinite_updates)}


def scenarios() -> dict:
    assert precision.ENV_VAR not in os.environ, "the test runs the default: no CPU dtype in the environment"
    out = {"dtype": [None] * dist.get_world_size()}
    dist.all_gather_object(out["dtype"], str(precision.cpu_compute_dtype(128)))
    out["auto"] = {kind: run(kind) for kind in CASES}
    # ranks on different CPUs: the rule disagrees, construction agrees on float32
    precision.cpu_identity = lambda: AMD if dist.get_rank() == 0 else INTEL
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["mixed"] = {kind: run(kind) for kind in ("dion3-global",)}
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (str(precision.cpu_compute_dtype(128)), any("float32" in str(w.message) for w in caught)))
    out["mixed_dtype"] = flags
    return out


def worker(rank: int, world: int, out_path: str) -> None:
    gloo.run_and_report(rank, world, out_path, scenarios)


if __name__ == "__main__":
    sys.exit("a worker module: run tests/test_auto_dtype.py")
