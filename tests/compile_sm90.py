"""Compile the Hopper (Gluon) symmetric-matmul kernel for sm_90a on a machine without a GPU.

    PYTHONPATH=src python3 tests/compile_sm90.py [--dump DIR]

Use it before spending GPU time: it builds every specialization the optimizer launches (A·Aᵀ
with K-major B, R·R + C with row-major B, bf16 and fp16, 3- and 4-stage rings, A copied on the way) with the
installed Triton and ptxas,
and prints each kernel's registers, spills and shared memory. Nothing runs: a stand-in driver
reports an sm_90 target and the launches stop after compilation (JITFunction.warmup). Use the
Triton version of the GPU machine (3.6 there) to catch API drift in the experimental Gluon API.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget


class _Sm90Driver:
    """Just enough of triton.runtime.driver's active driver for compile-only warmups."""

    def __init__(self, real):
        self._real = real

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):
        return getattr(self._real, name)


def ptxas_report(ptx: str) -> str:
    """ptxas -v's register/spill lines for the kernel (the loaded-binary counts need a GPU)."""
    import re
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    text = done.stdout + done.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return f"registers {','.join(regs) or '?'} spill stores {','.join(spills) or '?'} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", help="write each kernel's ttgir/ptx here")
    args = parser.parse_args()
    from triton.runtime import driver

    try:
        real = driver.active
    except Exception:  # no GPU driver at all on this machine
        real = None
    driver.set_active(_Sm90Driver(real))

    from dion3.kernels import hopper_tiling, symmetric_matmul_hopper as hopper

    if not hopper.GLUON_AVAILABLE:
        print(f"Triton {triton.__version__} has no usable Gluon Hopper API")
        return 1
    hopper.pick_tiling = lambda *args, tiling=None, **kwargs: tiling  # no device to ask
    hopper._sm90_count = lambda index: 132  # an H100/H200
    hopper._launch_or_fall_back = lambda key, launch: launch() or True  # report build errors, no fallback
    failures = 0
    # (label, dtype, product, C term, tiling): every tiling with and without C, both B layouts
    cases = [("AAt bf16", torch.bfloat16, "gram", False, hopper_tiling.WIDE),
             ("RR+C fp16", torch.float16, "square", True, hopper_tiling.WIDE),
             ("AAt fp16 +C", torch.float16, "gram", True, hopper_tiling.WIDE),
             ("RR bf16", torch.bfloat16, "square", False, hopper_tiling.WIDE),
             ("AAt bf16 4st", torch.bfloat16, "gram", False, hopper_tiling.WIDE_LONG),
             ("AAt f16 +C 4st", torch.float16, "gram", True, hopper_tiling.WIDE_LONG),
             ("AAt bf16 copy", torch.bfloat16, "gram", False, hopper_tiling.WIDE),  # A copied on the way (standard NS)
             ("AAt bf16 nar", torch.bfloat16, "gram", False, hopper_tiling.NARROW),
             ("RR+C f16 nar", torch.float16, "square", True, hopper_tiling.NARROW),
             ("AAt copy nar", torch.bfloat16, "gram", False, hopper_tiling.NARROW),
             ("AAt bf16 nar6", torch.bfloat16, "gram", False, replace(hopper_tiling.NARROW, stages=6)),
             ("RR+C nar6 ring", torch.float16, "square", True, replace(hopper_tiling.NARROW, stages=6, epilogue_in_ring=True)),
             ("AAt pair", torch.bfloat16, "gram", False, hopper_tiling.Tiling(128, 3, True, 128, 4)),
             ("RR+C pair", torch.float16, "square", True, hopper_tiling.Tiling(128, 3, True, 128, 4))]
    for label, dtype, product, has_c, tiling in cases:
        n, k = 512, 512
        a = torch.zeros(2, n, k, dtype=dtype)
        b = a.mT if product == "gram" else torch.zeros(2, k, n, dtype=dtype)
        c = torch.zeros(2, n, n, dtype=dtype) if has_c else None
        out = torch.zeros(2, n, n, dtype=dtype)
        kernel = hopper._symmetric_matmul_hopper_kernel
        original_getitem = type(kernel).__getitem__
        compiled = {}

        def warm_only(self, grid):
            def launch(*largs, **lkwargs):
                compiled["kernel"] = self.warmup(*largs, grid=grid, **lkwargs)
            return launch

        type(kernel).__getitem__ = warm_only
        try:
            copy = torch.zeros_like(a) if "copy" in label else None
            hopper.symmetric_matmul_hopper(a, b, c, 1.0, 0.5 if has_c else 0.0, out, copy_a=copy, tiling=tiling)
            ck = compiled["kernel"]
            print(f"{label:14s} ok: shared {ck.metadata.shared} B, {ptxas_report(ck.asm['ptx'])}", flush=True)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(args.dump, f"{label.replace(' ', '_')}.{ext}"), "w") as f:
                        f.write(ck.asm[ext])
        except Exception as error:
            failures += 1
            print(f"{label:14s} FAILED: {type(error).__name__}: {error}"[:3000], flush=True)
            if os.environ.get("TRACE"):
                import traceback; traceback.print_exception(error.__cause__ or error)
        finally:
            type(kernel).__getitem__ = original_getitem
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
