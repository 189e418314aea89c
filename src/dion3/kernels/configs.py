"""Tile configurations for the symmetric-matmul kernel, one small table per GPU generation.

No cold-start autotuning: a launch looks its configuration up here from the device's compute
capability and the output size n. The Hopper (sm90) rows were chosen from a sweep on an H200
(benchmarks/results/kernels-h200-*.md); rows for other generations are conservative defaults
that fit their shared memory but were not tuned on hardware.

Each row reads: for outputs with n ≥ min_n, use this config (the last matching row wins).
  block_m, block_n   output tile (block_n is a multiple of block_m; tiles are computed only
                     where they touch the lower triangle, and mirrored)
  block_k            reduction step
  num_warps          warps per program (8 = two warpgroups on Hopper)
  num_stages         software-pipelining depth of the reduction loop
  descriptors        load operands through TMA tensor descriptors (Hopper+, needs a
                     16-byte-aligned contiguous operand); pointer loads otherwise
  tma_store          with descriptors: store tiles strictly below the diagonal and their
                     mirrors through TMA descriptors of D (unmasked); diagonal tiles and
                     unaligned outputs keep masked pointer stores
  max_registers      cap on registers per thread (Triton's maxnreg), None for the compiler's
                     choice; a low cap can fit two programs on one SM
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    descriptors: bool = False
    tma_store: bool = False
    max_registers: Optional[int] = None

    def __post_init__(self) -> None:
        if self.block_n % self.block_m:
            raise ValueError(f"block_n ({self.block_n}) must be a multiple of block_m ({self.block_m})")


# (min_n, config) rows, ascending in min_n.
# H200 sweep 2026-11-29 (Triton 3.6): 128×128×64, 8 warps, 3 stages, TMA loads was best or
# within 3% of best at every n ≥ 1024 (128×256 tiles lost 5–30%); 64×64 only helps at n ≤ 256.
# kernel-perf sweep (benchmarks/sweep_symmetric.py): TMA stores of the off-diagonal tiles make it
# 1.07–1.23× faster at every measured shape; 128×256 with TMA stores gains another 3–6% on
# large C-free products but loses 13% at 1×4096×16384 and on R·R + C, persistent launches
# lost or tied (commit 3f8ebe1; kernels-h200-2026-11-29.md).
# Commit 04783f0: a cap of 128 registers per thread (two 8-warp programs per SM) made whole
# steps 3–4% faster in alternating A/B runs (Llama-8B Dion3 f=¼ 171.1–172.4 → 165.3–168.0 ms,
# Llama-1B 18.5 → 17.7 ms, Muon + Gram 633 → 624–632 ms; step-h200-2026-12-01.md, "Findings"),
# although single products move by −8% … +2% (kernels-h200-2026-11-29.md, "Findings").
REGISTER_CAP = 128
HOPPER = (
    (0, TileConfig(64, 64, 64, num_warps=4, num_stages=4, max_registers=REGISTER_CAP)),
    (512, TileConfig(128, 128, 64, num_warps=8, num_stages=3, descriptors=True, tma_store=True,
                     max_registers=REGISTER_CAP)),
)
# C-free products with a long reduction (k ≥ LONG_REDUCTION·n, e.g. X·Xᵀ of a wide X in Gram
# NS): a 4th pipeline stage. Two H200 sweeps (commit 77ed8ec, kernels-h200-2026-11-29.md): 4096×16384
# 1.78–1.84× vs 1.61–1.70× with 3 stages, 32×4096×14336 1.63–1.64× vs 1.44–1.46×, 32×1024×14336
# 1.56–1.63× vs 1.45–1.48×; with a C term 4 stages lose up to 25%, at k ≈ n about 3%.
LONG_REDUCTION = 3.5
HOPPER_LONG_REDUCTION = TileConfig(128, 128, 64, num_warps=8, num_stages=4, descriptors=True, tma_store=True,
                                   max_registers=REGISTER_CAP)
AMPERE = (
    (0, TileConfig(64, 64, 32, num_warps=4, num_stages=3)),
    (512, TileConfig(128, 128, 32, num_warps=4, num_stages=3)),
)
# Used for interpreter runs and unknown devices: small tiles, nothing generation-specific.
PORTABLE = ((0, TileConfig(32, 32, 32, num_warps=4, num_stages=2)),)

TABLES = {9: HOPPER, 10: HOPPER, 8: AMPERE}


def table_for(capability_major: int | None):
    """The config table for a compute-capability major version (None: portable)."""
    if capability_major is None:
        return PORTABLE
    return TABLES.get(capability_major, AMPERE if capability_major > 8 else PORTABLE)


def uses_long_reduction_config(n: int, k: int, has_c: bool, capability_major: int | None) -> bool:
    """Whether an n×n product over k (without a C term) gets the long-reduction config: only
    on the generation it was measured on (Hopper rows)."""
    return capability_major in (9, 10) and not has_c and n >= 512 and k >= LONG_REDUCTION * n


def pick_config(n: int, capability_major: int | None, k: int | None = None, has_c: bool = True) -> TileConfig:
    """The tile config for an n×n output (reduction length k, with or without a C term) on a
    device of this generation."""
    if k is not None and uses_long_reduction_config(n, k, has_c, capability_major):
        return HOPPER_LONG_REDUCTION
    chosen = None
    for min_n, config in table_for(capability_major):
        if n >= min_n:
            chosen = config
    return chosen
