"""The dtype standard Newton–Schulz computes in on CPU.

bf16 where this CPU multiplies bf16 matrices clearly faster than float32 (native bf16 dot
products with a fast library path, e.g. AMX), float32 everywhere else. The check runs once per
process, on the first CPU orthogonalization that needs it: a CPU whose vector unit has no bf16
arithmetic (x86 below AVX-512) gets float32 at once; others time a small batched bf16 and float32
product and take bf16 only when it is at least BF16_MIN_SPEEDUP times faster. (AVX-512 BF16
alone is not enough: its dot product does as many flops per cycle as float32 FMAs, and on such a
2-core Xeon with torch 2.13 a bf16 256×256 product runs at half the float32 speed.)

Where standard NS runs in bf16, the "auto" method choice weighs that: cpu_standard_speedup gives
ortho.choose_method how much faster standard NS multiplies than Gram NS's float32.

Gram NS stays float32 on CPU whatever this says: in bf16 its Gram-matrix recursion loses more
than restarts recover (relative error 0.08–0.8 against 0.01–0.06 in fp16, on 1e-2…1e-6 spectra),
and fp16 products on CPU are no faster than float32.

Explicit choices win over the check: set_cpu_compute_dtype(torch.float32) in the program, else
DION3_CPU_NS_DTYPE=float32 (or bfloat16, or auto) in the environment; orthogonalize(..., dtype=)
overrides both for one call.
"""
from __future__ import annotations

import functools
import os
import platform
import time
from typing import Optional, Union

import torch

ENV_VAR = "DION3_CPU_NS_DTYPE"
# Standard NS in bf16 against Gram NS in float32 on a 2-core AMD EPYC with AVX-512 BF16, torch
# 2.13 (benchmarks/results/cpu-step-epyc-avx512bf16-2026-12-01.md): 1.1–1.7× faster for batches of
# n ≥ 96 rows at m/n ≤ 16, 0.94× at 256×8192, so products in bf16 count as 2.2 times faster there
# (with it choose_method keeps Gram NS above m/n ≈ 21.6); below 96 rows bf16 products gain nothing
# (8×64×512: Gram 0.90× of standard's time; 8×16×256: 0.33×).
BF16_NOMINAL_SPEEDUP = 2.2
BF16_MIN_ROWS = 96
BF16_MIN_SPEEDUP = 1.3  # bf16 costs accuracy: take it only for a clear gain
_NAMES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_CHOICES = (None, torch.float32, torch.bfloat16)
_override: Optional[torch.dtype] = None


def _parse(value: Union[str, torch.dtype, None], what: str) -> Optional[torch.dtype]:
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in _NAMES:
            raise ValueError(f"{what}: unknown CPU Newton–Schulz dtype {value!r}; expected one of {sorted(_NAMES)}")
        return _NAMES[key]
    if value not in _CHOICES:
        raise ValueError(f"{what}: the CPU Newton–Schulz dtype must be torch.float32, torch.bfloat16 or None (auto), got {value!r}")
    return value


def set_cpu_compute_dtype(dtype: Union[str, torch.dtype, None]) -> None:
    """Fix the dtype of standard Newton–Schulz on CPU for this process: torch.float32,
    torch.bfloat16, or None / "auto" for the measured choice (the environment variable
    DION3_CPU_NS_DTYPE applies again). Float64 inputs and Gram NS are not affected."""
    global _override
    _override = _parse(dtype, "set_cpu_compute_dtype(dtype)")


def cpu_compute_dtype() -> torch.dtype:
    """The dtype standard Newton–Schulz runs in on CPU for float32 (or narrower) inputs:
    set_cpu_compute_dtype's value, else DION3_CPU_NS_DTYPE's, else bf16 if native_bf16_matmul()."""
    if _override is not None:
        return _override
    chosen = _parse(os.environ.get(ENV_VAR, "auto"), f"environment variable {ENV_VAR}")
    if chosen is not None:
        return chosen
    return torch.bfloat16 if native_bf16_matmul() else torch.float32


def cpu_standard_speedup(rows: int) -> float:
    """How much faster standard NS multiplies n×n and n×m blocks (n = rows) than Gram NS on
    this CPU: BF16_NOMINAL_SPEEDUP where standard NS runs in bf16 on a CPU whose bf16 products
    measured fast and n ≥ BF16_MIN_ROWS, else 1 (both float32, or bf16 forced where it is not
    faster). A fixed figure rather than the measured ratio: the method must not flip between
    runs with the timing noise of a shared machine."""
    if rows < BF16_MIN_ROWS or cpu_compute_dtype() != torch.bfloat16 or not native_bf16_matmul():
        return 1.0
    return BF16_NOMINAL_SPEEDUP


def _may_have_bf16_arithmetic(capability: str, machine: str) -> bool:
    """False where the vector unit torch uses has no bf16 arithmetic at all (x86 below
    AVX-512); elsewhere only a measurement can tell."""
    x86 = machine.lower() in ("x86_64", "amd64", "i386", "i686", "x86")
    return capability == "AVX512" if x86 else True


def bf16_speedup(size: int = 256, batch: int = 2, repeats: int = 3) -> float:
    """float32 time / bf16 time of a [batch, size, size] batched product (best of `repeats`,
    the two dtypes interleaved so that a busy neighbour slows both alike)."""
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    operands = {dtype: torch.randn(2, batch, size, size).to(dtype) for dtype in best}
    for _ in range(repeats + 1):  # the first pass warms up (library dispatch, allocations)
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            torch.bmm(a, b)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


@functools.lru_cache(maxsize=None)
def native_bf16_matmul() -> bool:
    """Whether this CPU runs bf16 matrix products clearly faster than float32 (decided once
    per process; native_bf16_matmul.cache_clear() decides again)."""
    if not _may_have_bf16_arithmetic(torch.backends.cpu.get_cpu_capability(), platform.machine()):
        return False
    return bf16_speedup() >= BF16_MIN_SPEEDUP
