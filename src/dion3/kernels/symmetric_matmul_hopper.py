"""Hopper (sm90) symmetric GEMM in Gluon: warp-specialized, 128×256 or 128×128 output tiles.

Same contract as kernels/symmetric_matmul.py (D = alpha·A·B + beta·C, only tiles touching the
lower triangle computed, each stored with its mirror) for the layouts the optimizer produces on
an H100/H200: contiguous half-precision operands whose sizes are multiples of the tile. The
Triton kernel reaches ~80% of cuBLAS's per-tile rate there; the gap is what warp
specialization and explicit shared-memory use are for:

- one producer warp streams A and B blocks through a ring of shared-memory stages with TMA
  (mbarrier "ready"/"empty" pairs), so loads never wait behind the math;
- the consumer warpgroups (the default partition; two, 64 rows of the tile each) run wgmma on
  the tile, keeping one MMA in flight and freeing a stage as soon as the MMA that read it
  retires;
- the epilogue writes the tile and its transpose into shared memory (the drained rings, or a
  tile of its own into which C's tile arrived by TMA during the main loop) and sends both out
  by TMA stores issued together. Tiles that cross the diagonal send their strictly-lower part
  and its transpose, and their diagonal block made exactly symmetric in shared memory, as
  [128, 64] blocks, also by TMA.

A `Tiling` (hopper_tiling.py) says how a launch is laid out (tile width, ring depth, epilogue
placement, registers, consumer warps); its rule picks 128×256 tiles for large products and
128×128 tiles where those would make too few waves. One program per work item (tile × matrix ×
diagonal block). A persistent launch (one program per SM looping over tiles) lost 10–20% on batched
products on the H200 and was removed (docs/kernels.md, "Tried and rejected").

Callers go through `symmetric_matmul_hopper(...)`, which returns False when the operands do not
fit this kernel's requirements (see `pick_tiling`); the Triton kernel handles those.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .hopper_tiling import BLOCK_M, SYMMETRIC_B_ALONG_K, Tiling, default_tiling, wide_tiling
from .tile_order import _tile_coordinates, lower_tile_count

# The Gluon API this module is written against: run on GPUs with Triton 3.6, compiled for sm_90a
# with Triton 3.9 (tests/compile_sm90.py). Older releases spell warp_specialize differently.
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

BLOCK_K = 64
PRODUCER_REGISTERS = 24
EPILOGUE_ROWS = 32  # rows per chunk when diagonal tiles mirror their diagonal block
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


# DION3_HOPPER_KERNEL=0 keeps every product on the Triton kernel (A/B runs, or a Triton whose
# experimental Gluon API misbehaves).
ENABLED = os.environ.get("DION3_HOPPER_KERNEL", "1").strip().lower() not in ("0", "false", "off", "no")


# Kernel specializations that built and ran (launch key → the kernel its first launch compiled).
# Holds compiled code, never tensors.
_launched: dict = {}

# After a specialization's first launch through Triton's JIT, later launches call the kernel it
# compiled directly (CompiledKernel[grid](every parameter in order)), skipping the JIT's argument
# binding, specialization and cache lookup: 32–60 µs of host time per launch on the H200 machine
# against 77–167 through the JIT (benchmarks/launch_overhead.py; kernels-h200-2026-11-29.md,
# "Host time per launch"). Only on Triton releases where that call was GPU-tested; the key names
# everything the JIT would specialize on.
DIRECT_LAUNCH_TRITON = ((3, 6),)
DIRECT_LAUNCH = GLUON_AVAILABLE and tuple(int(p) for p in triton.__version__.split(".")[:2]) in DIRECT_LAUNCH_TRITON


def _stop_direct_launches(error: Exception) -> None:
    """A direct launch failed in Triton's launcher (a release whose launcher reads other fields
    of its arguments): warn once and launch through the JIT from now on."""
    global DIRECT_LAUNCH
    DIRECT_LAUNCH = False
    warnings.warn(f"dion3: a direct launch of the Hopper Gluon kernel failed ({type(error).__name__}: "
                  f"{str(error)[:200]}); launching through Triton's JIT from now on", RuntimeWarning, stacklevel=3)


def _launch_or_fall_back(key, launch: Callable[[], object]) -> bool:
    """Run launch() (it returns the compiled kernel, kept in _launched); return True. If a
    specialization that never ran fails (the experimental Gluon API of an untested Triton
    release, a ptxas refusal), warn once, switch this kernel off for the process and return False: the caller falls back to the Triton kernel. Failures of
    a specialization that already ran are real errors and propagate."""
    global ENABLED
    if key in _launched:
        launch()
        return True
    try:
        compiled = launch()
    except Exception as error:
        ENABLED = False
        warnings.warn(f"dion3: the Hopper Gluon symmetric-matmul kernel failed to build or launch "
                      f"({type(error).__name__}: {str(error)[:200]}); using the Triton kernel from now on",
                      RuntimeWarning, stacklevel=3)
        return False
    _launched[key] = compiled
    return True


@lru_cache(maxsize=None)
def _sm90_count(device_index: int) -> int:
    """Streaming multiprocessors of an sm90 device, 0 for any other device."""
    if torch.cuda.get_device_capability(device_index)[0] != 9:
        return 0
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_tiling(a3: Tensor, b3: Tensor, c3: Optional[Tensor], out3: Optional[Tensor], block: int,
                any_size: bool = False, tiling: Optional[Tiling] = None) -> Optional[Tiling]:
    """How this kernel runs the product, None where it does not: it needs an sm90 device, one
    half-precision dtype for all operands, contiguous operands (B either K-major like A.mT of a
    contiguous A, or a contiguous [B, K, n]), a contiguous output and C, K a multiple of 64 (the
    flattened TMA descriptors then never read across matrices), the block size a multiple of the tile width, and a product
    where it wins (hopper_tiling.default_tiling). tiling: use this one (sweeps, tests);
    any_size=True: the wide tiling (or the given one) wherever the layout fits. out3 None: a
    freshly allocated output (contiguous, aligned)."""
    if not (ENABLED and GLUON_AVAILABLE) or a3.device.type != "cuda" or a3.dtype not in SUPPORTED_DTYPES:
        return None
    sms = _sm90_count(a3.device.index if a3.device.index is not None else torch.cuda.current_device())
    if not sms:
        return None
    batch, n, k = a3.shape
    if k % BLOCK_K or not a3.is_contiguous() or (out3 is not None and not out3.is_contiguous()):
        return None
    if not (b3.is_contiguous() or b3.mT.is_contiguous()) or (c3 is not None and not c3.is_contiguous()):
        return None
    # One dtype throughout (the launch key names A's only), every base 16-byte aligned (TMA).
    if not all(t.data_ptr() % 16 == 0 and t.dtype == a3.dtype for t in (a3, b3, out3, c3) if t is not None):
        return None
    if tiling is None:
        has_c = c3 is not None
        tiling = wide_tiling(k, has_c) if any_size else default_tiling(batch, n // block, block, k, has_c, sms)
    return tiling if tiling is not None and block % tiling.block_n == 0 else None


def hopper_kernel_fits(a3: Tensor, b3: Tensor, c3: Optional[Tensor], out3: Optional[Tensor], block: int,
                       any_size: bool = False) -> bool:
    """Whether this kernel runs the product by default (see pick_tiling)."""
    return pick_tiling(a3, b3, c3, out3, block, any_size) is not None


if GLUON_AVAILABLE:
    _REINTERPRET_IS_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # Triton ≥ 3.7

    @gluon.jit
    def _reinterpret(buffer, dtype: gl.constexpr, layout: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr,
                     D2: gl.constexpr = 0):
        """The same shared memory seen as a [D0, D1] buffer, or (D2 > 0) as D0 buffers of
        [D1, D2], in dtype and layout (of that rank)."""
        if D2 > 0:
            if _REINTERPRET_IS_PUBLIC:
                return buffer.reinterpret(dtype, [D0, D1, D2], layout)
            else:
                return buffer._reinterpret(dtype, [D0, D1, D2], layout)
        else:
            if _REINTERPRET_IS_PUBLIC:
                return buffer.reinterpret(dtype, [D0, D1], layout)
            else:
                return buffer._reinterpret(dtype, [D0, D1], layout)

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
    def _load_partition(a_desc, b_desc, c_desc, a_bufs, b_bufs, epi, ready, empty, c_ready, n, K, panels, tiles,
                        B_KMAJOR: gl.constexpr, RATIO: gl.constexpr, C_EARLY: gl.constexpr):
        """Producer (1 warp): C's tile first when it has its own buffer (C_EARLY), then the A and
        B blocks: fill stage s once the consumers released it, signal ready[s]."""
        stages: gl.constexpr = b_bufs.shape[0]
        block_m: gl.constexpr = a_desc.block_type.shape[0]
        block_k: gl.constexpr = a_desc.block_type.shape[1]
        block_n: gl.constexpr = a_desc.block_type.shape[0] * RATIO
        matrix_row, offset, row0, col0, batch = _work_item(gl.program_id(0), tiles, n, panels, RATIO, block_m, block_n)
        if C_EARLY:
            mbarrier.expect(c_ready, c_desc.block_type.nbytes)
            _tma_load(c_desc, [matrix_row + row0, offset + col0], c_ready, epi)
        for step in range(gl.cdiv(K, block_k)):
            s = step % stages
            # empty barriers start "phase 1 complete": the first pass over the ring never waits
            mbarrier.wait(empty.index(s), ((step // stages) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            k0 = step * block_k
            _tma_load(a_desc, [matrix_row + row0, k0], bar, a_bufs.index(s))
            if B_KMAJOR:  # B's columns are rows of a [B·n, K] tensor
                _tma_load(b_desc, [matrix_row + col0, k0], bar, b_bufs.index(s))
            else:  # B is a [B·K, n] tensor
                _tma_load(b_desc, [batch * K + k0, offset + col0], bar, b_bufs.index(s))

    @gluon.jit
    def _symmetric_block(lower, upper, col0, CHUNK: gl.constexpr, num_warps: gl.constexpr):
        """Columns col0 + [0, 64) of a tile's diagonal block, in place in `lower` ([M, 64]): the
        entries above the diagonal become the mirror of those below it, read from `upper` (the
        same block of the transposed tile), so D is exactly symmetric, not up to rounding."""
        size: gl.constexpr = lower.shape[0]
        width: gl.constexpr = lower.shape[1]
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        for r in gl.static_range(0, size, CHUNK):
            below = lower.slice(r, CHUNK, dim=0).load(blocked)
            mirror = upper.slice(r, CHUNK, dim=0).load(blocked)
            rows = r + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, blocked))
            cols = col0 + gl.arange(0, width, layout=gl.SliceLayout(0, blocked))
            lower.slice(r, CHUNK, dim=0).store(gl.where(rows[:, None] >= cols[None, :], below, mirror))

    @gluon.jit
    def _mma_partition(a_bufs, b_bufs, epi, epi_t, tile_blocks, transposed_blocks, ready, empty, c_ready,
                       c_desc, d_desc, dt_desc, dq_desc, y_desc, n, K, panels, tiles, alpha, beta,
                       HAS_C: gl.constexpr, C_EARLY: gl.constexpr, B_KMAJOR: gl.constexpr, RATIO: gl.constexpr,
                       CHUNK: gl.constexpr, COPY_A: gl.constexpr, num_warps: gl.constexpr):
        """Consumers (default partition, one or two warpgroups): accumulate the tile in fp32 registers,
        then write it and its transpose to shared memory and from there to D by TMA stores."""
        stages: gl.constexpr = b_bufs.shape[0]
        block_m: gl.constexpr = a_bufs.shape[1]
        block_k: gl.constexpr = a_bufs.shape[2]
        block_n: gl.constexpr = block_m * RATIO
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, block_n, 16])
        matrix_row, offset, row0, col0, batch = _work_item(gl.program_id(0), tiles, n, panels, RATIO, block_m, block_n)
        # COPY_A: the tile on the diagonal of each row block (one per block of A's rows) also
        # sends the A blocks it streams through to Y, a copy of A.
        copies = COPY_A and col0 + block_n > row0
        acc = gl.zeros((block_m, block_n), gl.float32, layout)
        for step in range(gl.cdiv(K, block_k)):
            s = step % stages
            mbarrier.wait(ready.index(s), (step // stages) & 1)
            if copies:
                _tma_store(y_desc, [matrix_row + row0, step * block_k], a_bufs.index(s))
            if B_KMAJOR:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            # One MMA stays in flight; the one before it has retired in both warpgroups once
            # every warp passes the barrier, so its stage can go back to the producer.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if copies:  # the previous stage's copy has been read out before the stage is refilled
                tma.store_wait(1)
            _partition_barrier()
            mbarrier.arrive(empty.index((step + stages - 1) % stages), count=1, pred=step > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if copies:
            tma.store_wait(0)
        _partition_barrier()  # every MMA and copy has read its stages: the rings are free for the epilogue

        acc = acc * alpha
        if HAS_C:
            if not C_EARLY:  # epi is the A ring: C can come in only now
                mbarrier.expect(c_ready, c_desc.block_type.nbytes)
                _tma_load(c_desc, [matrix_row + row0, offset + col0], c_ready, epi)
            mbarrier.wait(c_ready, 0)
            acc = acc + beta * epi.load(layout).to(gl.float32)
            _partition_barrier()  # all of C is read before the tile overwrites it
        out = acc.to(epi.dtype)
        epi.store(out)
        epi_t.store(gl.permute(out, (1, 0)))
        fence_async_shared()
        _partition_barrier()
        d_row = matrix_row + row0  # the tile's first row in the flattened D
        if col0 + block_n <= row0:  # strictly below the diagonal: the tile and its transpose
            _tma_store(d_desc, [d_row, offset + col0], epi)
            _tma_store(dt_desc, [matrix_row + col0, offset + row0], epi_t)
        else:
            # A diagonal tile: the columns of its half h are its rows (the diagonal block); the
            # other half lies strictly below (h = 1) or above (h = 0: another tile mirrors it).
            # Both go out as [M, 64] blocks: block j of the tile, and block 2q + r of the
            # transposed tile (its rows r·M.. of column block q).
            groups: gl.constexpr = block_m // block_k
            h = (row0 - col0) // block_m
            if h == 1:
                for q in gl.static_range(groups):
                    _tma_store(dq_desc, [d_row, offset + col0 + q * block_k], tile_blocks.index(q))
                    _tma_store(dq_desc, [matrix_row + col0, offset + row0 + q * block_k],
                               transposed_blocks.index(RATIO * q))
            for q in gl.static_range(groups):
                _symmetric_block(tile_blocks.index(h * groups + q), transposed_blocks.index(RATIO * q + h),
                                 q * block_k, CHUNK, num_warps)
            fence_async_shared()
            _partition_barrier()
            for q in gl.static_range(groups):
                _tma_store(dq_desc, [d_row, offset + row0 + q * block_k], tile_blocks.index(h * groups + q))
        tma.store_wait(0)  # shared memory stays valid until the stores have read it

    # Its integer arguments are not specialized (on value 1 or divisibility by 16), so the
    # launch key in symmetric_matmul_hopper names every specialization (see DIRECT_LAUNCH).
    @gluon.jit(do_not_specialize=["n", "K", "panels", "tiles"])
    def _symmetric_matmul_hopper_kernel(
        a_desc, b_desc, c_desc, d_desc, dt_desc, dq_desc, y_desc,
        n, K, panels, tiles, alpha, beta,
        HAS_C: gl.constexpr, B_KMAJOR: gl.constexpr, RATIO: gl.constexpr, CHUNK: gl.constexpr, COPY_A: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, NUM_STAGES: gl.constexpr, A_SLOTS: gl.constexpr, EPILOGUE_IN_RING: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # Program w computes work item w of tiles × matrices × diagonal blocks (tiles: the
        # lower-triangle tiles of one n×n block). A descriptor passed as None is one the launch
        # already passes under another name (each one costs host time per launch).
        b_desc = a_desc if b_desc is None else b_desc  # A·Aᵀ with square tiles
        dt_desc = d_desc if dt_desc is None else dt_desc  # square tiles
        c_desc = d_desc if c_desc is None else c_desc  # no C (never read)
        y_desc = a_desc if y_desc is None else y_desc  # no copy of A (never written)
        dtype: gl.constexpr = a_desc.dtype
        block_m: gl.constexpr = a_desc.block_type.shape[0]
        block_k: gl.constexpr = a_desc.block_type.shape[1]
        block_n: gl.constexpr = block_m * RATIO
        # The epilogue writes the tile ([M, N]) and its transpose ([N, M]) into shared memory the
        # main loop no longer needs; each is also seen as a stack of [M, 64] blocks (the A
        # ring's shape), which diagonal tiles store one by one.
        blocks: gl.constexpr = RATIO * block_m // block_k
        a_bufs = gl.allocate_shared_memory(dtype, [A_SLOTS] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        if EPILOGUE_IN_RING:  # the tile in the drained A ring, its transpose in the B ring
            tile_blocks = a_bufs
            transposed_blocks = _reinterpret(b_bufs, dtype, gl.constexpr(a_desc.layout), NUM_STAGES * RATIO,
                                             block_m, block_k)
            epi_t = _reinterpret(b_bufs, dtype, gl.constexpr(dt_desc.layout), block_n, block_m)
        else:  # the tile has its own buffer, C arrives there early; the transpose in the A ring
            tile_blocks = gl.allocate_shared_memory(dtype, [blocks] + a_desc.block_type.shape, a_desc.layout)
            transposed_blocks = a_bufs
            epi_t = _reinterpret(a_bufs, dtype, gl.constexpr(dt_desc.layout), block_n, block_m)
        epi = _reinterpret(tile_blocks, dtype, gl.constexpr(d_desc.layout), block_m, block_n)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        mbarrier.init(c_ready, count=1)
        c_early: gl.constexpr = HAS_C and not EPILOGUE_IN_RING
        gl.warp_specialize([
            (_mma_partition, (a_bufs, b_bufs, epi, epi_t, tile_blocks, transposed_blocks, ready, empty, c_ready,
                              c_desc, d_desc, dt_desc, dq_desc, y_desc, n, K, panels, tiles, alpha, beta, HAS_C,
                              c_early, B_KMAJOR, RATIO, CHUNK, COPY_A, num_warps)),
            (_load_partition, (a_desc, b_desc, c_desc, a_bufs, b_bufs, epi, ready, empty, c_ready, n, K, panels,
                               tiles, B_KMAJOR, RATIO, c_early)),
        ], [1], [PRODUCER_REGS])
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        mbarrier.invalidate(c_ready)


@lru_cache(maxsize=64)  # computing a layout costs ~6 µs of host time, a launch asks for up to seven
def _shared_layout(shape: tuple, dtype: torch.dtype):
    """The swizzled shared-memory layout TMA uses for a block (or a stack of blocks) of shape."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


