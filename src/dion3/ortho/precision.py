"""The dtype standard Newton–Schulz computes in on CPU.

bf16 where this CPU's identity says its bf16 matrix products are clearly faster than float32,
float32 everywhere else. The identity is the CPU's vendor and flags (read once from
/proc/cpuinfo, with torch's own capability query) and the machine type, never a timing: every
process on the same hardware decides alike, so the ranks of a run agree by construction (and a
distributed optimizer on CPU checks once, at construction, that they do:
agree_across_ranks). The rule follows the measurements recorded in benchmarks/results/:

  - AMD x86 with AVX-512 BF16 (Zen 4 and later): bf16 products 2.2–2.4× faster than float32
    (2-core EPYC, torch 2.13: 8×256×1024 A·Aᵀ 6.84 ms float32, 2.82 ms bf16;
    cpu-2026-12-01.md) → bf16;
  - x86 with AMX (Intel Sapphire Rapids and later): bf16 products 3.0–6.3× faster than float32
    from 96 rows up (2-core Xeon, torch 2.13: 8×256×1024 A·Aᵀ 4.01 ms float32, 0.64 ms bf16;
    cpu-2026-12-01.md, AMX part) → bf16;
  - Intel x86 with AVX-512 BF16 but no AMX: the dot product does as many flops per cycle as
    float32 FMAs, and on a 2-core Xeon with torch 2.13 a bf16 256×256 product ran at half the
    float32 speed → float32;
  - x86 without AVX-512 BF16 (AVX2-only EPYC and Xeon, cpu-2026-12-01.md) → float32;
  - other architectures: not measured here → float32 (set bf16 explicitly where it pays).

Where standard NS runs in bf16, the "auto" method choice weighs that: cpu_standard_speedup gives
ortho.choose_method how much faster standard NS multiplies than Gram NS's float32.

Gram NS stays float32 on CPU whatever this says: in bf16 its Gram-matrix recursion loses more
than restarts recover (relative error 0.08–0.8 against 0.01–0.06 in fp16, on 1e-2…1e-6 spectra),
and fp16 products on CPU are no faster than float32.

Explicit choices win over the rule: set_cpu_compute_dtype(torch.float32) in the program, else
DION3_CPU_NS_DTYPE=float32 (or bfloat16, or auto) in the environment; orthogonalize(..., dtype=)
overrides both for one call.
"""
from __future__ import annotations

import functools
import os
import platform
from typing import NamedTuple, Optional, Union

import torch

