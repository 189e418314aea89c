"""Triton kernels against float64 references: on CPU under TRITON_INTERPRET=1 (in a subprocess,
since the variable must be set before Triton is imported), on GPU compiled; plus the dispatch."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dion3.kernels as kernels

HERE = Path(__file__).resolve().parent
triton = pytest.importorskip("triton", reason="Triton is not installed: the kernels cannot run here")
from dion3.kernels import hopper_tiling  # noqa: E402  (pure Python; needs Triton for the tile order)
_skip_without_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU-only check)")


def needs_cuda(test):
    """GPU-only test: marked `gpu` (so `pytest -m gpu` selects it) and skipped without CUDA."""
    return pytest.mark.gpu(_skip_without_cuda(test))


@pytest.fixture(scope="module")
def interpreted_results():
    # Triton 3.6's interpreter gives a loop its runtime bound through int() of a 1-element array,
    # which NumPy 2.4 refuses (triton-lang/triton#9171). The other kernels loop with while for it;
    # the matmul's K loop stays a for loop, the only form Triton software-pipelines.
    import numpy

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split(".")[:2])

    if version(triton.__version__) < (3, 9) and version(numpy.__version__) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over a runtime K with NumPy "
                    f"{numpy.__version__}")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(HERE / "kernel_cases.py"), "cpu"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(r["kind"], r["case"], r.get("dtype")): r for r in map(json.loads, done.stdout.splitlines())}


def _results_of(results, kind):
    return [r for key, r in results.items() if key[0] == kind]


def test_interpreted_symmetric_matmul_matches_float64(interpreted_results):
    cases = _results_of(interpreted_results, "symmetric")
    assert len(cases) == 22  # 11 shapes × fp16, bf16
    for r in cases:
        assert r["shape_ok"] and r["dtype_ok"] and r["finite"], r
        assert r["symmetric"], f"output not exactly symmetric: {r}"
        assert r["error"] <= r["tol"], r


def test_interpreted_diagonal_panels_fill_only_their_blocks(interpreted_results):
    cases = _results_of(interpreted_results, "panels")
    assert len(cases) == 6  # 3 shapes × fp16, bf16
    for r in cases:
        assert r["untouched"], f"wrote outside the diagonal blocks: {r}"
        assert r["finite"] and r["symmetric"], r
        assert r["error"] <= r["tol"], r


def test_interpreted_split_product_matches_float64(interpreted_results):
    cases = _results_of(interpreted_results, "split")
    assert len(cases) == 6  # 3 shapes × fp16, bf16
    for r in cases:
        assert r["finite"] and r["symmetric"], r
        assert r["error"] <= r["tol"], r


def test_interpreted_transpose_copy_is_exact(interpreted_results):
    assert interpreted_results[("transpose", "strided_odd", None)]["ok"]


def test_interpreted_scaled_transpose_rounds_once(interpreted_results):
    cases = _results_of(interpreted_results, "scaled_transpose")
    assert len(cases) == 3  # fp16, bf16, fp32 outputs
    for r in cases:
        # float32 product, one rounding (the interpreter's bf16 conversion truncates: < 2 ulps)
        assert r["ulps"] <= 2.0 and r["source_unchanged"], r


@pytest.mark.parametrize("batch,n,k,operand", [(1, 6, 5, "gram"), (3, 10, 7, "gram_c"), (2, 8, 8, "square")])
def test_split_composition_matches_float64(batch, n, k, operand):
    """The split product's blocks (dense lower-left, mirrored upper-right, diagonal blocks)
    assemble the whole product: PyTorch pieces here, the Triton pieces in the interpreter run."""
    from dion3.kernels.split import split_symmetric_matmul

    g = torch.Generator().manual_seed(batch * n)
    a = torch.randn(batch, n, k, generator=g, dtype=torch.float64)
    b, c, alpha, beta = a.mT, None, 1.5, 0.0
    if operand == "gram_c":
        s = torch.randn(batch, n, n, generator=g, dtype=torch.float64)
        c, alpha, beta = s + s.mT, 0.5, 2.0
    elif operand == "square":
        r = torch.randn(batch, n, n, generator=g, dtype=torch.float64)
        a = b = c = r + r.mT
        alpha, beta = 0.7, -1.3
    exact = alpha * (a @ b) + (0.0 if c is None else beta * c)
    torch.testing.assert_close(split_symmetric_matmul(a, b, c, alpha, beta), exact, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="even n"):
        split_symmetric_matmul(a[:, :-1], b[:, :, :-1], None, 1.0, 0.0)


def test_interpreted_post_update_rounds_once(interpreted_results):
    cases = _results_of(interpreted_results, "post_update")
    assert len(cases) == 36  # 3 dtypes × rows/all × float/tensor scalars × no/[N,k]/[N,k,1] row factors
    for r in cases:
        # within one ulp of the float64 result (the interpreter truncates to bf16)
        assert r["ok"], r


def test_lower_tile_count_matches_brute_force(interpreted_results):
    assert interpreted_results[("tiles", "lower_tile_count", None)]["ok"]


def test_cpu_dispatch_uses_reference():
    a = torch.randn(3, 20, 30)
    c = torch.randn(3, 20, 20)
    out = kernels.symmetric_matmul(a, a.mT, c, alpha=0.5, beta=2.0)
    exact = 0.5 * a.double() @ a.double().mT + 2.0 * c.double()
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-4)
    assert not kernels.symmetric_kernels_available(torch.device("cpu"))
    assert not kernels.symmetric_kernels_available("cpu", 4096)


@pytest.mark.parametrize("scaled", [False, True])
def test_cpu_dispatch_post_update_float64_math(scaled):
    p = torch.randn(2, 6, 5)
    before = p.double().clone()
    update = torch.randn(2, 3, 5)
    rows = torch.tensor([[0, 2, 5], [1, 3, 4]])
    factors = torch.rand(2, 3) + 0.5
    kernels.post_update([p], update, rows, 0.5, 0.25, row_scale=factors.unsqueeze(-1) if scaled else None)
    expected = before * 0.5
    for m in range(2):
        for position, row in enumerate(rows[m].tolist()):
            factor = factors[m, position].item() if scaled else 1.0
            expected[m, row] -= 0.25 * factor * update[m, position].double()
    assert torch.allclose(p.double(), expected, rtol=1e-6, atol=1e-6)


def test_post_update_rejects_misshapen_row_scale():
    p = torch.randn(2, 6, 5)
    before = p.clone()
    with pytest.raises(ValueError, match="row_scale must have shape"):
        kernels.post_update([p], torch.randn(2, 6, 5), None, 0.5, 0.25, row_scale=torch.ones(2, 5))
    assert torch.equal(p, before)


def test_switch_toggles_and_env_variable_disables():
    assert kernels.kernels_enabled()
    try:
        kernels.set_kernels_enabled(False)
        assert not kernels.kernels_enabled()
        assert not kernels.symmetric_kernels_available("cuda")
    finally:
        kernels.set_kernels_enabled(True)
    code = "import dion3.kernels as k; print(k.kernels_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, DION3_KERNELS="0"),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_bad_shapes_raise_value_error():
    from dion3.kernels.symmetric_matmul import symmetric_matmul_triton

    a = torch.randn(2, 8, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="b must have shape"):
        symmetric_matmul_triton(a, torch.randn(2, 8, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype"):
        symmetric_matmul_triton(a.float(), a.float().mT)
    with pytest.raises(ValueError, match="panels must divide"):
        symmetric_matmul_triton(a, a.mT, panels=3, out=torch.empty(2, 8, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="pass the output tensor"):
        symmetric_matmul_triton(a, a.mT, panels=2)
    with pytest.raises(ValueError, match="out must be"):
        symmetric_matmul_triton(a, a.mT, out=torch.empty(2, 8, 8))


def test_empty_reduction_fills_only_the_diagonal_blocks_it_owns():
    """k = 0: D = beta·C on the diagonal blocks; with panels the rest of out stays as it was."""
    from dion3.kernels.symmetric_matmul import symmetric_matmul_triton

    a = torch.empty(2, 8, 0, dtype=torch.float16)
    c = torch.arange(128, dtype=torch.float16).view(2, 8, 8)
    out = torch.full((2, 8, 8), 7.0, dtype=torch.float16)
    symmetric_matmul_triton(a, a.mT, c, 1.0, 2.0, panels=2, out=out)
    expected = torch.full((2, 8, 8), 7.0, dtype=torch.float16)
    expected[:, :4, :4], expected[:, 4:, 4:] = 2 * c[:, :4, :4], 2 * c[:, 4:, 4:]
    assert torch.equal(out, expected)
    assert torch.equal(symmetric_matmul_triton(a[0], a[0].mT), torch.zeros(8, 8, dtype=torch.float16))


def test_hopper_kernel_builds_for_sm90_without_a_gpu():
    """The Gluon kernel's fourteen specializations (K-major/row-major B, with/without C,
    bf16/fp16, 128×256 tiles with 3 and 4 stages, 128×128 tiles with 5 and 6 stages and either
    epilogue, and with one consumer warpgroup, A copied on the way) compile to sm_90a with the installed Triton and ptxas
    (tests/compile_sm90.py) and fit the 227 KB of shared memory an sm90 block may have:
    catches drift in Triton's experimental Gluon API on machines without a Hopper GPU."""
    from dion3.kernels.symmetric_matmul_hopper import GLUON_AVAILABLE

    if not GLUON_AVAILABLE:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API: the Triton kernel runs instead")
    script = HERE / "compile_sm90.py"
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "src"))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if " ok: " in line or "FAILED" in line]
    assert done.returncode == 0 and len(lines) == 14 and all(" ok: " in line for line in lines), done.stdout[-3000:]
    shared = [int(re.search(r"shared (\d+) B", line).group(1)) for line in lines]
    assert max(shared) <= 227 * 1024, shared


