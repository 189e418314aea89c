"""Direct launches of the small Triton kernels (dion3.kernels.launch.Launcher), on CPU with
stand-ins for Triton's JIT and for the kernels it compiles: which launches go through the JIT,
what a direct launch passes, the fall-back when a launcher refuses. The kernels' results under
direct launches are compared with JIT launches on the GPU (test_gpu_direct_launches_equal_...)."""
from __future__ import annotations

import importlib
import warnings
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from dion3.kernels import launch  # noqa: E402
from dion3.kernels.launch import Launcher  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Recorder:
    """Stands in for a JIT kernel with the given parameters: kernel[grid](...) records the call
    ("jit", grid, every parameter by name, options) and returns a compiled stand-in whose
    launches record ("direct", grid, every parameter by name)."""

    def __init__(self, params, fail_direct: Exception | None = None):
        self.params = [SimpleNamespace(name=name, is_constexpr=constexpr) for name, constexpr in params]
        self.names = [p.name for p in self.params]
        self.calls = []
        self.fail_direct = fail_direct

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound = dict(zip(self.names, args))
            options = {k: v for k, v in kwargs.items() if k not in self.names}
            bound.update({k: v for k, v in kwargs.items() if k in self.names})
            self.calls.append(("jit", grid, bound, options))
            return Compiled(self)
        return run


class Compiled:
    def __init__(self, recorder):
        self.recorder = recorder

    def __getitem__(self, grid):
        def run(*args):
            if self.recorder.fail_direct is not None:
                raise self.recorder.fail_direct
            assert len(args) == len(self.recorder.names), "a direct launch passes every parameter"
            self.recorder.calls.append(("direct", grid, dict(zip(self.recorder.names, args)), {}))
        return run


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(launch, "_device", lambda: 0)


PARAMS = [("x_ptr", False), ("scale", False), ("n", False), ("FLAG", True), ("BLOCK", True)]


def test_later_launches_of_one_specialization_call_the_compiled_kernel(direct):
    """Same key: direct, with the grid padded to three axes and every parameter in order (those
    given by name too), new float and integer values passed as they are."""
    kernel = Recorder(PARAMS)
    run = Launcher(kernel)
    x = torch.zeros(64)
    run((4,), x, 0.5, 37, FLAG=True, BLOCK=32, num_warps=4)
    run((5, 2), x, 0.25, 53, True, BLOCK=32, num_warps=4)
    assert [c[0] for c in kernel.calls] == ["jit", "direct"]
    assert kernel.calls[0][3] == {"num_warps": 4}
    assert kernel.calls[1][1] == (5, 2, 1)
    assert kernel.calls[1][2] == {"x_ptr": x, "scale": 0.25, "n": 53, "FLAG": True, "BLOCK": 32}


@pytest.mark.parametrize("change", [
    "constexpr value", "dtype", "misaligned tensor", "integer 1", "integer multiple of 16", "64-bit integer",
    "options"])
def test_a_launch_the_jit_would_specialize_differently_goes_through_the_jit(direct, change):
    kernel = Recorder(PARAMS)
    run = Launcher(kernel)
    base = torch.zeros(64)
    args = dict(x_ptr=base, scale=0.5, n=37, FLAG=True, BLOCK=32)
    options = dict(num_warps=4)
    run((1,), **args, **options)
    changed = dict(args)
    if change == "constexpr value":
        changed["BLOCK"] = 64
    elif change == "dtype":
        changed["x_ptr"] = base.to(torch.float64)
    elif change == "misaligned tensor":  # 4 bytes past a 16-byte boundary
        changed["x_ptr"] = base[1:]
        assert changed["x_ptr"].data_ptr() % 16 == 4
    elif change == "integer 1":
        changed["n"] = 1
    elif change == "integer multiple of 16":
        changed["n"] = 48
    elif change == "64-bit integer":
        changed["n"] = 2**31 + 3
    else:
        options = dict(num_warps=8)
    run((1,), **changed, **options)
    run((1,), **changed, **options)
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "direct"]


def test_without_direct_launches_every_launch_goes_through_the_jit(monkeypatch):
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    kernel = Recorder(PARAMS)
    run = Launcher(kernel)
    for _ in range(3):
        run((1,), torch.zeros(4), 0.5, 3, FLAG=False, BLOCK=16)
    assert [c[0] for c in kernel.calls] == ["jit"] * 3


def test_a_missing_parameter_is_named(direct):
    run = Launcher(Recorder(PARAMS))
    with pytest.raises(TypeError, match="'BLOCK'"):
        run((1,), torch.zeros(4), 0.5, 3, FLAG=False)


def test_a_launcher_that_refuses_the_direct_call_turns_direct_launches_off(direct):
    """One RuntimeWarning, the launch itself through the JIT (it runs once), the JIT from then on."""
    kernel = Recorder(PARAMS, fail_direct=TypeError("function takes exactly 12 arguments"))
    run = Launcher(kernel)
    args = (torch.zeros(4), 0.5, 3, False, 16)
    run((1,), *args)
    with pytest.warns(RuntimeWarning, match="through Triton's JIT from now on"):
        run((1,), *args)
    assert not launch.DIRECT_LAUNCH
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run((1,), *args)
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "jit"]


