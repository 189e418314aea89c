"""Hopper (sm90) symmetric GEMM in Gluon: warp-specialized, 128×256 output tiles.

Same contract as kernels/symmetric_matmul.py (D = alpha·A·B + beta·C, only tiles touching the
lower triangle computed, each stored with its mirror) for the layouts the optimizer produces on
an H100/H200: contiguous half-precision operands whose sizes are multiples of the tile. The
Triton kernel reaches ~80% of cuBLAS's per-tile rate there; the gap is what warp
specialization and 128×256 tiles are for:

- one producer warp streams A and B blocks through a ring of shared-memory stages with TMA
  (mbarrier "ready"/"empty" pairs), so loads never wait behind the math;
- two consumer warpgroups (the default partition, 8 warps) each run 64×256 wgmma on the tile,
  keeping one MMA in flight and freeing a stage as soon as the MMA that read it retires;
- the epilogue goes through one tile-sized shared buffer: C (if any) comes in by TMA, the tile
  and then its transpose go out by TMA stores. Tiles that cross the diagonal store their lower
  part and its mirror through masked stores instead.

Programs walk the work items (tile × matrix × diagonal block) with a grid stride: one program
per item by default, or a persistent grid (programs_per_sm) in which the producer loads the
next item's stages during the epilogue.

Callers go through `symmetric_matmul_hopper(...)`, which returns False when the operands do not
fit this kernel's requirements (see `hopper_kernel_fits`); the Triton kernel handles those.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache
from typing import Callable, Optional

import torch
from torch import Tensor

from .tile_order import _tile_coordinates, lower_tile_count

# The Gluon API this module is written against: run on GPUs with Triton 3.6, compiled for sm_90a
# with Triton 3.9 (benchmarks/compile_sm90.py). Older releases spell warp_specialize differently.
MIN_TRITON = (3, 6)

try:  # Gluon is experimental; a Triton without it (or without Hopper support) uses the other kernel
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
        raise ImportError(f"Triton {triton.__version__} is older than {MIN_TRITON}")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # The experimental API moves between releases: Triton 3.6 (the GPU machines) names these
    # thread_barrier / async_copy_global_to_shared / async_copy_shared_to_global, 3.9 barrier /
    # async_load / async_store (the old names raise there).
    _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    GLUON_AVAILABLE = True
except Exception:  # pragma: no cover - depends on the installed Triton
    GLUON_AVAILABLE = False

BLOCK_M = 128
BLOCK_N = 256
BLOCK_K = 64
STAGES = 3  # 3 × (16 + 32) KB + a 64 KB epilogue tile = 208 KB of the H200's 227 KB
CONSUMER_WARPS = 8  # two warpgroups, 64 rows of the tile each
PRODUCER_REGISTERS = 24
# Registers per thread for the whole kernel: (8 consumer + 4 producer-group warps) × 32 threads ×
# 168 ≤ 65536. The producer gives back down to 24, the consumers get the rest (240).
KERNEL_REGISTERS = 168
EPILOGUE_ROWS = 32  # rows per masked-store chunk on diagonal tiles
# Where it wins (H200 sweep, kernels-h200-2026-11-29.md "Fifth run"): blocks of ≥ 2048 rows with
# at least 4 waves of tiles. Smaller blocks spend too much on the masked diagonal tiles
# (40% of the tiles at n = 1024) and a few waves (one 4096² output: 2.1) leave SMs idle at
# the tail of this one-tile-per-program launch; the Triton kernel takes those.
MIN_BLOCK = 2048
MIN_WAVES = 4
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


# DION3_HOPPER_KERNEL=0 keeps every product on the Triton kernel (A/B runs, or a Triton whose
# experimental Gluon API misbehaves).
ENABLED = os.environ.get("DION3_HOPPER_KERNEL", "1").strip().lower() not in ("0", "false", "off", "no")


_launched: set = set()  # kernel specializations that built and ran


def _launch_or_fall_back(key, launch: Callable[[], None]) -> bool:
    """Run launch(); return True. If a specialization that never ran fails (the experimental
    Gluon API of an untested Triton release, a ptxas refusal), warn once, switch this kernel off
    for the process and return False: the caller falls back to the Triton kernel. Failures of
    a specialization that already ran are real errors and propagate."""
    global ENABLED
    if key in _launched:
        launch()
        return True
    try:
        launch()
    except Exception as error:
        ENABLED = False
        warnings.warn(f"dion3: the Hopper Gluon symmetric-matmul kernel failed to build or launch "
                      f"({type(error).__name__}: {str(error)[:200]}); using the Triton kernel from now on",
                      RuntimeWarning, stacklevel=3)
        return False
    _launched.add(key)
    return True


@lru_cache(maxsize=None)
def _sm90_count(device_index: int) -> int:
    """Streaming multiprocessors of an sm90 device, 0 for any other device."""
    if torch.cuda.get_device_capability(device_index)[0] != 9:
        return 0
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def hopper_kernel_fits(a3: Tensor, b3: Tensor, c3: Optional[Tensor], out3: Optional[Tensor], block: int,
                       any_size: bool = False) -> bool:
    """Whether this kernel runs the product: an sm90 device, contiguous operands (B either
    K-major like A.mT of a contiguous A, or a contiguous [B, K, n]), a contiguous output and C,
    the block size a multiple of the 256-column tile and K a multiple of 64 (the flattened TMA
    descriptors then never read across matrices), and a product large enough to win
    (MIN_BLOCK, MIN_WAVES; any_size=True skips this last rule, for tests and sweeps).
    out3 None: a freshly allocated output (contiguous, aligned)."""
    if not (ENABLED and GLUON_AVAILABLE) or a3.device.type != "cuda" or a3.dtype not in SUPPORTED_DTYPES:
        return False
    sms = _sm90_count(a3.device.index if a3.device.index is not None else torch.cuda.current_device())
    if not sms:
        return False
    k = a3.shape[2]
    if block % BLOCK_N or k % BLOCK_K or not a3.is_contiguous():
        return False
    if out3 is not None and not out3.is_contiguous():
        return False
    tiles = a3.shape[0] * (a3.shape[1] // block) * lower_tile_count(block, BLOCK_M, BLOCK_N)
    if not any_size and (block < MIN_BLOCK or tiles < MIN_WAVES * sms):
        return False
    if not (b3.is_contiguous() or b3.mT.is_contiguous()):
        return False
    if c3 is not None and not c3.is_contiguous():
        return False
    return all(t.data_ptr() % 16 == 0 for t in (a3, b3, out3, c3) if t is not None)


if GLUON_AVAILABLE:
    _REINTERPRET_IS_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # Triton ≥ 3.7

    @gluon.jit
    def _reinterpret(buffer, desc, ROWS: gl.constexpr, COLS: gl.constexpr):
        """The same shared memory seen as a [ROWS, COLS] buffer in desc's dtype and layout."""
        if _REINTERPRET_IS_PUBLIC:
            return buffer.reinterpret(desc.dtype, [ROWS, COLS], desc.layout)
        else:
            return buffer._reinterpret(desc.dtype, [ROWS, COLS], desc.layout)

    @gluon.jit
    def _work_item(w, tiles, n, panels, RATIO: gl.constexpr, BLOCK_M_: gl.constexpr, BLOCK_N_: gl.constexpr):
        """Work item w → (first row of its matrix's block in the flattened operands/D, first
        row/column of the block in D, tile row, tile column, matrix index). Items run tile-major
        within a matrix, so concurrent programs share A panels in L2."""
        i, j = _tile_coordinates(w % tiles, RATIO)
        block_index = w // tiles
        batch = block_index // panels
        offset = (block_index % panels) * n
        return batch * n * panels + offset, offset, i * BLOCK_M_, j * BLOCK_N_, batch

    @gluon.jit
    def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, n, K, panels, tiles, total,
                        B_KMAJOR: gl.constexpr, RATIO: gl.constexpr):
        """Producer (1 warp): fill stage s once the consumers released it, signal ready[s];
        runs ahead into the next work item while the consumers finish the current one."""
        stages: gl.constexpr = a_bufs.shape[0]
        block_m: gl.constexpr = a_desc.block_type.shape[0]
        block_k: gl.constexpr = a_desc.block_type.shape[1]
        block_n: gl.constexpr = a_desc.block_type.shape[0] * RATIO
        counter = 0
        for w in range(gl.program_id(0), total, gl.num_programs(0)):
            matrix_row, offset, row0, col0, batch = _work_item(w, tiles, n, panels, RATIO, block_m, block_n)
            for step in range(gl.cdiv(K, block_k)):
                s = counter % stages
                # empty barriers start "phase 1 complete": the first pass over the ring never waits
                mbarrier.wait(empty.index(s), ((counter // stages) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                k0 = step * block_k
                _tma_load(a_desc, [matrix_row + row0, k0], bar, a_bufs.index(s))
                if B_KMAJOR:  # B's columns are rows of a [B·n, K] tensor
                    _tma_load(b_desc, [matrix_row + col0, k0], bar, b_bufs.index(s))
                else:  # B is a [B·K, n] tensor
                    _tma_load(b_desc, [batch * K + k0, offset + col0], bar, b_bufs.index(s))
                counter += 1

    @gluon.jit
    def _masked_mirror_store(tile, d_base, row0, col0, stride_dm, CHUNK: gl.constexpr, num_warps: gl.constexpr):
        """Diagonal tile (in shared memory, [BLOCK_M, BLOCK_N]): its lower part (diagonal
        included) in place, its strictly-lower part transposed, both through coalesced masked
        stores, CHUNK rows (then CHUNK columns) at a time."""
        block_m: gl.constexpr = tile.shape[0]
        block_n: gl.constexpr = tile.shape[1]
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        for r in gl.static_range(0, block_m, CHUNK):
            part = tile.slice(r, CHUNK, dim=0).load(blocked)
            rows = row0 + r + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, blocked))
            cols = col0 + gl.arange(0, block_n, layout=gl.SliceLayout(0, blocked))
            gl.store(d_base + rows[:, None].to(gl.int64) * stride_dm + cols[None, :], part,
                     mask=rows[:, None] >= cols[None, :])
        transposed = tile.permute((1, 0))  # [BLOCK_N, BLOCK_M] view: row c holds column c of the tile
        for c in gl.static_range(0, block_n, CHUNK):
            part = transposed.slice(c, CHUNK, dim=0).load(blocked)
            rows = col0 + c + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, blocked))  # D rows = tile columns
            cols = row0 + gl.arange(0, block_m, layout=gl.SliceLayout(0, blocked))
            gl.store(d_base + rows[:, None].to(gl.int64) * stride_dm + cols[None, :], part,
                     mask=rows[:, None] < cols[None, :])

    @gluon.jit
    def _mma_partition(a_bufs, b_bufs, epi, ready, empty, c_ready, c_desc, d_desc, dt_desc, d_ptr,
                       n, K, panels, tiles, total, alpha, beta,
                       HAS_C: gl.constexpr, B_KMAJOR: gl.constexpr, RATIO: gl.constexpr,
                       CHUNK: gl.constexpr, num_warps: gl.constexpr):
        """Consumers (default partition, two warpgroups): accumulate each tile in fp32 registers,
        then write it and its mirror; meanwhile the producer already loads the next tile."""
        stages: gl.constexpr = a_bufs.shape[0]
        block_m: gl.constexpr = a_bufs.shape[1]
        block_k: gl.constexpr = a_bufs.shape[2]
        block_n: gl.constexpr = block_m * RATIO
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, block_n, 16])
        n_full = n * panels
        counter = 0
        c_phase = 0
        for w in range(gl.program_id(0), total, gl.num_programs(0)):
            matrix_row, offset, row0, col0, batch = _work_item(w, tiles, n, panels, RATIO, block_m, block_n)
            acc = gl.zeros((block_m, block_n), gl.float32, layout)
            for step in range(gl.cdiv(K, block_k)):
                s = counter % stages
                mbarrier.wait(ready.index(s), (counter // stages) & 1)
                if B_KMAJOR:
                    b = b_bufs.index(s).permute((1, 0))
                else:
                    b = b_bufs.index(s)
                acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
                # One MMA stays in flight; the one before it has retired in both warpgroups once
                # every warp passes the barrier, so its stage can go back to the producer.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _partition_barrier()
                mbarrier.arrive(empty.index((counter + stages - 1) % stages), count=1, pred=step > 0)
                counter += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _partition_barrier()
            mbarrier.arrive(empty.index((counter + stages - 1) % stages), count=1)  # the tile's last stage

            # Epilogue through one tile-sized buffer. The previous tile's last TMA store (issued
            # by one thread) must have read it before anyone writes it again.
            tma.store_wait(0)
            _partition_barrier()
            acc = acc * alpha
            if HAS_C:
                mbarrier.expect(c_ready, c_desc.block_type.nbytes)
                _tma_load(c_desc, [matrix_row + row0, offset + col0], c_ready, epi)
                mbarrier.wait(c_ready, c_phase)
                c_phase ^= 1
                acc = acc + beta * epi.load(layout).to(gl.float32)
                _partition_barrier()  # all of C is read before the tile overwrites it
            out = acc.to(epi.dtype)
            epi.store(out)
            if col0 + block_n <= row0:  # strictly below the diagonal: the tile, then its transpose, by TMA
                fence_async_shared()
                _tma_store(d_desc, [matrix_row + row0, offset + col0], epi)
                tma.store_wait(0)
                _partition_barrier()
                epi_t = _reinterpret(epi, dt_desc, block_n, block_m)
                epi_t.store(gl.permute(out, (1, 0)))
                fence_async_shared()
                _tma_store(dt_desc, [matrix_row + col0, offset + row0], epi_t)  # waited for next tile
            else:
                _partition_barrier()
                d_base = d_ptr + matrix_row.to(gl.int64) * n_full + offset
                _masked_mirror_store(epi, d_base, row0, col0, n_full, CHUNK, num_warps)
        tma.store_wait(0)

    @gluon.jit
    def _symmetric_matmul_hopper_kernel(
        a_desc, b_desc, c_desc, d_desc, dt_desc, d_ptr,
        n, K, panels, tiles, total, alpha, beta,
        HAS_C: gl.constexpr, B_KMAJOR: gl.constexpr, RATIO: gl.constexpr, CHUNK: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):
        # Program p takes work items p, p + programs, ... of the `total` = tiles × matrices ×
        # diagonal blocks (tiles: the lower-triangle tiles of one n×n block); programs = total
        # (one item each) unless the launch is persistent.
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        epi = gl.allocate_shared_memory(dtype, d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        mbarrier.init(c_ready, count=1)
        gl.warp_specialize([
            (_mma_partition, (a_bufs, b_bufs, epi, ready, empty, c_ready, c_desc, d_desc, dt_desc, d_ptr,
                              n, K, panels, tiles, total, alpha, beta, HAS_C, B_KMAJOR, RATIO, CHUNK, num_warps)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, n, K, panels, tiles, total,
                               B_KMAJOR, RATIO)),
        ], [1], [PRODUCER_REGS])
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        mbarrier.invalidate(c_ready)


def _flat_descriptor(t: Tensor, block_shape):
    """TMA descriptor of a contiguous batched tensor [B, rows, cols] viewed as 2-D [B·rows, cols]."""
    flat = t.reshape(-1, t.shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for(list(block_shape), gl.bfloat16 if t.dtype == torch.bfloat16
                                                 else gl.float16)
    return TensorDescriptor.from_tensor(flat, list(block_shape), layout)


def symmetric_matmul_hopper(a3: Tensor, b3: Tensor, c3: Optional[Tensor], alpha: float, beta: float,
                            out3: Tensor, panels: int = 1, any_size: bool = False,
                            programs_per_sm: Optional[int] = None) -> bool:
    """Run D = alpha·A·B + beta·C on this kernel if it fits (see hopper_kernel_fits); return
    whether it ran (False also when it fails to build: see _launch_or_fall_back). Shapes are already checked by the caller: a3 [B, n, K], b3 [B, K, n],
    c3 [B, n, n] or None, out3 [B, n, n]; panels > 1 fills only the diagonal blocks; any_size:
    run whenever the layout fits, even where the Triton kernel is faster (tests, sweeps);
    programs_per_sm: persistent programs per SM, None (the default): one program per tile.
    Persistent launches let the producer load the next tile during the epilogue, but on the
    H200 they lost on every batched product (64×3584×4096 1.33× cuBLAS vs 1.64× per tile) and
    won only on one 8192² output (1.78× vs 1.62×): kernels-h200-2026-11-29.md, "Fifth run"."""
    batch, n, k = a3.shape
    block = n // panels
    if not hopper_kernel_fits(a3, b3, c3, out3, block, any_size):
        return False
    b_kmajor = not b3.is_contiguous()
    a_desc = _flat_descriptor(a3, (BLOCK_M, BLOCK_K))
    b_desc = (_flat_descriptor(b3.mT, (BLOCK_N, BLOCK_K)) if b_kmajor
              else _flat_descriptor(b3, (BLOCK_K, BLOCK_N)))
    d_desc = _flat_descriptor(out3, (BLOCK_M, BLOCK_N))
    dt_desc = _flat_descriptor(out3, (BLOCK_N, BLOCK_M))
    c_desc = _flat_descriptor(c3, (BLOCK_M, BLOCK_N)) if c3 is not None else d_desc
    tiles = lower_tile_count(block, BLOCK_M, BLOCK_N)
    total = tiles * batch * panels
    programs = total if programs_per_sm is None else min(total, programs_per_sm * _sm90_count(a3.device.index))

    def launch() -> None:
        _symmetric_matmul_hopper_kernel[(programs,)](
            a_desc, b_desc, c_desc, d_desc, dt_desc, out3,
            block, k, panels, tiles, total, float(alpha), float(beta),
            HAS_C=c3 is not None, B_KMAJOR=b_kmajor, RATIO=BLOCK_N // BLOCK_M, CHUNK=EPILOGUE_ROWS,
            PRODUCER_REGS=PRODUCER_REGISTERS, NUM_STAGES=STAGES, num_warps=CONSUMER_WARPS,
            maxnreg=KERNEL_REGISTERS,
        )

    return _launch_or_fall_back((a3.dtype, c3 is not None, b_kmajor, a3.device.index), launch)
