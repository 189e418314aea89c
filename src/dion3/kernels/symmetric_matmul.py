"""Triton symmetric GEMM: D = alpha·A·B + beta·C when the caller promises D is symmetric.

Only output tiles that touch the lower triangle are computed (about half the FLOPs of a full
product for large n); each tile stores its lower-triangle part directly and its strictly-lower
part transposed into the upper triangle, so every element of D is written exactly once. Tiles
wholly below the diagonal store both copies through TMA descriptors of D when the config asks
for it and D is aligned (1.1–1.3× faster than masked pointer stores on H200); tiles crossing the
diagonal or D's edge keep masked stores.
Batched [B, n, k] @ [B, k, n] with arbitrary strides (B = A.mT as a view is the common case),
fp16/bf16 operands, fp32 accumulation, output in the operands' dtype.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import TileConfig, pick_config
from .tile_order import _tile_coordinates, lower_tile_count  # noqa: F401 (lower_tile_count: public here)
from .symmetric_matmul_hopper import symmetric_matmul_hopper

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _accumulate(a, b, acc, UPCAST_DOT: tl.constexpr):
    # Triton's interpreter (3.9) computes garbage for bf16 tl.dot; bf16 → fp32 is exact, so
    # interpreter runs upcast first. Compiled kernels always feed the half-precision operands.
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _masked_store(d_base, out, rows, cols, n, stride_dm, stride_dn):
    """Lower part (diagonal included) in place; strictly-lower part mirrored into the upper
    triangle. Masks cover tiles that cross the diagonal or the edge of D."""
    inside = (rows[:, None] < n) & (cols[None, :] < n)
    tl.store(d_base + rows[:, None] * stride_dm + cols[None, :] * stride_dn, out,
             mask=inside & (rows[:, None] >= cols[None, :]))
    inside_t = (cols[:, None] < n) & (rows[None, :] < n)
    tl.store(d_base + cols[:, None] * stride_dm + rows[None, :] * stride_dn, tl.trans(out),
             mask=inside_t & (cols[:, None] < rows[None, :]))


@triton.jit
def _below_diagonal_store(d_base, out, rows, cols, n, stride_dm, stride_dn):
    """A tile wholly below the diagonal and its mirror, masked only at D's edge: a mask that
    does not vary along a row keeps the stores vectorized (the triangular mask of
    _masked_store makes every element a store of its own)."""
    inside = (rows[:, None] < n) & (cols[None, :] < n)
    tl.store(d_base + rows[:, None] * stride_dm + cols[None, :] * stride_dn, out, mask=inside)
    tl.store(d_base + cols[:, None] * stride_dm + rows[None, :] * stride_dn, tl.trans(out), mask=tl.trans(inside))


@triton.jit
def _diagonal_store(d_base, out, rows, cols, n, stride_dm, stride_dn):
    """A square tile on the diagonal, its lower part mirrored onto its upper part in registers,
    stored once with masks only at D's edge (vectorized, and deterministic: storing the tile and
    its transpose over each other would leave whichever store landed last)."""
    symmetric = tl.where(rows[:, None] >= cols[None, :], out, tl.trans(out))
    inside = (rows[:, None] < n) & (cols[None, :] < n)
    tl.store(d_base + rows[:, None] * stride_dm + cols[None, :] * stride_dn, symmetric, mask=inside)


@triton.jit
def _symmetric_matmul_kernel(
    a_ptr, b_ptr, c_ptr, d_ptr, a_desc, b_desc, d_desc, dt_desc,
    n, K, panels,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_db, stride_dm, stride_dn,
    alpha, beta,
    HAS_C: tl.constexpr, USE_DESCRIPTORS: tl.constexpr, B_TRANSPOSED: tl.constexpr, TMA_STORE: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RATIO: tl.constexpr,
):
    # One program per lower-triangle tile (axis 0) of one n×n diagonal block (axis 1: matrix of
    # the batch × block on its diagonal; panels == 1: the block is the whole output).
    i, j = _tile_coordinates(tl.program_id(0), RATIO)
    batch = (tl.program_id(1) // panels).to(tl.int64)  # int64: batch × stride overflows int32
    offset = (tl.program_id(1) % panels) * n  # the block's first row and column in D
    row0 = i * BLOCK_M
    col0 = j * BLOCK_N
    local_m = tl.arange(0, BLOCK_M)
    local_n = tl.arange(0, BLOCK_N)
    local_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if USE_DESCRIPTORS:
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            k0 = step * BLOCK_K
            a = a_desc.load([batch.to(tl.int32), offset + row0, k0]).reshape(BLOCK_M, BLOCK_K)
            if B_TRANSPOSED:  # b_desc describes B.mT ([B, n, K], K contiguous)
                b = b_desc.load([batch.to(tl.int32), offset + col0, k0]).reshape(BLOCK_N, BLOCK_K).trans()
            else:
                b = b_desc.load([batch.to(tl.int32), k0, offset + col0]).reshape(BLOCK_K, BLOCK_N)
            acc = _accumulate(a, b, acc, UPCAST_DOT)
    else:
        # Masks (not index clamping) for rows/columns past n: clamped indices would hide the
        # operand's contiguity from the compiler and cost vectorized loads (10× on H200).
        a_ptrs = (a_ptr + batch * stride_ab + (offset + row0).to(tl.int64) * stride_am
                  + local_m[:, None] * stride_am + local_k[None, :] * stride_ak)
        b_ptrs = (b_ptr + batch * stride_bb + (offset + col0).to(tl.int64) * stride_bn
                  + local_k[:, None] * stride_bk + local_n[None, :] * stride_bn)
        a_rows = (row0 + local_m)[:, None] < n
        b_cols = (col0 + local_n)[None, :] < n
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=a_rows, other=0.0)
                b = tl.load(b_ptrs, mask=b_cols, other=0.0)
            else:
                k_left = K - step * BLOCK_K
                a = tl.load(a_ptrs, mask=a_rows & (local_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=b_cols & (local_k[:, None] < k_left), other=0.0)
            acc = _accumulate(a, b, acc, UPCAST_DOT)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    rows = row0 + local_m  # within the block
    cols = col0 + local_n
    acc = acc * alpha
    if HAS_C:
        inside = (rows[:, None] < n) & (cols[None, :] < n)
        c_ptrs = (c_ptr + batch * stride_cb + offset.to(tl.int64) * (stride_cm + stride_cn)
                  + rows[:, None] * stride_cm + cols[None, :] * stride_cn)
        acc += beta * tl.load(c_ptrs, mask=inside, other=0.0).to(tl.float32)
    out = acc.to(d_ptr.dtype.element_ty)
    d_base = d_ptr + batch * stride_db + offset.to(tl.int64) * (stride_dm + stride_dn)
    if TMA_STORE:
        if col0 + BLOCK_N <= row0:
            # Strictly below the diagonal: the whole tile and its transpose, unmasked (TMA clips
            # rows/columns past D's edge itself; blocks of a split D are whole tiles).
            d_desc.store([batch.to(tl.int32), offset + row0, offset + col0], out.reshape(1, BLOCK_M, BLOCK_N))
            dt_desc.store([batch.to(tl.int32), offset + col0, offset + row0],
                          tl.trans(out).reshape(1, BLOCK_N, BLOCK_M))
        elif RATIO == 1:  # square tiles: this one lies on the diagonal
            _diagonal_store(d_base, out, rows, cols, n, stride_dm, stride_dn)
        else:
            _masked_store(d_base, out, rows, cols, n, stride_dm, stride_dn)
    elif col0 + BLOCK_N <= row0:
        _below_diagonal_store(d_base, out, rows, cols, n, stride_dm, stride_dn)
    elif RATIO == 1:
        _diagonal_store(d_base, out, rows, cols, n, stride_dm, stride_dn)
    else:
        _masked_store(d_base, out, rows, cols, n, stride_dm, stride_dn)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _descriptor_ready(t: Tensor) -> bool:
    """TMA needs a unit last stride, 16-byte-aligned base and other strides."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * size) % 16 == 0 for s in t.stride()[:-1]))


