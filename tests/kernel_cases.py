"""Kernel checks against float64 references, shared by tests/test_kernels.py's CPU run (under
TRITON_INTERPRET=1, in a subprocess: the variable must be set before Triton is imported) and
its GPU run. `python tests/kernel_cases.py` prints one JSON object per case.

Interpreter limits (Triton 3.9): bf16 tl.dot returns garbage (the kernel upcasts bf16 operands
to fp32 there, exactly), and fp32→bf16 conversion truncates instead of rounding to nearest, so
bf16 results may be one bf16 ulp off instead of half an ulp.
"""
from __future__ import annotations

import json
import sys

import torch

from dion3.kernels.configs import TileConfig
from dion3.kernels.post_update import post_update_triton
from dion3.kernels.split import split_symmetric_matmul
from dion3.kernels.symmetric_matmul import diagonal_blocks_triton, lower_tile_count, symmetric_matmul_triton
from dion3.kernels.transpose import transpose_into_triton

# Relative error bound for a fp32-accumulated product rounded to the dtype (one ulp of the
# largest entry, generous for the accumulation).
PRODUCT_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}

SMALL = TileConfig(16, 16, 16, num_warps=4, num_stages=2)
WIDE = TileConfig(16, 32, 16, num_warps=4, num_stages=2)
WIDER = TileConfig(16, 64, 32, num_warps=4, num_stages=2)
TMA = TileConfig(16, 32, 16, num_warps=4, num_stages=2, descriptors=True)
# TMA stores of the tiles below the diagonal (and their mirrors); 72 is not a multiple of the
# tile, so TMA clips the edge tiles.
TMA_STORE = TileConfig(16, 16, 16, num_warps=4, num_stages=2, descriptors=True, tma_store=True)
TMA_STORE_WIDE = TileConfig(16, 32, 16, num_warps=4, num_stages=2, descriptors=True, tma_store=True)

# (name, batch (None: 2-D), n, k, operand, config): operand "view" is b = a.mT, "contig" is
# b = a.mT.contiguous(), "square" is 0.7·R·R − 1.3·R with R symmetric, "gram_c" is
# 0.5·A·Aᵀ + 2·S with S symmetric.
SYMMETRIC_CASES = (
    ("2d_odd", None, 37, 50, "view", SMALL),
    ("batched_odd", 3, 45, 33, "view", SMALL),
    ("contiguous_b", 2, 40, 24, "contig", SMALL),
    ("square_alpha_beta", 2, 35, 35, "square", SMALL),
    ("gram_with_c", 2, 29, 40, "gram_c", WIDE),
    ("wide_tiles_many", 1, 150, 16, "view", WIDE),
    ("wider_tiles", 2, 70, 64, "square", WIDER),
    ("descriptors_view", 2, 40, 56, "view", TMA),
    ("descriptors_square", 2, 48, 48, "square", TMA),
    ("tma_store_batched", 3, 72, 40, "view", TMA_STORE),
    ("tma_store_wide_gram_c", 2, 72, 56, "gram_c", TMA_STORE_WIDE),
)
# (name, batch, n, k, operand, panels, config): only the diagonal blocks are computed.
PANEL_CASES = (
    ("panels_2_pointer", 2, 64, 40, "view", 2, SMALL),
    ("panels_3_odd_block", 1, 3 * 23, 24, "gram_c", 3, SMALL),  # blocks not a tile multiple
    ("panels_2_tma_store", 2, 96, 32, "square", 2, TMA_STORE),
)


