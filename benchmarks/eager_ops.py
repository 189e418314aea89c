"""Operations dispatched per eager optimizer.step() on the `dion3 compare --preset gpu-small`
model (the eager small-matrix target: Dion3's eager step no slower than NorMuon's at
gpu-small shapes), counted on the CPU.

At gpu-small's size (512-wide matrices) an eager step is bound by host time per dispatched op,
so the number of ops per step is what sets the step time. The model of the preset is built on
the CPU with the compare's optimizer settings (matrix group plus the AdamW groups of head,
embedding and norm gains), fixed random gradients are set, and one step (after --warmup steps)
is recorded with a TorchDispatchMode: every aten op that reaches the dispatcher is counted.

Two code paths:

  --path cpu   the CPU path as it runs here (PyTorch reference kernels, float32 Newton–Schulz);
  --path cuda  the path a CUDA device takes, replayed on the CPU: the kernel gate accepts CPU
               tensors, each Triton launch counts one (its body is skipped: the step has no
               data-dependent branch, so shapes alone set the counts; --run-kernels runs it
               under TRITON_INTERPRET=1, set by this script before Triton loads), and
               Newton–Schulz computes in the GPU's dtypes (bf16 standard NS, fp16 Gram NS).
               The guard takes its sync-free branches (no look at device values on the host),
               the AdamW and Lion groups' masks included. At gpu-small's shapes the
               symmetric-product kernel is not used on a GPU either (n < SYMMETRIC_MIN_N), so
               every other op is one the GPU would dispatch.

Columns: dispatched (every aten op, views included: each costs host time), launching (ops that
start device work: not views, not allocations), triton (kernel launches), syncs (ops that wait
for the device: must stay 0 for CUDA-graph capture), and launching + triton per step.
--host-ms also times the step of the path counted on tiny matrices (the same buckets and
parameter count, 8-wide matrices), where host time is all there is: on the cuda path that is
everything but the Triton launches themselves (their bodies are skipped; on a GPU each launch
through Triton's JIT costs several times an aten op's host time, see results/kernels-h200-*).

    PYTHONPATH=src python3 benchmarks/eager_ops.py --path cpu --host-ms
    PYTHONPATH=src python3 benchmarks/eager_ops.py --path cuda --host-ms   # one path per process
    PYTHONPATH=src python3 benchmarks/eager_ops.py --path cuda --ops dion3-1/4   # the ops, by name
    PYTHONPATH=src python3 benchmarks/eager_ops.py --path cuda --run-kernels --tiny   # Dion3 too (its rows are read)
"""
from __future__ import annotations

import argparse
import collections
import importlib
import pkgutil
import os
import statistics
import sys
import time

if "--path" in sys.argv and "cuda" in sys.argv:  # the interpreter must be chosen before Triton loads
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OPTIMIZERS = ("muon", "normuon", "dion3-1/4")
# Ops that start no device work (allocations, host-side queries), and ops that wait for the device.
HOST_ONLY = {"empty.memory_format", "empty_strided.default", "empty_like.default", "detach.default",
             "alias.default", "lift_fresh.default", "_unsafe_view.default", "promote_types.default", "result_type.Tensor",
             "_record_function_enter_new.default", "_record_function_exit._RecordFunction"}