def _descriptor(t: Tensor, block_rows: int, block_cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch_stride = t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.stride(1)
    return TensorDescriptor(t, list(t.shape), [batch_stride, t.stride(1), 1], [1, block_rows, block_cols])


def _as_batched(name: str, t: Tensor) -> Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(f"{name} must be 2-D or 3-D ([B, rows, cols]), got shape {tuple(t.shape)}")
    return t


def symmetric_matmul_triton(
    a: Tensor,
    b: Tensor,
    c: Optional[Tensor] = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    config: Optional[TileConfig] = None,
    panels: int = 1,
    out: Optional[Tensor] = None,
    b_symmetric: bool = False,
) -> Tensor:
    """D = alpha·a·b + beta·c with only the lower-triangle tiles computed (D must be symmetric).

    a: [B, n, k] or [n, k]; b: [B, k, n] or [k, n] (any strides); c: [B, n, n] or [n, n], or None.
    config: tile config; None runs the Hopper Gluon kernel where it fits
    (symmetric_matmul_hopper.py), else picks a config from configs.py for this device, the
    block size n/panels, the reduction length k and whether there is a C term.
    panels > 1: compute only the panels diagonal blocks of size n/panels (each symmetric) into
    out, leaving the rest of out untouched (kernels/split.py fills it with dense products).
    b_symmetric: b holds the same values as bᵀ (see kernels.symmetric_matmul); passed on to
    the Hopper kernel, which may read it along K.
    """
    squeeze = a.dim() == 2
    a3, b3 = _as_batched("a", a), _as_batched("b", b)
    batch, n, k = a3.shape
    if b3.shape != (batch, k, n):
        raise ValueError(f"b must have shape {(batch, k, n)} to match a {tuple(a3.shape)}, got {tuple(b3.shape)}")
    if a3.dtype not in SUPPORTED_DTYPES or b3.dtype != a3.dtype:
        raise ValueError(f"a and b must share a dtype in {SUPPORTED_DTYPES}, got {a3.dtype} and {b3.dtype}")
    has_c = c is not None and beta != 0.0
    c3 = _as_batched("c", c) if has_c else None
    if has_c and c3.shape != (batch, n, n):
        raise ValueError(f"c must have shape {(batch, n, n)}, got {tuple(c3.shape)}")
    if panels < 1 or n % panels:
        raise ValueError(f"panels must divide n = {n}, got {panels}")
    if panels > 1 and out is None:
        raise ValueError("panels > 1 fills only the diagonal blocks: pass the output tensor as out")
    if out is None:
        out = torch.empty((n, n) if squeeze else (batch, n, n), dtype=a3.dtype, device=a3.device)
    elif _as_batched("out", out).shape != (batch, n, n) or out.dtype != a3.dtype or out.device != a3.device:
        raise ValueError(f"out must be a {a3.dtype} tensor of shape {(batch, n, n)} on {a3.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    out3 = _as_batched("out", out)
    block = n // panels
    if batch == 0 or n == 0:
        return out
    if k == 0:  # D = beta·C (or 0) on the blocks this call owns
        for p in range(panels):
            square = (slice(None), slice(p * block, (p + 1) * block), slice(p * block, (p + 1) * block))
            out3[square] = c3[square] * beta if has_c else 0
        return out
    # On Hopper, the warp-specialized Gluon kernel takes the products it fits (no explicit config).
    if config is None and symmetric_matmul_hopper(a3, b3, c3 if has_c else None, alpha, beta, out3, panels,
                                                  b_symmetric=b_symmetric):
        return out
    if config is None:
        major = None if a3.device.type != "cuda" else torch.cuda.get_device_capability(a3.device)[0]
        config = pick_config(block, major, k, has_c)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # TMA only where the operands allow it; the pointer path handles everything else.
    b_transposed = b3.stride(-2) == 1 and b3.stride(-1) != 1
    b_view = b3.mT if b_transposed else b3
    # (with panels, each block's first row/column must also sit on a 16-byte boundary: Triton's
    # interpreter refuses unaligned descriptor offsets)
    use_descriptors = (config.descriptors and _descriptor_ready(a3) and _descriptor_ready(b_view)
                       and (panels == 1 or (block * a3.element_size()) % 16 == 0))
    a_desc = b_desc = None
    if use_descriptors:
        a_desc = _descriptor(a3, bm, bk)
        b_desc = _descriptor(b_view, bn, bk) if b_transposed else _descriptor(b_view, bk, bn)
    # Unmasked TMA stores need whole tiles inside each block (TMA clips only at D's edge).
    use_tma_store = (config.tma_store and use_descriptors and _descriptor_ready(out3)
                     and (panels == 1 or block % bn == 0))
    d_desc = dt_desc = None
    if use_tma_store:
        d_desc = _descriptor(out3, bm, bn)
        dt_desc = d_desc if bm == bn else _descriptor(out3, bn, bm)
    c_arg = c3 if has_c else out3
    grid = (lower_tile_count(block, bm, bn), batch * panels)
    options = {} if config.max_registers is None else {"maxnreg": config.max_registers}
    _symmetric_matmul_kernel[grid](
        a3, b3, c_arg, out3, a_desc, b_desc, d_desc, dt_desc,
        block, k, panels,
        *a3.stride(), *b3.stride(), *c_arg.stride(), *out3.stride(),
        float(alpha), float(beta),
        HAS_C=has_c, USE_DESCRIPTORS=use_descriptors, B_TRANSPOSED=b_transposed, TMA_STORE=use_tma_store,
        EVEN_K=(k % bk == 0), UPCAST_DOT=(_interpreting() and a3.dtype == torch.bfloat16),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, RATIO=bn // bm,
        num_warps=config.num_warps, num_stages=config.num_stages, **options,
    )
    return out


def diagonal_blocks_triton(config: Optional[TileConfig] = None):
    """The split product's diagonal-block filler (kernels/split.py) on this kernel."""
    def fill(a, b, c, alpha, beta, out, panels) -> None:
        symmetric_matmul_triton(a, b, c, alpha, beta, config=config, panels=panels, out=out)
    return fill