ENV_VAR = "DION3_CPU_NS_DTYPE"
# How much faster bf16 products count as than float32 where the rule picks bf16: the figure
# choose_method weighs standard NS (bf16) against Gram NS (float32) with, fixed per kind of CPU
# from the measurements (never a timing taken at run time). AMD EPYC with AVX-512 BF16, torch 2.13
# (cpu-2026-12-01.md): standard NS in bf16 1.1–1.7× faster than Gram NS at n ≥ 96, m/n ≤ 16, 0.94×
# at 256×8192, so 2.2 (choose_method then keeps Gram NS above m/n ≈ 21.6). Xeon with AMX
# (cpu-2026-12-01.md, AMX part): bf16 products 3.0–6.3× float32 at n ≥ 96 and standard NS in bf16
# 1.5–3.1× faster than Gram NS up to m/n = 32, so 3.0 (above 2.5 standard NS wins at every
# aspect ratio). Below 96 rows bf16 products gain little on either (8×64×256 standard NS in bf16
# 1.25× Gram NS's time on both kinds; 8×16×256: 2.5–3×).
BF16_NOMINAL_SPEEDUP = 2.2
AMX_BF16_NOMINAL_SPEEDUP = 3.0
BF16_MIN_ROWS = 96
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
    torch.bfloat16, or None / "auto" for the rule from the CPU's identity (the environment variable
    DION3_CPU_NS_DTYPE applies again). Float64 inputs and Gram NS are not affected."""
    global _override
    _override = _parse(dtype, "set_cpu_compute_dtype(dtype)")


def cpu_compute_dtype(rows: Optional[int] = None) -> torch.dtype:
    """The dtype standard Newton–Schulz runs in on CPU for float32 (or narrower) inputs whose
    Gram side (the shorter side) has `rows` rows: set_cpu_compute_dtype's value, else
    DION3_CPU_NS_DTYPE's, else bf16 if native_bf16_matmul() and rows ≥ BF16_MIN_ROWS (smaller
    products gain nothing from bf16; None: the choice for large products)."""
    if _override is not None:
        return _override
    chosen = _parse(os.environ.get(ENV_VAR, "auto"), f"environment variable {ENV_VAR}")
    if chosen is not None:
        return chosen
    large = rows is None or rows >= BF16_MIN_ROWS
    return torch.bfloat16 if large and native_bf16_matmul() else torch.float32


def cpu_standard_speedup(rows: int) -> float:
    """How much faster standard NS multiplies n×n and n×m blocks (n = rows) than Gram NS on
    this CPU: nominal_bf16_speedup where standard NS runs in bf16 on a CPU whose bf16 products
    are fast by its identity and n ≥ BF16_MIN_ROWS, else 1 (both float32, or bf16 forced where it is not
    faster). A fixed figure rather than the measured ratio: the method must not flip between
    runs with the timing noise of a shared machine."""
    if rows < BF16_MIN_ROWS or cpu_compute_dtype() != torch.bfloat16:
        return 1.0
    return nominal_bf16_speedup(cpu_identity())


class CpuIdentity(NamedTuple):
    """What the bf16 rule reads: the vendor string, the feature flags, the machine type."""

    vendor: str
    flags: frozenset
    machine: str


@functools.lru_cache(maxsize=None)
def cpu_identity() -> CpuIdentity:
    """This CPU's identity (read once per process): /proc/cpuinfo's vendor_id and flags where
    there is one (Linux), completed by torch's own query for AVX-512 BF16 and AMX."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if vendor and flags:
                    break
    except OSError:  # not Linux: torch's queries below still see the x86 features
        pass
    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.add("avx512_bf16")
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        flags.add("amx_tile")
    return CpuIdentity(vendor, frozenset(flags), platform.machine().lower())


def nominal_bf16_speedup(identity: CpuIdentity) -> float:
    """bf16 products' speed over float32 on a CPU of this identity, as measured on its kind (the
    module docstring), 1.0 where bf16 was not measured clearly faster."""
    if identity.machine not in ("x86_64", "amd64"):
        return 1.0
    if "amx_bf16" in identity.flags or "amx_tile" in identity.flags:
        return AMX_BF16_NOMINAL_SPEEDUP
    if identity.vendor == "AuthenticAMD" and "avx512_bf16" in identity.flags:
        return BF16_NOMINAL_SPEEDUP
    return 1.0


def bf16_products_faster(identity: CpuIdentity) -> bool:
    """The rule of the module docstring: bf16 only where it was measured clearly faster."""
    return nominal_bf16_speedup(identity) > 1.0


def native_bf16_matmul() -> bool:
    """Whether this CPU runs bf16 matrix products clearly faster than float32, from its
    identity (cpu_identity, bf16_products_faster)."""
    return bf16_products_faster(cpu_identity())


def agree_across_ranks() -> None:
    """Check, with one collective over the default process group, that every rank runs CPU
    Newton–Schulz in the same dtype (collectives would otherwise disagree on sizes). Ranks on
    different hardware whose rule disagreed all fall back to float32 (with a warning); explicit
    choices that differ raise ValueError. Call it on every rank, or on none."""
    import warnings

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = 1.0 if cpu_compute_dtype() == torch.bfloat16 else 0.0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    both = torch.tensor([mine, -mine], device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    lowest, highest = float(both[0]), -float(both[1])
    if lowest == highest:
        return
    if _override is not None or _parse(os.environ.get(ENV_VAR, "auto"), ENV_VAR) is not None:
        raise ValueError(f"the ranks chose different CPU Newton–Schulz dtypes (set_cpu_compute_dtype or {ENV_VAR}); "
                         "set the same one on every rank")
    warnings.warn("the ranks' CPUs differ on whether bf16 products are fast: CPU Newton–Schulz runs in float32 on "
                  "every rank", stacklevel=3)
    set_cpu_compute_dtype(torch.float32)