def _stand_in_for_the_kernel(monkeypatch, hopper, jit):
    """Launch `jit` (a CPU stand-in for the Gluon kernel's JIT launch) in place of the kernel,
    with the 128×128 tiling unless one is asked for, no specialization launched yet and direct
    launches on."""
    monkeypatch.setattr(hopper, "_symmetric_matmul_hopper_kernel", jit)
    monkeypatch.setattr(hopper, "pick_tiling", lambda *args, tiling=None, **kwargs: tiling or hopper_tiling.NARROW)
    monkeypatch.setattr(hopper, "_launched", {})
    monkeypatch.setattr(hopper, "ENABLED", True)
    monkeypatch.setattr(hopper, "DIRECT_LAUNCH", True)


def test_hopper_launches_keep_no_tensor_alive(monkeypatch):
    """Nothing a launch builds outlives it (descriptors hold their tensors, and a cache of them
    kept freed activations alive: the Llama-8B step ran out of memory on the H200), also not
    what the direct launch keeps (the compiled kernel only)."""
    import gc
    import weakref

    from dion3.kernels import symmetric_matmul_hopper as hopper

    if not hopper.GLUON_AVAILABLE:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API")

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: None

    class Jit:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    _stand_in_for_the_kernel(monkeypatch, hopper, Jit())
    a = torch.zeros(2, 256, 128, dtype=torch.bfloat16)
    out = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    for _ in range(2):  # through the JIT, then directly
        hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out, copy_a=torch.empty_like(a))
    assert len(hopper._launched) == 1
    alive = [weakref.ref(a), weakref.ref(out)]
    del a, out
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_hopper_launch_passes_each_descriptor_once(monkeypatch):
    """Each TMA descriptor argument costs host time per launch, so one the kernel already has
    under another name goes as None: A·Aᵀ on square tiles passes 3 (A for both operands, the
    tile of D for both orientations, D's diagonal blocks), R·R + C 5, A·Aᵀ on 128×256 tiles 5."""
    from dion3.kernels import symmetric_matmul_hopper as hopper

    if not hopper.GLUON_AVAILABLE:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API")
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append([type(x).__name__ for x in args[:7]])

    monkeypatch.setattr(hopper, "_symmetric_matmul_hopper_kernel", Recorder())
    monkeypatch.setattr(hopper, "pick_tiling", lambda *args, tiling=None, **kwargs: tiling or hopper_tiling.NARROW)
    monkeypatch.setattr(hopper, "_launch_or_fall_back", lambda key, launch: launch() or True)
    a = torch.zeros(2, 256, 128, dtype=torch.bfloat16)
    r = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    out = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out)
    hopper.symmetric_matmul_hopper(r, r, r, 0.9, -1.7, out)
    hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out, tiling=hopper_tiling.WIDE)
    #          a, b, c, d, dt, dq, y
    none, desc = "NoneType", "TensorDescriptor"
    assert launched[0] == [desc, none, none, desc, none, desc, none]
    assert launched[1] == [desc, desc, desc, desc, none, desc, none]
    assert launched[2] == [desc, desc, none, desc, desc, desc, none]