SYNCING = {"_local_scalar_dense.default", "item.default", "nonzero.default", "_assert_async.msg"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name; `paused` stops counting (inside an interpreted Triton launch)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launching = 0
        self.syncs = 0
        self.triton: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = f"{func._schema.name.split('::')[-1]}.{func._overloadname}"
            self.ops[name] += 1
            if name in SYNCING:
                self.syncs += 1
            if not func.is_view and name not in HOST_ONLY:
                self.launching += 1
        return func(*args, **(kwargs or {}))


class CountedKernel:
    """A Triton JIT function whose launches count one each (their interpreted body is not counted)."""

    def __init__(self, kernel, name: str, counter_ref: list, execute: bool):
        self.kernel, self.name, self.counter_ref, self.execute = kernel, name, counter_ref, execute

    def __call__(self, *args, **kwargs):  # a helper called inside another kernel
        return self.kernel(*args, **kwargs)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            counter = self.counter_ref[0]
            if counter is not None:
                counter.triton[self.name] += 1
            if not self.execute:  # the step has no data-dependent branch: shapes decide the counts
                return None
            if counter is not None:
                counter.paused += 1
            try:
                return launch(*args, **kwargs)
            finally:
                if counter is not None:
                    counter.paused -= 1
        return run


def emulate_cuda_path(counter_ref: list, execute: bool) -> None:
    """Make the CPU take the branches a CUDA device takes (see the module docstring)."""
    from triton.runtime.jit import KernelInterface  # jit functions, compiled or interpreted

    from dion3 import kernels, rules
    newton_schulz = importlib.import_module("dion3.ortho.newton_schulz")  # the package exports a function of that name
    kernels._triton_ready = lambda device: kernels.kernels_enabled() and kernels._symmetric_kernel is not None
    # sm90: the symmetric kernel is allowed, and declines the n < SYMMETRIC_MIN_N products itself
    kernels._half_dot_ready = kernels._triton_ready
    gpu_dtype = newton_schulz.default_compute_dtype

    def compute_dtype(device, *args, **kwargs):  # the GPU's dtype (older trees take fewer arguments)
        return gpu_dtype(torch.device("cuda"), *args, **kwargs)

    newton_schulz.default_compute_dtype = compute_dtype
    rules.default_compute_dtype = compute_dtype
    # a GPU never reads device values on the host: the guard's sync-free branches, as on a GPU
    # (trees from before the host-checked CPU path have no such switch)
    reference = importlib.import_module("dion3.kernels.reference")
    if hasattr(reference, "HOST_CHECKS"):
        reference.HOST_CHECKS = False
    for info in pkgutil.iter_modules(kernels.__path__):  # every Triton kernel of dion3.kernels
        module = importlib.import_module(f"dion3.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, KernelInterface):
                setattr(module, name, CountedKernel(value, name.strip("_"), counter_ref, execute))


def build(name: str, tiny: bool):
    """The gpu-small model's optimizer (as `dion3 compare` builds it) with fixed random grads."""
    import dataclasses

    from dion3.tools.train.compare import PRESETS, run_spec
    from dion3.tools.train.model import GPT, padded_vocab
    from dion3.tools.train.trainer import build_optimizer

    preset = PRESETS["gpu-small"]
    config = dataclasses.replace(preset.model, vocab_size=padded_vocab(256))
    if tiny:  # same parameters and buckets, 8×8 (and 32×8 MLP) matrices
        config = dataclasses.replace(config, d_model=8, n_head=2, seq_len=8, vocab_size=16)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = build_optimizer(model, run_spec(name, preset, {}, {}))
    generator = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).mul_(0.01)
    return model, optimizer


def count(name: str, warmup: int, counter_ref: list, tiny: bool = False) -> OpCounter:
    _, optimizer = build(name, tiny=tiny)
    for _ in range(warmup):
        optimizer.step()
    return count_step(optimizer, counter_ref)


def count_step(optimizer, counter_ref: list) -> OpCounter:
    """The operations and launches of one optimizer step (counter_ref[0] is the counter while
    it runs, for hooks that report into it)."""
    counter = OpCounter()
    counter_ref[0] = counter
    try:
        with counter:
            optimizer.step()
    finally:
        counter_ref[0] = None
    return counter


def host_ms(names: list, steps: int, repeats: int) -> dict:
    """Per optimizer, the smallest over `repeats` interleaved runs of the median step time on
    tiny matrices (the quietest run: the machine may be shared)."""
    medians = {name: [] for name in names}
    optimizers = {name: build(name, tiny=True)[1] for name in names}
    for optimizer in optimizers.values():
        for _ in range(5):
            optimizer.step()
    for _ in range(repeats):
        for name, optimizer in optimizers.items():
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                optimizer.step()
                times.append((time.perf_counter() - start) * 1e3)
            medians[name].append(statistics.median(times))
    return {name: min(values) for name, values in medians.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="append", choices=("cpu", "cuda"),
                        help="code path(s) to count (repeatable; default cpu)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma list of `dion3 compare` names")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the counted one (default 1)")
    parser.add_argument("--ops", metavar="NAME", help="also list this optimizer's ops by name")
    parser.add_argument("--run-kernels", action="store_true",
                        help="cuda path: run the Triton kernels in the interpreter (slow: minutes) instead of only counting them")
    parser.add_argument("--host-ms", action="store_true",
                        help="also time the step of the path counted on tiny matrices (quietest of --repeats medians of --steps)")
    parser.add_argument("--tiny", action="store_true",
                        help="count on the tiny model of --host-ms (same buckets and parameters): with --run-kernels "
                             "the interpreted kernels then take seconds, not minutes")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    paths = args.path or ["cpu"]
    if "cuda" in paths and paths != ["cuda"]:
        parser.error("count the cuda path in its own run (its patches would leak into the cpu counts)")
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    torch.set_num_threads(1)
    counter_ref: list = [None]
    if paths == ["cuda"]:
        emulate_cuda_path(counter_ref, args.run_kernels)
    print(f"torch {torch.__version__}; command: python3 benchmarks/eager_ops.py {' '.join(argv or sys.argv[1:])}")
    print()
    print("| path | optimizer | dispatched | launching | triton | syncs | launching + triton |")
    print("|---|---|---|---|---|---|---|")
    listed = {}
    for path in paths:
        for name in names:
            c = count(name, args.warmup, counter_ref, args.tiny)
            triton = sum(c.triton.values())
            print(f"| {path} | {name} | {sum(c.ops.values())} | {c.launching} | {triton} | {c.syncs} | {c.launching + triton} |")
            if name == args.ops:
                listed[path] = c
    for path, c in listed.items():
        print(f"\nops of {args.ops}, {path} path:")
        for op, n in sorted(c.ops.items(), key=lambda item: -item[1]):
            print(f"  {n:5d}  {op}")
        for kernel, n in c.triton.items():
            print(f"  {n:5d}  triton {kernel}")
    if args.host_ms:
        path = paths[-1]
        print(f"\n| optimizer | host ms per step, tiny matrices, {path} path |\n|---|---|")
        for name, ms in host_ms(names, args.steps, args.repeats).items():
            print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
