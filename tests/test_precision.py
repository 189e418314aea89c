"""The CPU compute dtype of Newton–Schulz: the rule from the CPU's identity (faked), no timing,
the explicit switches that override it, and the bf16 path's accuracy against float64 math."""

import pytest
import torch

from dion3 import Muon
from dion3 import rules
from dion3.ortho import SCHEDULES, orthogonalize, precision, set_cpu_compute_dtype
from dion3.ortho.newton_schulz import default_compute_dtype, resolve_method
from dion3.ortho.quality import relative_difference
from reference import ReferenceOptimizer
from test_ortho import known_svd, polynomial_image, scalar_image

CPU = torch.device("cpu")


@pytest.fixture
def fresh_choice(monkeypatch):
    """No explicit choice (neither set_cpu_compute_dtype nor the environment) before and after
    the test."""
    monkeypatch.delenv(precision.ENV_VAR, raising=False)
    monkeypatch.setattr(precision, "_override", None)
    yield


AMD_BF16 = precision.CpuIdentity("AuthenticAMD", frozenset({"avx2", "avx512f", "avx512_bf16"}), "x86_64")
INTEL_BF16 = precision.CpuIdentity("GenuineIntel", frozenset({"avx2", "avx512f", "avx512_bf16"}), "x86_64")
INTEL_AMX = precision.CpuIdentity("GenuineIntel", frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}), "x86_64")


def fake_cpu(monkeypatch, identity: precision.CpuIdentity) -> None:
    """Make this CPU look like `identity` to the rule."""
    monkeypatch.setattr(precision, "cpu_identity", lambda: identity)


# ---------------------------------------------------------------- the choice


@pytest.mark.parametrize("identity, expected", [
    (AMD_BF16, torch.bfloat16),  # measured 2.2–2.4× (cpu-2026-12-01.md)
    (INTEL_BF16, torch.float32),  # half the float32 speed on a 2-core Xeon
    (precision.CpuIdentity("AuthenticAMD", frozenset({"avx2"}), "x86_64"), torch.float32),
    (INTEL_AMX, torch.bfloat16),  # measured 3.0–6.3× (cpu-2026-12-01.md, AMX part)
    (precision.CpuIdentity("", frozenset({"amx_tile"}), "x86_64"), torch.bfloat16),  # torch's query alone
    (precision.CpuIdentity("GenuineIntel", frozenset({"amx_tile", "amx_bf16"}), "aarch64"), torch.float32),
    (precision.CpuIdentity("AuthenticAMD", frozenset({"avx512_bf16"}), "aarch64"), torch.float32),
    (precision.CpuIdentity("", frozenset(), "aarch64"), torch.float32),
])
def test_the_dtype_is_a_function_of_the_cpu_identity(monkeypatch, fresh_choice, identity, expected):
    fake_cpu(monkeypatch, identity)
    assert precision.cpu_compute_dtype() == expected


def test_no_timing_decides_the_dtype(monkeypatch, fresh_choice):
    """The choice reads no clock: with time frozen and a slow bf16 product faked everywhere it
    could be measured, the rule still gives the same answer (the bug this replaced: four gloo
    ranks on two cores timed 2.75, 2.72, 1.0 and 11.3 and disagreed)."""
    import time

    monkeypatch.setattr(time, "perf_counter", lambda: (_ for _ in ()).throw(AssertionError("timed")))
    monkeypatch.setattr(time, "monotonic", lambda: (_ for _ in ()).throw(AssertionError("timed")))
    fake_cpu(monkeypatch, AMD_BF16)
    assert precision.cpu_compute_dtype() == torch.bfloat16
    assert not hasattr(precision, "bf16_speedup")


def test_this_cpus_identity_is_read(fresh_choice):
    identity = precision.cpu_identity()
    assert isinstance(identity.flags, frozenset) and identity.machine
    assert precision.native_bf16_matmul() == precision.bf16_products_faster(identity)


def test_explicit_switch_wins_over_the_rule(monkeypatch, fresh_choice):
    fake_cpu(monkeypatch, AMD_BF16)
    set_cpu_compute_dtype(torch.float32)
    assert precision.cpu_compute_dtype() == torch.float32
    monkeypatch.setenv(precision.ENV_VAR, "bfloat16")  # the program's choice beats the environment
    assert precision.cpu_compute_dtype() == torch.float32
    set_cpu_compute_dtype(None)  # back to the environment
    assert precision.cpu_compute_dtype() == torch.bfloat16
    monkeypatch.setenv(precision.ENV_VAR, "float32")
    assert precision.cpu_compute_dtype() == torch.float32
    monkeypatch.setenv(precision.ENV_VAR, "auto")
    assert precision.cpu_compute_dtype() == torch.bfloat16