def test_hopper_reads_a_symmetric_right_factor_along_k_on_wide_tiles_only(monkeypatch):
    """b_symmetric lets the kernel read a row-major R as Rᵀ: on 128×256 tiles (measured faster
    there), not on 128×128 tiles (measured level or slower), never without the promise."""
    from dion3.kernels import symmetric_matmul_hopper as hopper

    if not hopper.GLUON_AVAILABLE:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API")
    k_major = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: k_major.append(args[14])  # the kernel's B_KMAJOR

    monkeypatch.setattr(hopper, "_symmetric_matmul_hopper_kernel", Recorder())
    monkeypatch.setattr(hopper, "_launch_or_fall_back", lambda key, launch: launch() or True)
    r = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    out = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    for tiling, promise in ((hopper_tiling.WIDE, True), (hopper_tiling.NARROW, True), (hopper_tiling.WIDE, False)):
        monkeypatch.setattr(hopper, "pick_tiling", lambda *args, t=tiling, **kwargs: t)
        hopper.symmetric_matmul_hopper(r, r, r, 0.9, -1.7, out, b_symmetric=promise)
    assert k_major == [True, False, False]


def test_hopper_direct_launch_passes_what_the_jit_would_bind(monkeypatch):
    """After a specialization's first (JIT) launch, later launches with the same key call the
    compiled kernel directly with every parameter in the kernel's own order, bound to the same
    values the JIT call binds; a launch that the JIT would specialize differently (no C vs C,
    B shared with A or not) goes through the JIT again; DIRECT_LAUNCH off: always the JIT."""
    from dion3.kernels import symmetric_matmul_hopper as hopper

    if not hopper.GLUON_AVAILABLE:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API")
    names = hopper._symmetric_matmul_hopper_kernel.arg_names
    calls = []

    blocks = []  # the JIT launches' descriptors' block shapes

    def values(bound):  # descriptors by their tensor's address and 2-D view, the rest as they are
        blocks.append({k: tuple(v.block_shape) for k, v in bound.items() if hasattr(v, "block_shape")})
        return {k: (v.base.data_ptr(), tuple(v.shape), tuple(v.strides)) if hasattr(v, "base") else v
                for k, v in bound.items()}

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: calls.append(("direct", grid, values(dict(zip(names, args, strict=True)))))

    class Jit:
        def __getitem__(self, grid):
            def run(*args, maxnreg, **kwargs):
                calls.append(("jit", grid, values({**dict(zip(names, args)), **kwargs})))
                return Compiled()
            return run

    _stand_in_for_the_kernel(monkeypatch, hopper, Jit())
    a = torch.zeros(2, 256, 128, dtype=torch.bfloat16)
    b = torch.zeros(2, 128, 256, dtype=torch.bfloat16)
    r = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    out = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out)
    hopper.symmetric_matmul_hopper(a, a.mT, None, 0.5, 0.0, out)
    hopper.symmetric_matmul_hopper(r, r, r, 0.9, -1.7, out)
    hopper.symmetric_matmul_hopper(a, b, None, 1.0, 0.0, out)
    hopper.symmetric_matmul_hopper(r, r, r, 0.8, -1.5, out)
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "jit", "direct"]
    assert calls[1][1] == calls[0][1] == (hopper.lower_tile_count(256, 128, 128) * 2, 1, 1)
    assert calls[1][2] == {**calls[0][2], "alpha": 0.5}
    assert calls[4][2] == {**calls[2][2], "alpha": 0.8, "beta": -1.5}
    # By name, hand-derived: 256 rows in 128×128 tiles = 3 lower tiles; B = Aᵀ shares A's
    # descriptor; D's tile and its transpose share one.
    flat_out = (out.data_ptr(), (512, 256), (256, 1))
    expected = dict(a_desc=(a.data_ptr(), (512, 128), (128, 1)), b_desc=None, c_desc=None, d_desc=flat_out,
                    dt_desc=None, dq_desc=flat_out, y_desc=None, n=256, K=128, panels=1, tiles=3, alpha=1.0,
                    beta=0.0, HAS_C=False, B_KMAJOR=True, RATIO=1, COPY_A=False, NUM_STAGES=5, A_SLOTS=5,
                    EPILOGUE_IN_RING=False, num_warps=8)
    assert {k: calls[0][2][k] for k in expected} == expected
    assert blocks[0] == dict(a_desc=(128, 64), d_desc=(128, 128), dq_desc=(128, 64)) and blocks[1] == {}
    monkeypatch.setattr(hopper, "_launched", {})
    monkeypatch.setattr(hopper, "DIRECT_LAUNCH", False)
    calls.clear()
    for _ in range(2):
        hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out)
    assert [c[0] for c in calls] == ["jit", "jit"]


