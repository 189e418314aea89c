"""The per-matrix kernels of Dion3's selection (its norm and Newton–Schulz factor, its inverse for
the fused update) and of the row normalization (NorMuon, Dion3) against float64 math, and whole Dion3 / NorMuon steps through every fused
kernel against the float64 reference optimizer: on CPU under TRITON_INTERPRET=1 (in a
subprocess: the variable must be set before Triton is imported)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(TESTS), "src")

KERNEL_CASES = textwrap.dedent(
    """
    import importlib, json, sys, torch
    device = sys.argv[1]
    sel = importlib.import_module("dion3.kernels.selection")
    sel.BLOCK_SLOTS = 8      # several blocks of slots and rows per program
    gen = torch.Generator().manual_seed(0)
    results = []
    for n, r, k in [(3, 37, 11), (2, 40, 40), (1, 5, 1)]:
        squares = torch.rand(n, r, generator=gen, dtype=torch.float64) * 4
        rows = torch.stack([torch.randperm(r, generator=gen)[:k] for _ in range(n)]).to(device)  # any order
        plain, none = sel.selection_norm_triton(squares.float().to(device), rows)
        alone = sel.selection_positions(rows, r)  # nothing attached yet: its own launch
        norm, factor = sel.selection_norm_triton(squares.float().to(device), rows, 0.7, 1e-3, positions=True)
        norm, factor, rows = norm.cpu(), factor.cpu(), rows
        attached = sel.attached_positions(rows, r)
        exact = torch.stack([squares.float().double()[i, rows[i].cpu()].sum().sqrt() for i in range(n)]).view(n, 1, 1)
        exact_factor = 1.0 / (0.7 * exact + 1e-3)
        position = sel.selection_positions(rows, r)  # the attached one
        rows.add_(0)  # an in-place change: the attached inverse no longer counts
        stale = sel.attached_positions(rows, r)
        inverse = torch.full((n, r), -1, dtype=torch.int64)
        for i in range(n):
            for slot, row in enumerate(rows[i].cpu().tolist()):
                inverse[i, row] = slot
        results.append(dict(
            case=f"{n}x{r} k={k}",
            norm_rel=((norm.double() - exact).abs() / exact).max().item(),
            factor_rel=((factor.double() - exact_factor).abs() / exact_factor).max().item(),
            plain_same=bool(torch.equal(plain.cpu(), norm)) and none is None,
            shapes=[list(norm.shape), list(factor.shape)], dtypes=[str(norm.dtype), str(factor.dtype)],
            positions_exact=all(bool(torch.equal(p.long().cpu(), inverse)) and p.dtype == torch.int32 for p in (alone, position)),
            attached_reused=attached is not None and position is attached and stale is None))
    # the selection itself: top-k rows ascending, ties to the lower row, from scores with and
    # without ties (small integers, all zeros) over several blocks of rows; alone and with the norm
    for n, r, k, kind in [(3, 37, 11, "distinct"), (2, 29, 9, "ties"), (2, 21, 5, "zeros"), (2, 18, 18, "ties"),
                          (1, 9, 1, "distinct"), (2, 12, 5, "specials")]:
        if kind == "specials":  # NaN counts as +inf, −0 as +0
            scores = torch.tensor([[0.5, float("nan"), 0.0, -0.0, float("inf"), 2.0] * 2] * 2)
            scores[1] = scores[1].flip(0)
        elif kind == "distinct":
            scores = torch.rand(n, r, generator=gen) * 4
        elif kind == "ties":
            scores = torch.randint(0, 3, (n, r), generator=gen).float()
        else:
            scores = torch.zeros(n, r)
        squares = torch.rand(n, r, generator=gen, dtype=torch.float64)
        alone, _, _ = sel.top_rows_triton(scores.to(device), k)
        rows, norm, factor = sel.top_rows_triton(scores.to(device), k, squares.float().to(device), 0.7, 1e-3)
        key = torch.where(scores.isnan(), float("inf"), scores.abs())
        expected = torch.tensor([sorted(sorted(range(r), key=lambda j: (-key[i, j].item(), j))[:k]) for i in range(n)])
        exact = torch.stack([squares.float().double()[i, expected[i]].sum().sqrt() for i in range(n)]).view(n, 1, 1)
        results.append(dict(
            case=f"select {n}x{r} k={k} {kind}",
            rows_exact=bool(torch.equal(alone.cpu(), expected)) and bool(torch.equal(rows.cpu(), expected)),
            dtype=str(rows.dtype),
            norm_rel=((norm.cpu().double() - exact).abs() / exact).max().item(),
            factor_rel=((factor.cpu().double() - 1 / (0.7 * exact + 1e-3)).abs() * (0.7 * exact + 1e-3)).max().item(),
            inverse_attached=sel.attached_positions(rows, r) is not None))
    # row normalization from O's row norms, at selected rows of V or at all of them
    norm_mod = importlib.import_module("dion3.kernels.normalization")
    norm_mod.BLOCK_SLOTS = 8
    # guarded: matrix 1 has a NaN row norm, matrix 2 is above the limit (both skipped, old V kept)
    for n, r, k, cols, beta2, selected, guarded in [(3, 29, 13, 40, 0.95, True, False), (2, 21, 21, 7, 0.3, False, False),
                                                    (4, 29, 13, 40, 0.95, True, True)]:
        norms = torch.rand(n, k, generator=gen, dtype=torch.float64) * 2 + 0.1
        limit = float("inf")
        if guarded:
            norms[1, 3] = float("nan")
            norms[2] *= 10
            limit = float(norms[[0, 3]].pow(2).sum(1).sqrt().max()) * 1.01
        variance = torch.rand(n, r, 1, generator=gen, dtype=torch.float64) * 0.1
        rows = torch.stack([torch.randperm(r, generator=gen)[:k].sort().values for _ in range(n)]) if selected else None
        v = variance.float().to(device)
        scale, ok = norm_mod.row_normalization_triton(norms.float().to(device), v, None if rows is None else rows.to(device),
                                                      beta2, 1e-8, cols, limit)
        scale, ok, v = scale.cpu(), ok.cpu(), v.cpu()
        good = [i for i in range(n) if not (guarded and i in (1, 2))]
        skipped_kept = all(torch.equal(v[i], variance.float()[i]) and bool(torch.isnan(scale[i]).all())
                           for i in range(n) if i not in good)
        verdict = ok.tolist() == [i in good for i in range(n)] and ok.dtype == torch.bool
        scale, v, norms, variance = scale[good], v[good], norms[good], variance[good]
        rows = rows[good] if selected else None
        n = len(good)
        n_sq = norms.float().double() ** 2  # float64 math from the float32 inputs
        picks = rows if selected else torch.arange(r).expand(n, r)
        old = torch.stack([variance.float().double()[i, picks[i], 0] for i in range(n)])
        new = beta2 * old + (1 - beta2) * n_sq / cols
        inverse = 1 / (new.sqrt() + 1e-8)
        exact = inverse * (n_sq.sum(1, keepdim=True).sqrt() / (n_sq * inverse**2).sum(1, keepdim=True).sqrt())
        expected_v = variance.float().double().clone()
        for i in range(n):
            expected_v[i, picks[i], 0] = new[i]
        results.append(dict(
            case=f"normalization {n}x{r} k={k} selected={selected} guarded={guarded}",
            scale_rel=((scale.double() - exact).abs() / exact).max().item(),
            variance_rel=((v.double() - expected_v).abs() / expected_v).max().item(),
            shape=list(scale.shape), verdict=verdict, skipped_kept=skipped_kept))
    print(json.dumps(results))
    """
)

# Dion3 and NorMuon through the fused path (accumulate, selection norm, scaled snapshot, positions,
# post-update) with the exact polar factor, three steps, against the float64 reference optimizer.
STEP_CASES = textwrap.dedent(
    """
    import json, sys, torch
    import dion3, dion3.kernels as kernels, dion3.rules as rules
    from reference import ReferenceOptimizer, exact_padded_polar, exact_polar
    device = sys.argv[1]
    if device == "cpu":
        kernels._triton_ready = lambda device: True  # the CUDA dispatch, interpreted on CPU tensors
        kernels._half_dot_ready = lambda device: False  # (symmetric products: cuBLAS at these sizes on a GPU too)
    rules.orthogonalize_padded = exact_padded_polar
    calls, reused = {}, [0]
    for module, name in ((kernels._momentum_kernel, "accumulate_momentum_triton"),
                         (kernels._momentum_kernel, "snapshot_rows_triton"),
                         (kernels._selection_kernel, "selection_norm_triton"),
                         (kernels._selection_kernel, "top_rows_triton"),
                         (kernels._selection_kernel, "attached_positions"),
                         (kernels._normalization_kernel, "row_normalization_triton"),
                         (kernels._post_update_kernel, "post_update_triton")):
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            result = _real(*args, **kwargs)
            if _name == "attached_positions" and result is not None:
                reused[0] += 1
            return result
        setattr(module, name, counted)
    gen = torch.Generator().manual_seed(2)
    shapes = [(12, 20)] * 3 + [(24, 16)] * 2
    results = []
    for name, algorithm, make, extra in (("dion3", "dion3", dion3.Dion3, {}), ("normuon", "normuon", dion3.NorMuon, {}),
                                         ("dion3_l2", "dion3", dion3.Dion3, {"row_score": "l2"})):
        calls.clear()
        reused[0] = 0
        start = [torch.randn(s, generator=gen) for s in shapes]
        params = [torch.nn.Parameter(x.clone().to(device)) for x in start]  # start stays as it was
        options = dict(lr=0.02, mu=0.9, weight_decay=0.1)
        if algorithm == "dion3":
            options["fraction"] = 0.25
        options.update(extra)
        optimizer = make(params, **options)
        ref = ReferenceOptimizer(start, algorithm, **options)
        for _ in range(3):
            grads = [torch.randn(s, generator=gen) for s in shapes]
            for p, g in zip(params, grads):
                p.grad = g.to(device)
            optimizer.step()
            ref.step(grads)
        # the parameters' change against the reference's (the change is what the step computes)
        error = max(((p.detach().cpu().double() - r).abs().max() / (r - x.double()).abs().max()).item()
                    for p, r, x in zip(params, ref.params, start))
        results.append(dict(algorithm=name, error=error, calls=dict(calls), reused=reused[0]))
    print(json.dumps(results))
    """
)


def _run(script: str, device: str = "cpu"):
    """The script's last JSON line, run on device: the CPU under the interpreter, or a GPU."""
    triton = pytest.importorskip("triton")
    if device == "cpu" and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):  # run on 3.6 and 3.9
        pytest.skip(f"interpreter cases need Triton ≥ 3.6; have {triton.__version__}")
    env = dict(os.environ, DION3_CPU_NS_DTYPE="float32",
               PYTHONPATH=os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")]))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", script, device], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_kernel_cases(results) -> None:
    normalization = [r for r in results if r["case"].startswith("normalization")]
    selections = [r for r in results if r["case"].startswith("select")]
    results = [r for r in results if r not in normalization and r not in selections]
    assert len(results) == 3 and len(normalization) == 3 and len(selections) == 6
    for r in selections:  # the same rows as the hand-written rule; the norm as selection_norm's
        assert r["rows_exact"] and r["dtype"] == "torch.int64" and r["inverse_attached"], r
        assert r["norm_rel"] <= 1e-6 and r["factor_rel"] <= 1e-6, r
    for r in normalization:  # float32 math against float64 (unselected rows of V: exact)
        assert r["scale_rel"] <= 2e-6 and r["variance_rel"] <= 1e-6, r
        assert r["verdict"] and r["skipped_kept"], r  # the guard's verdict, and nothing written for a skip
        assert r["shape"] == [int(r["case"].split()[1].split("x")[0]), int(r["case"].split("k=")[1].split()[0])], r
    for r in results:
        assert r["norm_rel"] <= 1e-6 and r["factor_rel"] <= 1e-6, r  # float32 sums of ≤ 40 terms
        assert r["plain_same"] and r["positions_exact"] and r["attached_reused"], r
        assert r["shapes"] == [[int(r["case"][0]), 1, 1]] * 2 and r["dtypes"] == ["torch.float32"] * 2, r