class _LaunchDescriptor(NamedTuple):
    """What a direct launch reads of a TMA descriptor (Triton 3.6's launcher: the tensor's
    address, shape, strides and padding; block shape and swizzle are compiled into the kernel)."""
    base: Tensor
    shape: tuple
    strides: tuple
    padding: str = "zero"


def _flat_descriptor(t: Tensor, block_shape: tuple, direct: bool):
    """TMA descriptor of a contiguous batched tensor [B, rows, cols] viewed as 2-D [B·rows, cols].
    direct: only what a direct launch reads, without TensorDescriptor's checks (~10 µs each on
    the H200 machine; pick_tiling has checked contiguity and alignment). Never kept across
    launches: a descriptor holds its tensor, and a cache of them kept freed activations alive
    (+20 GB peak on Llama-1B steps, out of memory on Llama-8B: step-h200-2026-12-01.md,
    "Findings")."""
    rows, cols = t.numel() // t.shape[-1], t.shape[-1]
    if direct:
        return _LaunchDescriptor(t, (rows, cols), (cols, 1))
    return TensorDescriptor.from_tensor(t.view(rows, cols), list(block_shape), _shared_layout(block_shape, t.dtype))


def _same_view(x: Tensor, y: Tensor) -> bool:
    return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()


def symmetric_matmul_hopper(a3: Tensor, b3: Tensor, c3: Optional[Tensor], alpha: float, beta: float,
                            out3: Tensor, panels: int = 1, any_size: bool = False,
                            tiling: Optional[Tiling] = None, copy_a: Optional[Tensor] = None,
                            b_symmetric: bool = False) -> bool:
    """Run D = alpha·A·B + beta·C on this kernel if it fits (see pick_tiling); return whether
    it ran (False also when it fails to build: see _launch_or_fall_back). Shapes are already
    checked by the caller: a3 [B, n, K], b3 [B, K, n], c3 [B, n, n] or None, out3 [B, n, n];
    panels > 1 fills only the diagonal blocks; any_size: run whenever the layout fits, even
    where the Triton kernel is faster (tests, sweeps); tiling: this one rather than the
    default (sweeps, tests); copy_a: a contiguous tensor shaped like a3 that also receives a
    copy of A (each block of A's rows is sent on by the tile that streams it on the diagonal;
    panels = 1 only); b_symmetric: B holds the same values as Bᵀ, so a row-major B may be read
    as Bᵀ (K-major) where hopper_tiling.SYMMETRIC_B_ALONG_K says that is faster."""
    batch, n, k = a3.shape
    block = n // panels
    tiling = pick_tiling(a3, b3, c3, out3, block, any_size, tiling=tiling)
    if tiling is None:
        return False
    if b_symmetric and tiling.block_n in SYMMETRIC_B_ALONG_K and b3.is_contiguous():
        b3 = b3.mT
    if copy_a is not None and (panels != 1 or copy_a.shape != a3.shape or copy_a.dtype != a3.dtype
                               or not copy_a.is_contiguous() or copy_a.data_ptr() % 16):
        raise ValueError(f"copy_a must be a contiguous, 16-byte aligned {a3.dtype} tensor of shape "
                         f"{tuple(a3.shape)} (and panels 1), got {copy_a.dtype} {tuple(copy_a.shape)}")
    block_n = tiling.block_n
    b_kmajor = not b3.is_contiguous()
    # A descriptor the kernel already has under another name goes as None (each one costs host
    # time): B of A·Aᵀ on square tiles is A's, a square tile's transpose has the tile's shape.
    shares_b = b_kmajor and block_n == BLOCK_M and _same_view(b3.mT, a3)
    shares_dt = block_n == BLOCK_M
    key = (a3.dtype, c3 is not None, b_kmajor, tiling, copy_a is not None, shares_b, shares_dt, a3.device.index)
    compiled = _launched.get(key) if DIRECT_LAUNCH else None
    direct = compiled is not None
    a_desc = _flat_descriptor(a3, (BLOCK_M, BLOCK_K), direct)
    y_desc = _flat_descriptor(copy_a, (BLOCK_M, BLOCK_K), direct) if copy_a is not None else None
    b_desc = (None if shares_b else _flat_descriptor(b3.mT, (block_n, BLOCK_K), direct) if b_kmajor
              else _flat_descriptor(b3, (BLOCK_K, block_n), direct))
    d_desc = _flat_descriptor(out3, (BLOCK_M, block_n), direct)
    dt_desc = None if shares_dt else _flat_descriptor(out3, (block_n, BLOCK_M), direct)
    dq_desc = _flat_descriptor(out3, (BLOCK_M, BLOCK_K), direct)  # diagonal tiles go out as [M, 64] blocks
    c_desc = _flat_descriptor(c3, (BLOCK_M, block_n), direct) if c3 is not None else None
    tiles = lower_tile_count(block, BLOCK_M, block_n)
    grid = (tiles * batch * panels, 1, 1)
    # The kernel's parameters in order, all but num_warps (a launch option as well).
    args = (a_desc, b_desc, c_desc, d_desc, dt_desc, dq_desc, y_desc, block, k, panels, tiles, float(alpha),
            float(beta), c3 is not None, b_kmajor, block_n // BLOCK_M, EPILOGUE_ROWS, copy_a is not None,
            PRODUCER_REGISTERS, tiling.stages, max(tiling.stages, block_n // BLOCK_K), tiling.epilogue_in_ring)

    if direct:
        try:
            compiled[grid](*args, tiling.consumer_warps)
            return True
        except (AttributeError, IndexError, KeyError, TypeError) as error:  # raised before anything ran
            _stop_direct_launches(error)
            return symmetric_matmul_hopper(a3, b3, c3, alpha, beta, out3, panels, any_size, tiling, copy_a)

    def launch():
        return _symmetric_matmul_hopper_kernel[grid](*args, num_warps=tiling.consumer_warps, maxnreg=tiling.registers)

    return _launch_or_fall_back(key, launch)