def test_hopper_direct_launch_failing_in_the_launcher_falls_back_to_the_jit(monkeypatch):
    """A launcher that rejects the reduced descriptors (another Triton release) turns direct
    launches off with one RuntimeWarning, and the product is launched through the JIT, with
    full descriptors, from then on."""
    from dion3.kernels import symmetric_matmul_hopper as hopper

    if not hopper.GLUON_AVAILABLE:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API")
    calls = []

    class Compiled:
        def __getitem__(self, grid):
            def run(*args):
                calls.append("direct")
                raise AttributeError("'_LaunchDescriptor' object has no attribute 'block_shape'")
            return run

    class Jit:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("jit", type(args[0]).__name__))
                return Compiled()
            return run

    _stand_in_for_the_kernel(monkeypatch, hopper, Jit())
    a = torch.zeros(2, 256, 128, dtype=torch.bfloat16)
    out = torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    assert hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out)
    with pytest.warns(RuntimeWarning, match="through Triton's JIT from now on"):
        assert hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out)
    assert hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out)
    jit = ("jit", "TensorDescriptor")
    assert calls == [jit, "direct", jit, jit] and not hopper.DIRECT_LAUNCH and len(hopper._launched) == 1


def test_hopper_kernel_failing_to_build_falls_back_once_with_a_warning(monkeypatch):
    """A Gluon specialization that fails on first use (an untested Triton release) switches the
    kernel off with one RuntimeWarning and reports False, so the caller runs the Triton kernel;
    a specialization that already ran re-raises its errors instead of hiding them."""
    from dion3.kernels import symmetric_matmul_hopper as hopper

    monkeypatch.setattr(hopper, "ENABLED", True)
    monkeypatch.setattr(hopper, "_launched", {})
    calls = []
    assert hopper._launch_or_fall_back("good", lambda: calls.append("good")) and calls == ["good"]

    def broken():
        raise RuntimeError("PassManager::run failed")

    with pytest.warns(RuntimeWarning, match="Triton kernel from now on"):
        assert hopper._launch_or_fall_back("new", broken) is False
    assert hopper.ENABLED is False and "new" not in hopper._launched
    with pytest.raises(RuntimeError, match="PassManager"):
        hopper._launch_or_fall_back("good", broken)


# ----------------------------------------------------------------------------- GPU only
@needs_cuda
def test_gpu_kernel_cases_match_float64():
    sys.path.insert(0, str(HERE))
    import kernel_cases

    for r in kernel_cases.run_all("cuda"):
        if r["kind"] == "symmetric":
            assert r["shape_ok"] and r["finite"] and r["symmetric"] and r["error"] <= r["tol"], r
        elif r["kind"] in ("panels", "split"):
            assert r["finite"] and r["symmetric"] and r["error"] <= r["tol"] and r.get("untouched", True), r
        elif r["kind"] in ("post_update", "scaled_transpose"):
            assert r["ulps"] <= 0.55, r  # round to nearest on hardware: half an ulp (+ fp32 slack)
            assert r.get("source_unchanged", True), r
        else:
            assert r["ok"], r


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,n,k,square,split", [(1, 1024, 2048, False, False), (4, 777, 1000, False, False),
                                                    (2, 1536, 1536, True, False), (1, 2304, 4096, False, False),
                                                    (2, 2048, 3072, False, True), (2, 2048, 2048, True, True)])