def _symmetric_operands(batch, n, k, operand, dtype, device, generator):
    shape = (n, k) if batch is None else (batch, n, k)
    a = torch.randn(shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    if operand in ("view", "contig"):
        return a, (a.mT if operand == "view" else a.mT.contiguous()), None, 1.0, 0.0
    if operand == "gram_c":
        s = torch.randn(shape[:-1] + (n,), generator=generator, dtype=torch.float64)
        return a, a.mT, (s + s.mT).to(device=device, dtype=dtype), 0.5, 2.0
    r = torch.randn(shape[:-1] + (n,), generator=generator, dtype=torch.float64)
    r = (r + r.mT).to(device=device, dtype=dtype)
    return r, r, r, 0.7, -1.3


def float64_product(a, b, c, alpha, beta):
    """alpha·a·b + beta·c in float64 on the CPU, written independently of the library."""
    exact = alpha * (a.double().cpu() @ b.double().cpu())
    return exact if c is None else exact + beta * c.double().cpu()


def check_symmetric(name, batch, n, k, operand, config, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    a, b, c, alpha, beta = _symmetric_operands(batch, n, k, operand, dtype, device, generator)
    out = symmetric_matmul_triton(a, b, c, alpha, beta, config=config)
    exact = float64_product(a, b, c, alpha, beta)
    error = float((out.double().cpu() - exact).abs().max() / exact.abs().max())
    return dict(kind="symmetric", case=name, dtype=str(dtype), error=error, tol=PRODUCT_TOL[dtype],
                shape_ok=tuple(out.shape) == tuple(exact.shape), dtype_ok=out.dtype == dtype,
                finite=bool(torch.isfinite(out).all()), symmetric=bool(torch.equal(out, out.mT)))


def check_panels(name, batch, n, k, operand, panels, config, dtype, device="cpu", seed=0):
    """Diagonal blocks only: they match float64, and the rest of out keeps its NaN poison."""
    generator = torch.Generator().manual_seed(seed)
    a, b, c, alpha, beta = _symmetric_operands(batch, n, k, operand, dtype, device, generator)
    out = torch.full((batch, n, n), float("nan"), dtype=dtype, device=device)
    symmetric_matmul_triton(a, b, c, alpha, beta, config=config, panels=panels, out=out)
    exact = float64_product(a, b, c, alpha, beta)
    size = n // panels
    on_diagonal = torch.zeros(n, n, dtype=torch.bool)
    for p in range(panels):
        on_diagonal[p * size:(p + 1) * size, p * size:(p + 1) * size] = True
    got = out.double().cpu()
    error = float((got[:, on_diagonal] - exact[:, on_diagonal]).abs().max() / exact.abs().max())
    return dict(kind="panels", case=name, dtype=str(dtype), error=error, tol=PRODUCT_TOL[dtype],
                untouched=bool(got[:, ~on_diagonal].isnan().all()),
                finite=bool(torch.isfinite(got[:, on_diagonal]).all()),
                symmetric=bool(torch.equal(got[:, on_diagonal], got.mT[:, on_diagonal])))


# (name, batch, n, k, operand, diagonal-block config): split products on the Triton pieces.
SPLIT_CASES = (
    ("split_gram", 2, 64, 40, "view", SMALL),
    ("split_gram_c_tma", 1, 96, 32, "gram_c", TMA_STORE),
    ("split_square", 2, 70, 70, "square", SMALL),
)


def check_split(name, batch, n, k, operand, config, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    a, b, c, alpha, beta = _symmetric_operands(batch, n, k, operand, dtype, device, generator)
    out = split_symmetric_matmul(a, b, c, alpha, beta, diagonal_blocks_triton(config), transpose_into_triton)
    exact = float64_product(a, b, c, alpha, beta)
    error = float((out.double().cpu() - exact).abs().max() / exact.abs().max())
    return dict(kind="split", case=name, dtype=str(dtype), error=error, tol=PRODUCT_TOL[dtype],
                finite=bool(torch.isfinite(out).all()), symmetric=bool(torch.equal(out, out.mT)))


def check_transpose(device="cpu") -> dict:
    """Strided views of odd sizes (not tile multiples) against torch's own transpose."""
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(3, 150, 200, generator=generator).to(device=device, dtype=torch.bfloat16)
    src = base[:, 5:135, 7:77]  # [3, 130, 70], row stride 200
    dst = torch.zeros(3, 90, 140, dtype=torch.bfloat16, device=device)[:, 10:80, 3:133]  # [3, 70, 130]
    transpose_into_triton(dst, src)
    return dict(kind="transpose", case="strided_odd", ok=bool(torch.equal(dst.cpu(), src.mT.cpu())))


def check_scaled_transpose(dst_dtype, device="cpu") -> dict:
    """float32 src (a transposed view, as Newton–Schulz normalizes a tall input) times one
    factor per matrix, cast to dst_dtype: against float64, in units of the dtype's ulp."""
    generator = torch.Generator().manual_seed(4)
    src64 = torch.randn(3, 70, 130, generator=generator, dtype=torch.float64) * 100
    scale64 = torch.rand(3, 1, 1, generator=generator, dtype=torch.float64) + 0.01
    src = src64.float().to(device)
    dst = torch.empty(3, 130, 70, dtype=dst_dtype, device=device)
    transpose_into_triton(dst, src, scale64.float().to(device))
    exact = src64.float().double().mT * scale64.float().double()
    ulps = float(((dst.double().cpu() - exact).abs() / exact.abs().clamp_min(1e-30)).max()) / ULP[dst_dtype]
    return dict(kind="scaled_transpose", case="per_matrix", dtype=str(dst_dtype), ulps=ulps,
                source_unchanged=bool(torch.equal(src.cpu(), src64.float())))


# (name, param dtype, select rows, decay/step as 0-d tensors, per-row factors: None, "flat"
# [N, k] or "column" [N, k, 1])
POST_UPDATE_CASES = tuple(
    (f"{str(dtype).split('.')[-1]}_{'rows' if rows else 'all'}_{'tensor' if tensor else 'float'}"
     f"{'' if scale is None else '_scale_' + scale}", dtype, rows, tensor, scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for rows in (True, False)
    for tensor in (False, True)
    for scale in (None, "flat", "column")
)


def check_post_update(name, dtype, select_rows, scalar_tensors, scale_layout=None, device="cpu", seed=0, R=13, C=600):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    # Three params of one bucket: batches of 2, 1 and a strided slice of 2 (batch stride ≠ R·C).
    params = [randn(2, R, C).to(device=device, dtype=dtype), randn(1, R, C).to(device=device, dtype=dtype),
              randn(4, R, C).to(device=device, dtype=dtype)[::2]]
    before = [p.double().cpu() for p in params]
    total = 5
    k = 4 if select_rows else R
    update = randn(total, k, C).float().to(device)
    rows = torch.stack([torch.randperm(R, generator=generator)[:k] for _ in range(total)]).to(device) if select_rows else None
    decay, step = 0.9, 0.05
    as_arg = (lambda v: torch.tensor(v, device=device)) if scalar_tensors else (lambda v: v)
    # positive factors spread over [0.1, 4), like NorMuon's; exact in float32 and float64
    factors = (0.1 + 3.9 * torch.rand(total, k, generator=generator)).float()
    row_scale = {None: None, "flat": factors, "column": factors.unsqueeze(-1)}[scale_layout]
    post_update_triton(params, update, rows, as_arg(decay), as_arg(step),
                       None if row_scale is None else row_scale.to(device))
    # float64 expectation, matrix by matrix
    expected = torch.cat(before).mul(decay)
    magnitude = expected.abs()  # size of the terms, for the fp32 arithmetic's own error
    upd = update.double().cpu()
    row_factor = factors.double() if row_scale is not None else torch.ones(total, k, dtype=torch.float64)
    for m in range(total):
        selected = range(R) if rows is None else rows[m].tolist()
        for position, row in enumerate(selected):
            change = step * row_factor[m, position].item() * upd[m, position]
            expected[m, row] -= change
            magnitude[m, row] += change.abs()
    got = torch.cat([p.double().cpu() for p in params])
    # One rounding to the dtype (within one ulp: the interpreter truncates bf16) on top of a
    # few fp32 roundings of the terms (decay and step are fp32 in the kernel; the factor adds
    # one product).
    roundings = 4 if row_scale is None else 5
    bound = expected.abs() * ULP[dtype] + magnitude * roundings * 2.0 ** -24 + 1e-30
    worst = float(((got - expected).abs() / bound).max())
    return dict(kind="post_update", case=name, dtype=str(dtype), ulps=worst, ok=worst <= 1.0)


def tile_count_matches_brute_force() -> bool:
    for n in (1, 15, 16, 17, 100, 257):
        for bm, bn in ((16, 16), (16, 32), (16, 64), (32, 32)):
            rows_blocks, col_blocks = -(-n // bm), -(-n // bn)
            brute = sum(1 for i in range(rows_blocks) for j in range(col_blocks) if j * bn < (i + 1) * bm)
            if lower_tile_count(n, bm, bn) != brute:
                return False
    return True


def run_all(device="cpu") -> list[dict]:
    results = [check_symmetric(*case, dtype=dtype, device=device)
               for case in SYMMETRIC_CASES for dtype in (torch.float16, torch.bfloat16)]
    results += [check_panels(*case, dtype=dtype, device=device)
                for case in PANEL_CASES for dtype in (torch.float16, torch.bfloat16)]
    results += [check_split(*case, dtype=dtype, device=device)
                for case in SPLIT_CASES for dtype in (torch.float16, torch.bfloat16)]
    results.append(check_transpose(device))
    results += [check_scaled_transpose(dtype, device) for dtype in (torch.float16, torch.bfloat16, torch.float32)]
    results += [check_post_update(*case, device=device) for case in POST_UPDATE_CASES]
    results.append(dict(kind="tiles", case="lower_tile_count", ok=tile_count_matches_brute_force()))
    return results


if __name__ == "__main__":
    for result in run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu"):
        print(json.dumps(result))