def test_interpreted_selection_and_normalization_kernels_match_float64():
    _check_kernel_cases(_run(KERNEL_CASES))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_selection_and_normalization_kernels_match_float64():
    _check_kernel_cases(_run(KERNEL_CASES, "cuda"))


def _check_steps(results, tolerance: float) -> None:
    results = {r["algorithm"]: r for r in results}
    # every fused kernel ran, once per bucket and step (2 buckets, 3 steps); the selection and its
    # norm in one launch; the post-update and the guard's restore (which reads which rows were
    # selected) found the selection's inverse built with them: twice per bucket and step
    assert results["dion3"]["calls"] == {**{name: 6 for name in (
        "accumulate_momentum_triton", "top_rows_triton", "snapshot_rows_triton",
        "row_normalization_triton", "post_update_triton")}, "attached_positions": 12}, results["dion3"]
    assert results["dion3"]["reused"] == 12, results["dion3"]
    # rows ranked by L2 norms (row_score="l2"): the same launches, the reference's L2 ranking
    assert results["dion3_l2"]["calls"] == results["dion3"]["calls"], results["dion3_l2"]
    assert results["normuon"]["calls"] == {name: 6 for name in (
        "accumulate_momentum_triton", "row_normalization_triton", "post_update_triton")}, results["normuon"]
    for r in results.values():
        assert r["error"] <= tolerance, r


def test_interpreted_fused_steps_match_float64_reference():
    _check_steps(_run(STEP_CASES), 1e-4)  # float32 parameters (their rounding: ~2e-5 of the change here)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fused_steps_match_float64_reference():
    # Dion3's snapshot is Newton–Schulz's fp16 input on a GPU, and its O comes back in fp16
    _check_steps(_run(STEP_CASES, "cuda"), 1e-2)


def test_cpu_selection_norm_matches_float64():
    from dion3.kernels import selection_norm

    gen = torch.Generator().manual_seed(3)
    squares = torch.rand(4, 30, generator=gen, dtype=torch.float64) * 3
    rows = torch.stack([torch.randperm(30, generator=gen)[:7] for _ in range(4)])
    norm, factor = selection_norm(squares.float(), rows, 1.3, 1e-4)
    exact = torch.stack([squares.float().double()[i, rows[i]].sum().sqrt() for i in range(4)]).view(4, 1, 1)
    assert torch.allclose(norm.double(), exact, rtol=1e-6, atol=0)
    assert torch.allclose(factor.double(), 1.0 / (1.3 * exact + 1e-4), rtol=1e-6, atol=0)
    assert selection_norm(squares.float(), rows)[1] is None