def test_gpu_error_no_worse_than_twice_cublas(dtype, batch, n, k, square, split):
    from dion3.kernels.symmetric_matmul import symmetric_matmul_triton

    if split:  # the split product through the dispatch (dense block on cuBLAS)
        symmetric_matmul_triton = lambda a, b, c, alpha, beta: kernels.symmetric_matmul(a, b, c, alpha, beta, split=True)  # noqa: E731
    torch.manual_seed(0)
    if square:
        x = torch.randn(batch, n, n, device="cuda", dtype=torch.float64)
        a = b = c = (x + x.mT).div_(n ** 0.5).to(dtype)
        alpha, beta = 0.8, -1.5
    else:
        a = torch.randn(batch, n, k, device="cuda").to(dtype)
        b, c, alpha, beta = a.mT, None, 1.0, 0.0
    exact = alpha * (a.double() @ b.double()) + (0 if c is None else beta * c.double())
    cublas = alpha * torch.matmul(a, b) + (0 if c is None else beta * c)
    ours = symmetric_matmul_triton(a, b, c, alpha, beta)
    ours_error = (ours.double() - exact).abs().max()
    cublas_error = (cublas.double() - exact).abs().max()
    assert torch.equal(ours, ours.mT)
    assert ours_error <= 2 * cublas_error, (float(ours_error), float(cublas_error))


@needs_cuda
@pytest.mark.parametrize("batch,n", [(32, 1024), (2, 1536), (1, 4096)])
def test_gpu_symmetric_right_factor_read_transposed_stays_exact(batch, n):
    """b_symmetric: the kernel reads R as Rᵀ (same values); the product must stay within twice
    cuBLAS's error of float64 and exactly symmetric, like the row-major read."""
    torch.manual_seed(0)
    x = torch.randn(batch, n, 2 * n, device="cuda").div_((2 * n) ** 0.5).bfloat16()
    r = kernels.symmetric_matmul(x, x.mT)
    assert torch.equal(r, r.mT)  # the kernels' outputs are exactly symmetric: the flag's premise
    exact = 0.9 * (r.double() @ r.double()) - 1.7 * r.double()
    cublas_error = ((0.9 * torch.matmul(r, r) - 1.7 * r).double() - exact).abs().max()
    for flag in (False, True):
        out = kernels.symmetric_matmul(r, r, r, alpha=0.9, beta=-1.7, b_symmetric=flag)
        assert torch.equal(out, out.mT), flag
        assert (out.double() - exact).abs().max() <= 2 * cublas_error, flag


def test_symmetric_right_factor_flag_leaves_the_reference_path_alone():
    """Off the kernels (CPU) b_symmetric changes nothing, bit for bit, even for a b that is
    only symmetric up to rounding (as a CPU A·Aᵀ is)."""
    torch.manual_seed(0)
    x = torch.randn(3, 40, 70)
    r = x @ x.mT
    plain = kernels.symmetric_matmul(r, r, r, alpha=0.9, beta=-1.7)
    flagged = kernels.symmetric_matmul(r, r, r, alpha=0.9, beta=-1.7, b_symmetric=True)
    assert torch.equal(plain, flagged)
    exact = 0.9 * (r.double() @ r.double()) - 1.7 * r.double()
    assert float((flagged.double() - exact).abs().max() / exact.abs().max()) < 1e-5


@needs_cuda
def test_gpu_dispatch_uses_kernel_and_orthogonalize_stays_accurate():
    from dion3.tools.bench.kernel_time import float64_newton_schulz
    from dion3.ortho.newton_schulz import orthogonalize

    assert kernels.symmetric_kernels_available("cuda", 1024)
    assert not kernels.symmetric_kernels_available("cuda", kernels.SYMMETRIC_MIN_N - 1)
    x = torch.randn(4, 1024, 3072, device="cuda")
    exact = float64_newton_schulz(x)
    for method in ("newton_schulz", "gram"):
        out = orthogonalize(x, method=method)
        assert float((out.double() - exact).norm() / exact.norm()) < 2e-2, method


def test_long_c_free_reductions_get_the_deeper_pipeline_on_hopper():
    from dion3.kernels.configs import HOPPER_LONG_REDUCTION, pick_config, uses_long_reduction_config

    assert pick_config(4096, 9, k=16384, has_c=False) == HOPPER_LONG_REDUCTION
    assert pick_config(4096, 9, k=16384, has_c=True) != HOPPER_LONG_REDUCTION  # a C term: 3 stages
    assert pick_config(4096, 9, k=4096, has_c=False) != HOPPER_LONG_REDUCTION  # k ≈ n: 3 stages
    assert pick_config(4096, 8, k=16384, has_c=False) != HOPPER_LONG_REDUCTION  # Ampere table
    assert pick_config(4096, None, k=16384, has_c=False).block_m == 32  # interpreter: portable
    assert not uses_long_reduction_config(4096, 16384, False, 8)  # measured on Hopper only


