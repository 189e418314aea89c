"""The fused elementwise kernels (momentum accumulation, snapshot, scale-and-cast) against
float64 math: on CPU under TRITON_INTERPRET=1 (in a subprocess, since the variable must be set before Triton is imported), on GPU directly."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

CASES = textwrap.dedent(
    """
    import json, sys, torch
    from dion3.kernels.momentum import accumulate_momentum_triton, snapshot_rows_triton
    from dion3.kernels.scale import scale_cast_triton
    device = sys.argv[1]
    results = []
    gen = torch.Generator().manual_seed(0)
    # (matrix rows, cols, per-parameter batch sizes, decay, dtype): odd sizes, several params
    cases = [(5, 37, [1, 2], 1.0, torch.float32), (3, 600, [3], 0.9, torch.float32),
             (7, 513, [1, 1, 2], 0.95, torch.bfloat16), (4, 40, [2], 1.0, torch.float16)]
    for rows, cols, batches, decay, dtype in cases:
        n = sum(batches)
        m0 = torch.randn(n, rows, cols, generator=gen, dtype=torch.float64)
        grads64 = [torch.randn(b, rows, cols, generator=gen, dtype=torch.float64) for b in batches]
        momentum = m0.to(device=device, dtype=dtype)
        grads = [g.to(device=device, dtype=dtype) for g in grads64]
        scores, squares = accumulate_momentum_triton(momentum, grads, decay, True, True)
        # float64 reference from the same rounded inputs
        scaled, added = decay * m0.to(dtype).double(), torch.cat([g.to(dtype).double() for g in grads64])
        expected = scaled + added
        magnitude = scaled.abs() + added.abs()  # error scale of fp32 math before the one rounding
        got = momentum.double().cpu()
        ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
        value_err = ((got - expected).abs() / magnitude).max().item() / ulp
        score_ref = got.abs().sum(-1)  # scores must describe the stored (rounded) momentum
        score_err = ((scores.double().cpu() - score_ref).abs() / score_ref).max().item()
        squares_ref = got.square().sum(-1)  # squared L2 norms of the stored rows
        squares_err = ((squares.double().cpu() - squares_ref).abs() / squares_ref).max().item()
        again = accumulate_momentum_triton(momentum.clone(), grads, decay, False)
        results.append(dict(case=f"{rows}x{cols}x{batches}/{dtype}", value_ulps=value_err,
                            score_rel=max(score_err, squares_err), no_scores=again == (None, None)))
    # snapshot: U = M[rows], M[rows] *= mu, other rows untouched (k up to all rows, odd cols)
    for n, rows, cols, k, dtype in [(3, 9, 37, 2, torch.float32), (2, 5, 700, 5, torch.bfloat16)]:
        m0 = torch.randn(n, rows, cols, generator=gen, dtype=torch.float64).to(dtype)
        picks = torch.stack([torch.randperm(rows, generator=gen)[:k].sort().values for _ in range(n)])
        momentum = m0.clone().to(device)  # .to(cpu) alone would alias m0
        update = snapshot_rows_triton(momentum, picks.to(device), 0.9)
        expected_u = torch.stack([m0[i, picks[i]] for i in range(n)]).double()
        expected_m = m0.double().clone()
        for i in range(n):
            expected_m[i, picks[i]] = (0.9 * m0[i, picks[i]].double()).to(dtype).double()
        ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}[dtype]
        scaled_err = ((momentum.double().cpu() - expected_m).abs() / expected_m.abs().clamp_min(1e-30)).max().item()
        results.append(dict(case=f"snapshot {n}x{rows}x{cols} k={k}/{dtype}",
                            snapshot_exact=bool(torch.equal(update.double().cpu(), expected_u)),
                            value_ulps=scaled_err / ulp, score_rel=0.0, no_scores=True))
    # scaled snapshot: U·s per matrix written in half precision (Newton–Schulz's input)
    # (one factor per matrix, or one per selected row as the sharded step uses)
    for dst, per_row in ((torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)):
        n, rows, cols, k = 3, 9, 700, 4
        m0 = torch.randn(n, rows, cols, generator=gen, dtype=torch.float64).float()
        picks = torch.stack([torch.randperm(rows, generator=gen)[:k].sort().values for _ in range(n)])
        s = torch.rand(n, k if per_row else 1, 1, generator=gen) * 0.01 + 1e-4
        momentum = m0.clone().to(device)
        x = snapshot_rows_triton(momentum, picks.to(device), 0.9, s.to(device), dst)
        exact = torch.stack([m0[i, picks[i]] for i in range(n)]).double() * s.double()
        ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dst]
        # relative to fp16's smallest normal at most (below it fp16 spacing is absolute)
        err = ((x.double().cpu() - exact).abs() / exact.abs().clamp_min(2.0**-14)).max().item() / ulp
        expected_m = m0.clone()
        for i in range(n):
            expected_m[i, picks[i]] = m0[i, picks[i]] * torch.tensor(0.9, dtype=torch.float32)  # fp32 math, as the kernel
        results.append(dict(case=f"scaled snapshot ->{dst} per_row={per_row}", value_ulps=err, score_rel=0.0,
                            no_scores=x.dtype == dst, snapshot_exact=bool(torch.equal(momentum.cpu(), expected_m))))
    # scale-and-cast: per-matrix and per-row float32 scales, one rounding to the output dtype
    for n, rows, cols, per_row, src, dst in [(3, 5, 1100, False, torch.float32, torch.float16),
                                             (2, 7, 33, True, torch.float16, torch.float16),
                                             (2, 1, 40, True, torch.float32, torch.bfloat16)]:
        x64 = torch.randn(n, rows, cols, generator=gen, dtype=torch.float64) * 50
        s64 = torch.rand(n, rows if per_row else 1, 1, generator=gen, dtype=torch.float64) + 0.01
        x, s = x64.to(src), s64.float()
        out = scale_cast_triton(x.to(device), s.to(device), dst)
        expected = x.double() * s.double()
        ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dst]
        err = ((out.double().cpu() - expected).abs() / expected.abs().clamp_min(1e-30)).max().item() / ulp
        results.append(dict(case=f"scale {n}x{rows}x{cols} per_row={per_row} {src}->{dst}",
                            value_ulps=err, score_rel=0.0, no_scores=out.dtype == dst,
                            unchanged=bool(torch.equal(x.cpu(), x64.to(src)))))
    print(json.dumps(results))
    """
)


def _run(device, env):
    done = subprocess.run([sys.executable, "-c", CASES, device], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(results):
    assert len(results) == 12
    for r in results:
        # fp32 scale and add (decay itself rounded to fp32), then one rounding to the dtype;
        # the interpreter's bf16 conversion truncates: at most ~2 ulps of the terms' magnitude
        assert r["value_ulps"] <= 2.0, r
        assert r["score_rel"] <= 1e-5, r
        assert r["no_scores"], r
        assert r.get("snapshot_exact", True), r  # U is a copy of the selected rows
        assert r.get("unchanged", True), r  # scale-and-cast never writes its input


def test_interpreted_kernel_matches_float64():
    pytest.importorskip("triton")
    _check(_run("cpu", dict(os.environ, TRITON_INTERPRET="1")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_matches_float64():
    _check(_run("cuda", dict(os.environ)))
