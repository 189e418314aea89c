"""The fused elementwise kernels (momentum accumulation, snapshot, scale-and-cast) against
float64 math: on CPU under TRITON_INTERPRET=1 (in a subprocess, since the variable must be set before Triton is imported), on GPU directly."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Shared by the scripts below: the momentum pass against float64 math from the same rounded inputs.
ACCUMULATE_ERRORS = textwrap.dedent(
    """
    import torch
    ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

    def accumulate_errors(before, grads, decay, after, scores, squares):
        \"\"\"(worst error of the new momentum in ulps of its dtype, relative to the terms'
        magnitude; worst relative error of the scores and squared norms of the stored rows)\"\"\"
        scaled = decay * before.double().cpu()
        added = torch.cat([g.double().cpu() for g in grads])
        magnitude = scaled.abs() + added.abs()  # error scale of fp32 math before the one rounding
        got = after.double().cpu()
        value_ulps = ((got - (scaled + added)).abs() / magnitude).max().item() / ULP[after.dtype]
        score_rel = 0.0  # scores and squares must describe the stored (rounded) momentum
        for out, ref in ((scores, got.abs().sum(-1)), (squares, got.square().sum(-1))):
            if out is not None:
                score_rel = max(score_rel, ((out.double().cpu() - ref).abs() / ref).max().item())
        return value_ulps, score_rel
    """
)

CASES = ACCUMULATE_ERRORS + textwrap.dedent(
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
        before = momentum.clone()
        scores, squares = accumulate_momentum_triton(momentum, grads, decay, True, True)
        value_err, score_err = accumulate_errors(before, grads, decay, momentum, scores, squares)
        again = accumulate_momentum_triton(momentum.clone(), grads, decay, False)
        results.append(dict(case=f"{rows}x{cols}x{batches}/{dtype}", value_ulps=value_err,
                            score_rel=score_err, no_scores=again == (None, None)))
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


# The momentum pass's launches: one through a pointer table for same-shape pieces, else one per
# piece; the table cache across captures, eviction and replaced gradients. Prints JSON lines.
ONE_LAUNCH_CASES = ACCUMULATE_ERRORS + textwrap.dedent(
    """
    import json, sys, torch
    import dion3.kernels.momentum as mm
    device = sys.argv[1]
    gen = torch.Generator().manual_seed(1)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    launches = []  # POINTER_TABLE of each launch of the momentum kernel
    kernel, capturing = mm._accumulate_kernel, mm._capturing

    class CountingKernel:  # the launcher calls kernel[grid](...): count, then launch the real one
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["POINTER_TABLE"])
                return kernel[grid](*args, **kwargs)
            return launch

    mm._accumulate_kernel = CountingKernel()

    def pretend_capturing(flag):  # on CPU torch.cuda cannot be asked, so the module's check is replaced
        mm._capturing = (lambda device: True) if flag else capturing

    def rand(shape, dtype):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    def tables():
        return len(mm._pointer_tables) + len(mm._graph_tables)

    def cached(grads):  # whether the cache holds a table for these pieces' addresses
        key = (grads[0].device, grads[0].dtype, tuple(g.data_ptr() for g in grads))
        return key in mm._pointer_tables or key in mm._graph_tables

    def report(kind, case, momentum, before, grads, decay, out, asked, calls, added, **extra):
        value_ulps, score_rel = accumulate_errors(before, grads, decay, momentum, *out)
        print(json.dumps(dict(kind=kind, case=case, launches=calls, tables_added=added, value_ulps=value_ulps,
                              score_rel=score_rel, asked=asked, returned=[o is not None for o in out], **extra)))

    def run(kind, case, momentum, grads, decay, scores=True, squares=True, **extra):
        \"\"\"One call: its launches, the tables it added, its errors against float64 math.\"\"\"
        before, count, was_cached = momentum.clone(), tables(), cached(grads)
        del launches[:]
        out = mm.accumulate_momentum_triton(momentum, grads, decay, scores, squares)
        report(kind, case, momentum, before, grads, decay, out, [scores, squares], list(launches), tables() - count,
               pieces=len(grads), was_cached=was_cached, is_cached=cached(grads), **extra)

    # same-shape pieces, one launch (B_i > 1, two column blocks, decay ≠ 1, either precision on
    # either side); the second call reuses the cached table
    for rows, cols, batch, pieces, decay, m_dtype, g_dtype, scores, squares in [
            (3, 37, 1, 4, 0.9, f32, f32, True, True), (5, 1100, 2, 3, 1.0, bf16, bf16, True, False),
            (2, 40, 2, 2, 0.95, f32, bf16, False, True), (4, 33, 3, 3, 0.8, bf16, f32, False, False),
            (3, 64, 1, 5, 1.0, f16, f16, True, True)]:
        momentum = rand((batch * pieces, rows, cols), m_dtype)
        grads = [rand((batch, rows, cols), g_dtype) for _ in range(pieces)]
        case = f"{pieces}x[{batch},{rows},{cols}] {g_dtype}->{m_dtype} decay={decay}"
        run("one", case, momentum, grads, decay, scores, squares)
        run("again", case, momentum, grads, decay, scores, squares)

    # one launch per piece: pieces that differ in batch or dtype, a strided or unaligned piece, one piece
    rows, cols = 3, 40
    flat = rand((1 + rows * cols,), f32)
    for case, grads in {
        "mixed batch sizes": [rand((1, rows, cols), f32), rand((2, rows, cols), f32)],
        "mixed dtypes": [rand((1, rows, cols), f32), rand((1, rows, cols), bf16)],
        "strided piece": [rand((1, rows, cols), f32), rand((1, cols, rows), f32).mT],
        "unaligned piece": [rand((1, rows, cols), f32), flat[1:].view(1, rows, cols)],
        "one piece": [rand((3, rows, cols), f32)],
    }.items():
        run("per_piece", case, rand((sum(g.shape[0] for g in grads), rows, cols), f32), grads, 0.9)

    # capture: a table not cached cannot be copied (per-piece launches); a cached one is used and
    # kept for the graph's replays when more buckets than the limit pass through the cache
    grads = [rand((2, rows, cols), f32) for _ in range(3)]
    pretend_capturing(True)
    run("capture", "miss", rand((6, rows, cols), f32), grads, 0.9)
    pretend_capturing(False)
    run("capture", "eager", rand((6, rows, cols), f32), grads, 0.9)
    pretend_capturing(True)
    run("capture", "hit", rand((6, rows, cols), f32), grads, 0.9)
    pretend_capturing(False)
    others = [[torch.empty(1, 1, 4, device=device) for _ in range(2)] for _ in range(mm.POINTER_TABLE_LIMIT + 5)]
    for other in others:
        mm.grad_pointer_table(other)
    key = (grads[0].device, grads[0].dtype, tuple(g.data_ptr() for g in grads))
    print(json.dumps(dict(kind="bound", cached=len(mm._pointer_tables), limit=mm.POINTER_TABLE_LIMIT,
                          graph_table_kept=key in mm._graph_tables)))
    run("capture", "after eviction", rand((6, rows, cols), f32), grads, 0.9)

    # a gradient replaced by a new tensor (new address and values): a new table; new values
    # written in place (same addresses): the same table
    grads = [rand((1, 4, 24), bf16) for _ in range(3)]
    momentum = rand((3, 4, 24), f32)
    run("replaced", "first", momentum, grads, 0.9)
    old = grads[1]  # kept alive, so the new tensor cannot take its address
    grads[1] = rand((1, 4, 24), bf16)
    run("replaced", "new tensor", momentum, grads, 0.9, new_address=grads[1].data_ptr() != old.data_ptr())
    for g in grads:
        g.copy_(rand(g.shape, g.dtype))
    run("replaced", "rewritten in place", momentum, grads, 0.9)

    if device == "cuda":  # real captures (shapes compiled above): the replays read the right gradients
        for case, warm in (("graph hit", True), ("graph miss", False)):
            grads = [rand((2, rows, cols), f32) for _ in range(3)]
            momentum = rand((6, rows, cols), f32)
            if warm:  # an eager call caches the table
                mm.accumulate_momentum_triton(momentum.clone(), grads, 0.9, True, True)
            count = tables()
            del launches[:]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = mm.accumulate_momentum_triton(momentum, grads, 0.9, True, True)
            captured, added = list(launches), tables() - count
            for other in others:  # would evict the graph's table if it were not kept
                mm.grad_pointer_table(other)
            before = momentum.clone()
            graph.replay()
            torch.cuda.synchronize()
            report("graph", case, momentum, before, grads, 0.9, out, [True, True], captured, added,
                   pieces=len(grads), warm=warm, kept=cached(grads))
    """
)


def _run(script, device, env):
    done = subprocess.run([sys.executable, "-c", script, device], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


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
    _check(json.loads(_run(CASES, "cpu", dict(os.environ, TRITON_INTERPRET="1"))[-1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_matches_float64():
    _check(json.loads(_run(CASES, "cuda", dict(os.environ))[-1]))


def _launch_results(device, env):
    results = {}
    for r in map(json.loads, _run(ONE_LAUNCH_CASES, device, env)):
        results.setdefault(r["kind"], []).append(r)
    for r in (r for kind in results.values() for r in kind if "value_ulps" in r):
        assert r["value_ulps"] <= 2.0, r  # as _check: fp32 math, one rounding to momentum's dtype
        assert r["score_rel"] <= 1e-5, r
        assert r["returned"] == r["asked"], r  # scores / squares exactly when asked for
    return results


@pytest.fixture(scope="module")
def interpreted_launches():
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):  # run on 3.6 and 3.9
        pytest.skip(f"interpreter cases need Triton ≥ 3.6; have {triton.__version__}")
    return _launch_results("cpu", dict(os.environ, TRITON_INTERPRET="1"))


def test_interpreted_same_shape_pieces_take_one_launch(interpreted_launches):
    assert len(interpreted_launches["one"]) == len(interpreted_launches["again"]) == 5
    for r in interpreted_launches["one"]:
        assert r["launches"] == [True] and r["tables_added"] == 1, r  # one launch, one new table
    for r in interpreted_launches["again"]:
        assert r["launches"] == [True] and r["tables_added"] == 0, r  # the cached table


def test_interpreted_other_pieces_launch_once_each(interpreted_launches):
    cases = {r["case"]: r for r in interpreted_launches["per_piece"]}
    assert set(cases) == {"mixed batch sizes", "mixed dtypes", "strided piece", "unaligned piece", "one piece"}
    for r in cases.values():
        assert r["launches"] == [False] * r["pieces"] and r["tables_added"] == 0, r


def test_interpreted_capture_miss_launches_per_piece(interpreted_launches):
    cases = {r["case"]: r for r in interpreted_launches["capture"]}
    assert cases["miss"]["launches"] == [False] * 3 and cases["miss"]["tables_added"] == 0  # no copy to the device
    assert cases["eager"]["launches"] == [True] and cases["eager"]["tables_added"] == 1
    assert cases["hit"]["launches"] == [True] and cases["hit"]["tables_added"] == 0
    # more buckets than the limit: the cache stays bounded, the captured table stays and is reused
    (bound,) = interpreted_launches["bound"]
    assert bound["cached"] == bound["limit"] and bound["graph_table_kept"], bound
    assert cases["after eviction"]["launches"] == [True] and cases["after eviction"]["tables_added"] == 0


def test_interpreted_replaced_gradient_gets_a_new_table(interpreted_launches):
    first, new, rewritten = interpreted_launches["replaced"]
    assert first["launches"] == new["launches"] == rewritten["launches"] == [True]
    # a stale table would read the old tensor's values: value_ulps (checked for every call) catches it
    assert new["new_address"] and not new["was_cached"] and new["is_cached"], new
    assert rewritten["was_cached"], rewritten  # same addresses, same table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_launches_and_captured_graphs():
    results = _launch_results("cuda", dict(os.environ))
    assert all(r["launches"] == [True] for r in results["one"] + results["again"])
    assert all(r["launches"] == [False] * r["pieces"] for r in results["per_piece"])
    hit, miss = sorted(results["graph"], key=lambda r: not r["warm"])
    # the cached table, captured and kept through evictions; the replay read the right gradients
    assert hit["launches"] == [True] and hit["tables_added"] == 0 and hit["kept"], hit
    assert miss["launches"] == [False] * 3 and miss["tables_added"] == 0 and not miss["kept"], miss  # no copy