def test_hopper_tiling_rule_follows_wave_counts():
    """The Gluon kernel's default tiling on a 132-SM H200, from tile counts worked out by hand:
    lower-triangle tiles of an n×n block are Σ_i (i // r + 1) over its 128-row blocks, r = width/128."""
    from dion3.kernels.hopper_tiling import NARROW, WIDE, WIDE_LONG, default_tiling

    sms = 132  # 4 waves = 528 tiles, 6 waves = 792
    # 8192²: 64 row blocks, Σ (i//2 + 1) = 2·(1 + … + 32) = 1056 wide tiles ≥ 792
    assert default_tiling(1, 1, 8192, 8192, False, sms) == WIDE  # K < 16384: 3 stages
    assert default_tiling(1, 1, 8192, 28672, False, sms) == WIDE_LONG  # long C-free reduction: the ring
    assert default_tiling(1, 1, 8192, 28672, True, sms) == WIDE  # a C term keeps C early
    # 4096²: 32 row blocks, 2·(1 + … + 16) = 272 wide tiles < 792, but 1 + … + 32 = 528 square ones
    assert default_tiling(1, 1, 4096, 16384, False, sms) == NARROW
    assert default_tiling(1, 1, 4096, 4096, True, sms) == NARROW
    # 2 × 4096²: 544 wide tiles < 792 (and > 132): square tiles, 1056 of them
    assert default_tiling(2, 1, 4096, 4096, False, sms) == NARROW
    assert default_tiling(3, 1, 4096, 4096, False, sms) == WIDE  # 816 wide tiles ≥ 792
    # 2048 rows, one matrix: 2·(1 + … + 8) = 72 wide tiles fit one wave; C-free only
    assert default_tiling(1, 1, 2048, 8192, False, sms) == WIDE
    assert default_tiling(1, 1, 2048, 2048, True, sms) is None  # 72 wide < 792, 136 square < 528
    # n = 1024: 2048 is the wide tiles' floor; 32 × (1 + … + 8) = 1152 square tiles ≥ 528
    assert default_tiling(32, 1, 1024, 4096, False, sms) == NARROW
    assert default_tiling(14, 1, 1024, 1024, True, sms) is None  # 14 × 36 = 504 < 528
    assert default_tiling(15, 1, 1024, 1024, True, sms) == WIDE  # 540: a short square product takes wide tiles
    assert default_tiling(15, 1, 1024, 1024, False, sms) == WIDE
    assert default_tiling(64, 1, 1024, 1025, True, sms) == NARROW  # a reduction longer than the block
    assert default_tiling(15, 1, 1152, 1152, True, sms) == NARROW  # 1152 is no multiple of 256
    assert default_tiling(64, 1, 512, 2048, False, sms) is None  # below 1024 rows: Triton kernel
    assert default_tiling(8, 1, 1152, 4096, False, sms) is None  # 1152 = 9·128 rows: 8 × 45 = 360 < 528
    assert default_tiling(16, 1, 1152, 4096, False, sms) == NARROW  # 720
    # the diagonal blocks of a split product count per block: 2 panels of 2048 = 2 × 72 wide tiles
    assert default_tiling(4, 2, 2048, 2048, False, sms) == NARROW  # 576 wide < 792; 4 × 2 × 136 square
    assert default_tiling(6, 2, 2048, 2048, False, sms) == WIDE  # 864 wide tiles


@needs_cuda
@pytest.mark.parametrize("batch,rows,cols,method", [(12, 2048, 2048, "newton_schulz"), (4, 1024, 4096, "gram")])
def test_gpu_orthogonalize_through_split_and_long_reduction_paths(batch, rows, cols, method, monkeypatch):
    """Batches whose X·Xᵀ goes through the split product (12×2048²) or the 4-stage long-reduction
    config (R of 4×1024×4096 in Gram NS) stay within 2e-2 of float64 standard NS."""
    from dion3.tools.bench.kernel_time import float64_newton_schulz
    from dion3.ortho.newton_schulz import orthogonalize

    from dion3.kernels import symmetric_matmul_hopper

    x = torch.randn(batch, rows, cols, device="cuda")
    if method == "newton_schulz":  # on Hopper the Gluon kernel takes this whole product: keep it off
        monkeypatch.setattr(symmetric_matmul_hopper, "ENABLED", False)
        assert kernels.split_worth_it(x.to(torch.bfloat16), has_c=False)
    exact = float64_newton_schulz(x)
    out = orthogonalize(x, method=method)
    assert float((out.double() - exact).norm() / exact.norm()) < 2e-2


@needs_cuda
@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
def test_gpu_tall_inputs_and_normalized_snapshots_stay_accurate(method):
    """Tall inputs are normalized into the wide orientation by the scaled transposed copy and
    come back contiguous through the tiled transpose; a Dion3-style normalized snapshot
    (orthogonalize(..., normalized=True)) gives what orthogonalizing U gives."""
    from dion3 import rules
    from dion3.tools.bench.kernel_time import float64_newton_schulz
    from dion3.ortho import input_scaling
    from dion3.ortho.newton_schulz import orthogonalize

    x = torch.randn(4, 3072, 1024, device="cuda")
    exact = float64_newton_schulz(x)
    out = orthogonalize(x, method=method)
    assert out.is_contiguous() and out.shape == x.shape
    assert float((out.double() - exact).norm() / exact.norm()) < 2e-2

    momentum = torch.randn(4, 4096, 2048, device="cuda")
    cfg = rules.RuleConfig(fraction=0.25, mu=0.9)
    scaling = input_scaling(1024, 2048, "cuda", method)
    plain_m = momentum.clone()
    u, rows, _, _ = rules.pre_step(plain_m, torch.zeros_like(momentum), cfg)
    snapshot, rows_s, _, normalized = rules.pre_step(momentum, torch.zeros_like(momentum), cfg, scaling=scaling)
    assert normalized and snapshot.dtype == scaling.dtype and torch.equal(rows, rows_s)
    torch.testing.assert_close(momentum, plain_m, rtol=0, atol=0)
    from_snapshot = rules.orthogonalize_rows(snapshot, method, "polar_express", normalized=True)
    reference = float64_newton_schulz(u)
    assert float((from_snapshot.double() - reference).norm() / reference.norm()) < 2e-2