def test_direct_launches_only_on_tested_triton_releases(monkeypatch):
    monkeypatch.setattr(launch.triton, "__version__", "3.6.0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert launch.direct_launch_tested()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.direct_launch_tested()
    monkeypatch.delenv("TRITON_INTERPRET")
    for version in ("3.5.1", "3.7.0", "dev"):
        monkeypatch.setattr(launch.triton, "__version__", version)
        assert not launch.direct_launch_tested()


def _small_kernel_calls():
    """Each small kernel's launcher and a CPU call of its module function that launches it."""
    momentum, normalization, post_update, scale, selection, transpose = (
        importlib.import_module(f"dion3.kernels.{name}")  # modules: dion3.kernels.post_update is also a function
        for name in ("momentum", "normalization", "post_update", "scale", "selection", "transpose"))

    def accumulate():
        momentum.accumulate_momentum_triton(torch.zeros(2, 8, 16), [torch.ones(2, 8, 16)], 0.9, True, True)

    def snapshot():
        momentum.snapshot_rows_triton(torch.ones(2, 8, 16), torch.tensor([[0, 3], [1, 2]]), 0.5,
                                      torch.ones(2, 1, 1), torch.bfloat16)

    def normalize():
        normalization.row_normalization_triton(torch.ones(2, 3), torch.zeros(2, 8, 1), torch.tensor([[0, 1, 5]] * 2),
                                               0.95, 1e-8, 16)

    def update():
        post_update.post_update_triton([torch.zeros(2, 8, 16)], torch.ones(2, 8, 16), None, 0.99, 0.1,
                                       torch.ones(2, 8))  # rows None: no selection kernel launched

    def scale_cast():
        scale.scale_cast_triton(torch.ones(2, 8, 16), torch.ones(2, 1, 1), torch.bfloat16)

    def select():
        selection.selection_norm_triton(torch.ones(2, 8), torch.tensor([[0, 3], [1, 2]]), 2.0, 1e-7, positions=True)

    def transpose_into():
        transpose.transpose_into_triton(torch.empty(2, 8, 16), torch.ones(2, 16, 8), torch.ones(2))

    return [(momentum._launch_accumulate_kernel, accumulate), (momentum._launch_snapshot_kernel, snapshot),
            (normalization._launch_row_normalization_kernel, normalize), (post_update._launch_post_update_kernel, update),
            (scale._launch_scale_cast_kernel, scale_cast), (selection._launch_selection_kernel, select),
            (transpose._launch_transpose_kernel, transpose_into)]


def _summary(bound):  # tensors by dtype and shape (a second call allocates new outputs)
    return {k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v for k, v in bound.items()}


@pytest.mark.parametrize("index", range(7))
def test_each_small_kernel_call_binds_every_parameter_and_launches_directly_the_second_time(
        direct, monkeypatch, index):
    """The modules' call sites give every parameter of their kernel (by position or name), so
    the second identical call goes direct with the values the first bound through the JIT."""
    launcher, call = _small_kernel_calls()[index]
    kernel = Recorder([(p.name, p.is_constexpr) for p in launcher.kernel.params])
    monkeypatch.setattr(launcher, "kernel", kernel)
    monkeypatch.setattr(launcher, "_compiled", {})
    call()
    call()
    assert [c[0] for c in kernel.calls] == ["jit", "direct"]
    (_, jit_grid, jit_bound, options), (_, direct_grid, direct_bound, _) = kernel.calls
    assert set(jit_bound) == set(kernel.names) and _summary(direct_bound) == _summary(jit_bound)
    assert direct_grid == tuple(jit_grid) + (1,) * (3 - len(jit_grid))
    assert all(isinstance(value, int) for value in options.values())  # launch options only (num_warps)


@needs_cuda
def test_gpu_direct_launches_equal_jit_launches(monkeypatch):
    """A step of each optimizer family on small matrices gives bit-for-bit the same parameters
    with direct launches as with launches through the JIT."""
    if not launch.direct_launch_tested():
        pytest.skip("direct launches: a Triton release they were tested with")
    import dion3

    def run(direct_launch):
        monkeypatch.setattr(launch, "DIRECT_LAUNCH", direct_launch)
        results = []
        for optimizer, options in ((dion3.NorMuon, {}), (dion3.Dion3, {"fraction": 0.25})):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(n, m, device="cuda")) for n, m in ((256, 512), (512, 256))]
            opt = optimizer(params, lr=0.02, **options)
            for step in range(4):
                for p in params:
                    p.grad = torch.randn_like(p) * (1 + step)
                opt.step()
            results += [p.detach().clone() for p in params]
        return results

    jit = run(False)
    direct = run(True)
    assert all(torch.equal(a, b) for a, b in zip(jit, direct))
