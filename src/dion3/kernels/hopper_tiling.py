"""Which tiling the Hopper Gluon symmetric GEMM (symmetric_matmul_hopper.py) uses for a product:
the `Tiling` record, the tilings measured on the H200 and the rule that picks one from a
product's size. Pure Python: the rule is unit-tested on CPU against hand-counted waves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .tile_order import lower_tile_count

BLOCK_M = 128
CONSUMER_WARPS = 8  # two warpgroups, 64 rows of the tile each


@dataclass(frozen=True)
class Tiling:
    """One way to launch the kernel.
      block_n            tile width: 256 (128×256 tiles) or 128 (square tiles)
      stages             ring depth (stages of one [128, 64] block of A and one [block_n, 64] of B)
      epilogue_in_ring   the epilogue writes the tile into the drained A ring and its transpose
                         into the B ring (C, if any, can only arrive after the main loop); else the
                         tile has a buffer of its own, into which C's tile arrives during the loop
      registers          registers per thread for the whole kernel (the producer warp gives its
                         surplus to the consumers): (consumer warps + 4) × 32 × registers per
                         program, at most 65536 per SM
      consumer_warps     8 (two warpgroups, 64 rows of the tile each) or 4 (one warpgroup, the
                         whole tile: the sweeps' `pair` tiling, two programs per SM)"""
    block_n: int
    stages: int
    epilogue_in_ring: bool
    registers: int
    consumer_warps: int = CONSUMER_WARPS


# 128×256 tiles, one program per SM: (8 consumer + 4 producer-group warps) × 32 × 168 registers
# ≤ 65536, the consumers get 240 once the producer gives back down to 24. The ring: 4 stages ×
# (16 + 32) KB = 192 KB for long reductions without C (K ≥ RING_EPILOGUE_MIN_K), the epilogue
# then using the drained rings; otherwise 3 stages and a tile of the epilogue's own (224 KB),
# into which C's tile arrives during the main loop. H200 sweeps (kernels-h200-2026-11-29.md,
# commit 5aa30bb): with a late C (the 4-stage layout) 0.9·R·R − 1.7·R at 64×3584 ran at 1.41×
# cuBLAS against 1.79–1.81× with C loaded early; on C-free products 4 stages won at K ≥ 8192 with
# the epilogue before 5aa30bb (8192² 1.84× vs 1.69×) and are within the run-to-run spread
# (±5–10%) of 3 stages with the current one.
WIDE = Tiling(256, 3, False, 168)
WIDE_LONG = Tiling(256, 4, True, 168)
# Side by side with the public Triton kernel (do_bench, 2026-12-01, benchmarks/results/
# kernels-vs-public-h200-2026-12-01.md): at K = 8192 the 3-stage layout ran 8192² in 0.838 ms
# against 0.857 ms for the 4-stage ring and tied at 16×2048×8192; the ring stays for K ≥ 16384.
RING_EPILOGUE_MIN_K = 16384
# 128×128 tiles: twice the tiles of the wide layout, so twice as many waves on small outputs
# (4096²: 528 tiles = 4.0 waves of 132 SMs against 2.06 for 128×256), and diagonal tiles that
# compute nothing past the diagonal's own tile. Two programs per SM do not fit: ptxas needs ≥ 90
# registers per thread for the 64×128 wgmma, and 2 × 12 warps × 32 × 88 > 65536.
NARROW = Tiling(128, 5, False, 168)
TILINGS = {"wide": WIDE, "wide_long": WIDE_LONG, "narrow": NARROW}
# Where each tiling wins (H200 sweeps, kernels-h200-2026-11-29.md, commits 0d0a9f3 to
# 37fc15a): 128×256 tiles on blocks of ≥ 2048 rows with at least 4 waves of them (6 since
# cbf3af6, WIDE_MIN_WAVES below); 128×128 tiles
# where those are too few (4096² at 1.69–1.72× cuBLAS against 1.33–1.39× for 128×256 and the
# Triton kernel's 1.63–1.65×; 4096×16384 1.78–1.83× against 1.48–1.54× and 1.64–1.71×), with 5
# stages (4 to 7 and the epilogue in the rings were within the run-to-run spread); GPU time
# alone (CUDA graphs, benchmarks/launch_overhead.py at commit 0a57700): 4096² 1.70×, R·R + R at
# 32×1024 1.56× against the Triton kernel's 1.30×. Below 1024 rows or with fewer than 4 waves
# of 128×128 tiles the Triton kernel takes the product.
MIN_BLOCK = 2048
NARROW_MIN_BLOCK = 1024
MIN_WAVES = 4
# 128×256 tiles need more waves than 128×128 ones to win: at 2×4096×14336 (4.1 waves of wide
# tiles, 8 of narrow) narrow ran 0.774 ms against 0.853 ms (2026-12-01 side-by-side run); at
# 8 or more waves (8192², 16×2048×8192, 8×3584×4096) wide won or tied. A C-free product whose
# wide tiles all fit in one wave also goes wide: 2048×8192 0.084 ms against 0.099 ms for the
# Triton kernel's long-reduction config (a single wave of 128×128 tiles leaves 4 tiles over).
WIDE_MIN_WAVES = 6
# SHORT_SQUARE_WIDE: blocks of 1024 (below MIN_BLOCK) whose reduction is no longer than the block
# (Newton–Schulz's n×n products) take 128×256 tiles wherever 128×128 ones would run: R·R + R at
# 32×1024 0.092 ms against 0.097 (public Triton kernel 0.090), 64×1024 0.180 against 0.186 (public
# 0.187); A·Aᵀ 64×1024×4096 (K = 4 n) keeps 128×128 tiles, 0.548 against 0.590 (do_bench side by
# side, 2026-12-01, kernels-vs-public-h200-2026-12-01.md, second table).

# Tile widths on which a symmetric right factor (R·R, R·Z in Newton–Schulz) is read as its
# transpose, along K like A: on 128×256 tiles 0.328 vs 0.368 ms at 4×3584 and 0.276 vs 0.299 at
# 16×2048 (R·R + R, level at 8192); on 128×128 tiles level at 32×1024 and 0.123 vs 0.119 at
# 4096, so those keep the row-major read (do_bench side by side, kernels-vs-public-h200-2026-12-01.md).
SYMMETRIC_B_ALONG_K = (256,)


def wide_tiling(k: int, has_c: bool) -> Tiling:
    """128×256 tiles: the 4-stage ring for long C-free reductions, else 3 stages with C early."""
    return WIDE_LONG if k >= RING_EPILOGUE_MIN_K and not has_c else WIDE


def default_tiling(batch: int, panels: int, block: int, k: int, has_c: bool, sms: int) -> Optional[Tiling]:
    """The tiling for a product of this size, None where the Triton kernel is faster."""
    if block % WIDE.block_n == 0 and block >= MIN_BLOCK:
        tiles = batch * panels * lower_tile_count(block, BLOCK_M, WIDE.block_n)
        if tiles >= WIDE_MIN_WAVES * sms or (not has_c and tiles <= sms):
            return wide_tiling(k, has_c)
    if block % NARROW.block_n == 0 and block >= NARROW_MIN_BLOCK:
        if batch * panels * lower_tile_count(block, BLOCK_M, NARROW.block_n) >= MIN_WAVES * sms:
            if block < MIN_BLOCK and block % WIDE.block_n == 0 and k <= block:
                return wide_tiling(k, has_c)  # SHORT_SQUARE_WIDE above
            return NARROW
    return None