HOPPER_TILINGS = ("wide", "wide_long", "narrow", "narrow_ring", "pair")
HOPPER_SHAPES = ((3, 512, 320, "gram", 1), (2, 768, 256, "square", 1), (2, 1024, 448, "gram_c", 1),
                 (2, 1024, 512, "contig", 1), (2, 1024, 384, "square", 2), (1, 2048, 1024, "gram", 2),
                 (2, 640, 192, "gram_c", 1), (3, 384, 128, "square", 1))  # the last two: 128×128 tiles only


def _hopper_tiling(name):
    from dataclasses import replace

    from dion3.kernels import symmetric_matmul_hopper as hopper

    if name == "narrow_ring":
        return replace(hopper_tiling.NARROW, stages=6, epilogue_in_ring=True)
    if name == "pair":  # one consumer warpgroup, two programs per SM
        return hopper_tiling.Tiling(128, 3, True, 128, consumer_warps=4)
    return hopper_tiling.TILINGS[name]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,n,k,product,panels,tiling",
                         [shape + (tiling,) for shape in HOPPER_SHAPES for tiling in HOPPER_TILINGS
                          if (shape[1] // shape[4]) % (256 if tiling.startswith("wide") else 128) == 0])
def test_gpu_hopper_kernel_matches_float64(dtype, batch, n, k, product, panels, tiling):
    """The warp-specialized Gluon kernel (Hopper only): every element written once (NaN-poisoned
    output), exactly symmetric, error ≤ 2× cuBLAS's against float64, for K-major and row-major
    B, with and without C, whole and on the diagonal blocks only (the rest left untouched), with
    each tiling: 128×256 tiles with 3 stages (own epilogue tile, C loaded early) and 4 (epilogue
    in the drained rings), 128×128 tiles with either epilogue and with one consumer warpgroup."""
    from dion3.kernels.symmetric_matmul_hopper import GLUON_AVAILABLE, symmetric_matmul_hopper

    if torch.cuda.get_device_capability()[0] != 9 or not GLUON_AVAILABLE:
        pytest.skip("the Gluon kernel runs on sm90 with a Triton that has Gluon")
    g = torch.Generator(device="cuda").manual_seed(n + k)
    c, alpha, beta = None, 1.0, 0.0
    if product == "square":  # 0.8·R·R − 1.5·R with R symmetric, B = R row-major
        x = torch.randn(batch, n, n, device="cuda", generator=g, dtype=torch.float64)
        a = b = c = ((x + x.mT) / n ** 0.5).to(dtype)
        alpha, beta = 0.8, -1.5
    else:
        a = (torch.randn(batch, n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        b = a.mT.contiguous() if product == "contig" else a.mT
        if product == "gram_c":
            s = torch.randn(batch, n, n, device="cuda", generator=g)
            c, alpha, beta = (s + s.mT).to(dtype), 0.5, 2.0
    out = torch.full((batch, n, n), float("nan"), dtype=dtype, device="cuda")
    assert symmetric_matmul_hopper(a, b, c, alpha, beta, out, panels, any_size=True, tiling=_hopper_tiling(tiling))
    exact = alpha * (a.double() @ b.double()) + (0 if c is None else beta * c.double())
    cublas = torch.baddbmm(c, a, b, alpha=alpha, beta=beta) if c is not None else torch.matmul(a, b)
    size = n // panels
    for p in range(panels):
        block = slice(p * size, (p + 1) * size)
        ours = out[:, block, block]
        assert torch.isfinite(ours).all() and torch.equal(ours, ours.mT)
        error = (ours.double() - exact[:, block, block]).abs().max()
        cublas_error = (cublas[:, block, block].double() - exact[:, block, block]).abs().max()
        assert error <= 2 * cublas_error, (float(error), float(cublas_error))
    if panels > 1:  # outside the diagonal blocks nothing was written
        assert torch.isnan(out[:, size:, :size]).all() and torch.isnan(out[:, :size, size:]).all()


@needs_cuda
@pytest.mark.parametrize("tiling", HOPPER_TILINGS)
def test_gpu_hopper_kernel_copies_a_exactly_and_standard_ns_uses_the_copy(tiling):
    """copy_a: the Hopper kernel's diagonal tiles send every block of A's rows on to a copy
    (bit-exact, every element written: NaN-poisoned), and the product is unchanged by it; standard
    NS then updates that copy in place (gram_with_copy hands it over) and stays within 2e-2 of
    float64 NS."""
    from dion3.tools.bench.kernel_time import float64_newton_schulz
    from dion3.kernels.symmetric_matmul_hopper import GLUON_AVAILABLE, symmetric_matmul_hopper
    from dion3.ortho.newton_schulz import orthogonalize

    if torch.cuda.get_device_capability()[0] != 9 or not GLUON_AVAILABLE:
        pytest.skip("the Gluon kernel runs on sm90 with a Triton that has Gluon")
    a = (torch.randn(3, 1024, 704, device="cuda") / 704 ** 0.5).to(torch.bfloat16)
    plain = torch.full((3, 1024, 1024), float("nan"), dtype=a.dtype, device="cuda")
    with_copy = plain.clone()
    copy = torch.full_like(a, float("nan"))
    tiling = _hopper_tiling(tiling)
    assert symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, plain, any_size=True, tiling=tiling)
    assert symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, with_copy, any_size=True, tiling=tiling, copy_a=copy)
    assert torch.equal(copy, a) and torch.equal(with_copy, plain)

    x = torch.randn(8, 2048, 2048, device="cuda")  # 8 × 72 tiles: the dispatch picks the Hopper kernel
    gram, spare = kernels.gram_with_copy(x.to(torch.bfloat16))
    assert spare is not None and torch.equal(gram, gram.mT)
    exact = float64_newton_schulz(x)
    out = orthogonalize(x, method="newton_schulz")
    assert float((out.double() - exact).norm() / exact.norm()) < 2e-2


@needs_cuda
@pytest.mark.parametrize("product", ["gram", "gram_c", "square"])
def test_gpu_hopper_direct_launch_equals_the_jit_launch(product, monkeypatch):
    """A specialization's later launches call its compiled kernel directly (DIRECT_LAUNCH); on
    other shapes, batches and scalars than the first launch's they give bit-for-bit what a launch
    through Triton's JIT gives."""
    from dion3.kernels import symmetric_matmul_hopper as hopper

    if torch.cuda.get_device_capability()[0] != 9 or not hopper.GLUON_AVAILABLE or not hopper.DIRECT_LAUNCH:
        pytest.skip("direct launches: sm90 and a Triton release they were tested with")

    def operands(batch, n, k, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        a = (torch.randn(batch, n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        if product == "square":
            r = (a @ a.mT).contiguous()
            return r, r, r, 0.8, -1.5
        c = (a @ a.mT).contiguous() if product == "gram_c" else None
        return a, a.mT, c, 0.5 + seed % 3, 2.0 if c is not None else 0.0

    def run(ops):
        a = ops[0]
        out = torch.empty(a.shape[0], a.shape[1], a.shape[1], dtype=a.dtype, device="cuda")
        assert hopper.symmetric_matmul_hopper(*ops, out, any_size=True, tiling=hopper_tiling.NARROW)
        return out

    monkeypatch.setattr(hopper, "_launched", {})
    run(operands(1, 512, 256, 0))  # first launch: through the JIT, its compiled kernel kept
    assert len(hopper._launched) == 1
    later = [operands(2, 1024, 640, 1), operands(3, 768, 384, 2)]
    direct = [run(ops) for ops in later]
    monkeypatch.setattr(hopper, "DIRECT_LAUNCH", False)
    monkeypatch.setattr(hopper, "_launched", {})
    for ops, out in zip(later, direct):  # through the JIT: the first builds, the second is a JIT cache hit
        assert torch.equal(out, run(ops))
    assert len(hopper._launched) == 1


@needs_cuda
def test_gpu_hopper_kernel_declines_mixed_dtypes():
    """The Gluon kernel takes one dtype throughout (its launch key names A's dtype only): a C or
    an output in another dtype goes back to the caller (False), and the dispatch still computes
    such a product correctly on another path."""
    from dion3.kernels import symmetric_matmul_hopper as hopper

    if torch.cuda.get_device_capability()[0] != 9 or not hopper.GLUON_AVAILABLE:
        pytest.skip("the Gluon kernel runs on sm90 with a Triton that has Gluon")
    a = (torch.randn(2, 1024, 512, device="cuda") / 512 ** 0.5).to(torch.bfloat16)
    c = torch.randn(2, 1024, 1024, device="cuda")
    c = c + c.mT
    out = torch.empty(2, 1024, 1024, dtype=torch.bfloat16, device="cuda")
    narrow = hopper_tiling.NARROW
    assert hopper.symmetric_matmul_hopper(a, a.mT, c.to(torch.bfloat16), 0.5, 2.0, out, any_size=True, tiling=narrow)
    assert not hopper.symmetric_matmul_hopper(a, a.mT, c, 0.5, 2.0, out, any_size=True, tiling=narrow)
    assert not hopper.symmetric_matmul_hopper(a, a.mT, None, 1.0, 0.0, out.float(), any_size=True, tiling=narrow)
    exact = 0.5 * (a.double() @ a.mT.double()) + 2.0 * c.double()
    mixed = kernels.symmetric_matmul(a, a.mT, c, alpha=0.5, beta=2.0)
    assert float((mixed.double() - exact).abs().max() / exact.abs().max()) < 1e-2


def test_gram_with_copy_off_the_hopper_kernel_is_the_plain_product():
    """Without the Hopper kernel (CPU here) gram_with_copy is X·Xᵀ and no copy, so standard NS
    falls back to torch.baddbmm."""
    x = torch.randn(2, 24, 40, dtype=torch.float64)
    gram, spare = kernels.gram_with_copy(x)
    assert spare is None
    torch.testing.assert_close(gram, x @ x.mT, rtol=1e-12, atol=1e-12)