def test_environment_can_force_bf16_on_a_slow_cpu(monkeypatch, fresh_choice):
    fake_cpu(monkeypatch, INTEL_BF16)
    monkeypatch.setenv(precision.ENV_VAR, "bf16")
    assert precision.cpu_compute_dtype() == torch.bfloat16
    set_cpu_compute_dtype("bfloat16")
    assert precision.cpu_compute_dtype() == torch.bfloat16


def test_bad_choices_are_rejected_by_name(monkeypatch, fresh_choice):
    with pytest.raises(ValueError, match=r"set_cpu_compute_dtype\(dtype\).*float16"):
        set_cpu_compute_dtype(torch.float16)
    with pytest.raises(ValueError, match=r"set_cpu_compute_dtype\(dtype\).*'fp8'"):
        set_cpu_compute_dtype("fp8")
    monkeypatch.setenv(precision.ENV_VAR, "half")
    with pytest.raises(ValueError, match=r"DION3_CPU_NS_DTYPE.*'half'"):
        precision.cpu_compute_dtype()


def test_only_standard_ns_on_float32_inputs_follows_the_cpu_choice(monkeypatch, fresh_choice):
    fake_cpu(monkeypatch, AMD_BF16)
    assert default_compute_dtype(CPU, "newton_schulz", torch.float32) == torch.bfloat16
    assert default_compute_dtype(CPU, "gram", torch.float32) == torch.float32  # bf16 Gram NS drifts
    assert default_compute_dtype(CPU, "newton_schulz", torch.float64) == torch.float64
    assert default_compute_dtype(CPU, "gram", torch.float64) == torch.float64


@pytest.mark.parametrize("rows", [64, 96, 256])
def test_auto_method_weighs_bf16_standard_ns_against_float32_gram_ns(monkeypatch, fresh_choice, rows):
    """Where standard NS runs in bf16 on a CPU whose bf16 products measured fast, "auto" keeps
    it for wide inputs up to m/n ≈ 21.6 (BF16_NOMINAL_SPEEDUP; Gram NS is float32 there);
    below BF16_MIN_ROWS rows, and on float32 CPUs, Gram NS takes over above m/n = 1.5."""
    fake_cpu(monkeypatch, AMD_BF16)
    bf16_rows = rows >= precision.BF16_MIN_ROWS
    assert precision.cpu_standard_speedup(rows) == (precision.BF16_NOMINAL_SPEEDUP if bf16_rows else 1.0)
    for ratio, bf16_choice in [(1.4, "newton_schulz"), (4, "newton_schulz"), (16, "newton_schulz"), (24, "gram")]:
        x = torch.zeros(1, rows, int(rows * ratio))
        expected = bf16_choice if bf16_rows else ("gram" if ratio > 1.5 else "newton_schulz")
        assert resolve_method(x, "auto") == expected, ratio
        assert resolve_method(x.mT, "auto") == expected, ratio  # tall: the same wide problem
    # float64 inputs run both methods in float64: the plain rule
    assert resolve_method(torch.zeros(1, rows, 4 * rows, dtype=torch.float64), "auto") == "gram"
    set_cpu_compute_dtype(torch.float32)
    assert precision.cpu_standard_speedup(rows) == 1.0
    assert resolve_method(torch.zeros(1, rows, 4 * rows), "auto") == "gram"


@pytest.mark.parametrize("rows", [64, 96, 256])
def test_amx_keeps_bf16_standard_ns_at_every_aspect_ratio(monkeypatch, fresh_choice, rows):
    """On a CPU with AMX, bf16 standard NS measured 1.5–3.1× faster than float32 Gram NS from 96
    rows up to m/n = 32 (cpu-2026-12-01.md, AMX part): with its nominal 3.0 the model picks it at every
    aspect ratio (the FLOP ratio tends to 20/8 = 2.5 for wide inputs); below 96 rows the float32 rule."""
    fake_cpu(monkeypatch, INTEL_AMX)
    bf16_rows = rows >= precision.BF16_MIN_ROWS
    assert precision.cpu_standard_speedup(rows) == (3.0 if bf16_rows else 1.0)
    for ratio in (1.4, 4, 16, 32, 64):
        x = torch.zeros(1, rows, int(rows * ratio))
        expected = "newton_schulz" if bf16_rows else ("gram" if ratio > 1.5 else "newton_schulz")
        assert resolve_method(x, "auto") == expected, ratio


def test_forced_bf16_on_a_slow_cpu_keeps_the_float32_method_rule(monkeypatch, fresh_choice):
    fake_cpu(monkeypatch, INTEL_BF16)
    set_cpu_compute_dtype("bfloat16")
    assert precision.cpu_standard_speedup(256) == 1.0
    assert resolve_method(torch.zeros(1, 256, 1024), "auto") == "gram"


# ---------------------------------------------------------------- the bf16 path's accuracy

# bf16 keeps 8 significant bits: unit roundoff u = 2⁻⁸ ≈ 3.9e-3. Each NS step rounds X, A = XXᵀ
# and bA + cA² to bf16 (products accumulate in float32); errors of early steps are damped as the
# singular values contract into the band, the last step's are not, so the output differs from
# the exact float64 image by a few u when every singular value converges (spectra down to 0.1:
# 0.010–0.019 measured, float32: ~3e-6). 10u = 0.039 bounds that with a 2× margin, and is four
# orders of magnitude above what a float32 computation would show.
BF16_TOLERANCE = 10 * 2.0**-8


@pytest.mark.parametrize("rows, cols", [(32, 32), (64, 64), (96, 48), (256, 256)])
def test_bf16_cpu_path_is_close_to_the_float64_image(monkeypatch, fresh_choice, rows, cols):
    fake_cpu(monkeypatch, AMD_BF16)
    set_cpu_compute_dtype("bfloat16")  # the bf16 path at every size (the rule keeps < 96 rows in float32)
    schedule = SCHEDULES["polar_express"]
    x, u, sigma, v = known_svd(3, rows, cols, 0.1)
    expected, _ = polynomial_image(schedule, u, sigma, v)
    ortho = rules.orthogonalize_rows(x.float(), "newton_schulz", "polar_express")
    assert ortho.dtype == torch.bfloat16  # ran in bf16, left in it for the update
    assert relative_difference(ortho, expected).max() < BF16_TOLERANCE
    out = orthogonalize(x.float(), "newton_schulz")
    assert out.dtype == torch.float32
    assert relative_difference(out, expected).max() < BF16_TOLERANCE


def polynomial_polar(u: torch.Tensor) -> torch.Tensor:
    """Polar Express's image of u in float64, from its SVD: what the optimizers' Newton–Schulz
    computes with exact arithmetic."""
    schedule = SCHEDULES["polar_express"]
    left, sigma, right = torch.linalg.svd(u.double(), full_matrices=False)
    sigma_hat = sigma / (schedule.norm_scale * sigma.norm(dim=-1, keepdim=True))
    image = torch.from_numpy(scalar_image(schedule, sigma_hat.numpy()))
    return (left * image[..., None, :]) @ right


def test_muon_step_with_bf16_cpu_ns_tracks_float64(monkeypatch, fresh_choice):
    """A Muon step whose Newton–Schulz ran in bf16 moves the weights as float64 math does, up to
    bf16 precision in the update (the update is lr·O, so its error is lr·‖O‖·tolerance)."""
    fake_cpu(monkeypatch, AMD_BF16)
    lr = 0.05
    grads = [known_svd(1, 48, 48, 0.1)[0][0].float(), known_svd(1, 24, 48, 0.1)[0][0].float()]
    params = [torch.nn.Parameter(torch.randn(g.shape)) for g in grads]
    reference = ReferenceOptimizer(params, "muon", lr=lr, adjust_lr=None, orthogonalizer=polynomial_polar)
    optimizer = Muon(params, lr=lr, weight_decay=0.0, adjust_lr=None, orthogonalizer="newton_schulz")
    for p, g in zip(params, grads):
        p.grad = g.clone()
    before = [p.detach().double().clone() for p in params]
    optimizer.step()
    reference.step(grads)
    for p, old, expected in zip(params, before, reference.params):
        assert relative_difference(p.detach().double() - old, expected - old) < BF16_TOLERANCE
