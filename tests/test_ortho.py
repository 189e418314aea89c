"""Newton–Schulz and Gram Newton–Schulz against float64 references.

The reference for a schedule is exact: for X = U·diag(σ)·Vᵀ, T polynomial steps on the
normalized X give U·diag(p_T(…p_1(σ̂)))·Vᵀ with σ̂ = σ / (norm_scale·‖X‖_F). We build inputs
with known SVD and compare against that image, computed by the scalar recursion in float64.
"""
import math

import numpy as np
import pytest
import torch

from dion3 import autotune_restarts, orthogonalize
from dion3.ortho import SCHEDULES, get_schedule
from dion3.ortho.quality import relative_difference, singular_values

CONVERGED = 1e-2  # normalized singular values at least this large must land in the band


def scalar_image(schedule, sigma_hat):
    """p_T(…p_1(σ̂)) in float64, elementwise."""
    x = np.asarray(sigma_hat, dtype=np.float64)
    for a, b, c in schedule.steps:
        x = a * x + b * x**3 + c * x**5
    return x


def known_svd(batch, rows, cols, smallest, generator=None):
    """X = U·diag(σ)·Vᵀ with σ log-spaced from 1 to `smallest`; returns X, U, σ, V (float64)."""
    n = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(batch, rows, n, dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(batch, cols, n, dtype=torch.float64, generator=generator))
    sigma = torch.logspace(0, math.log10(smallest), n, dtype=torch.float64).expand(batch, n)
    return (u * sigma[:, None, :]) @ v.mT, u, sigma, v


def polynomial_image(schedule, u, sigma, v):
    sigma_hat = sigma / (schedule.norm_scale * sigma.norm(dim=-1, keepdim=True))
    image = torch.from_numpy(scalar_image(schedule, sigma_hat.numpy()))
    return (u * image[:, None, :]) @ v.mT, sigma_hat


# ---------------------------------------------------------------- the schedules' bands


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_band_holds_for_converged_singular_values(name):
    """Simulate every schedule over all normalized singular values that can occur
    (σ̂ ≤ 1/norm_scale because σ_max ≤ ‖X‖_F) and that are large enough to converge."""
    schedule = SCHEDULES[name]
    sigma_hat = np.logspace(0, math.log10(CONVERGED), 20001) / schedule.norm_scale
    image = scalar_image(schedule, sigma_hat)
    low, high = schedule.band
    assert image.min() >= low and image.max() <= high, (
        f"{name}: converged singular values span [{image.min():.4f}, {image.max():.4f}], "
        f"outside the declared band {schedule.band}"
    )
    if len(schedule) == 5:
        assert 0.5 <= low < 1.0 < high <= 1.3  # a band that says something
    else:  # fewer steps cannot converge as far; test_short_schedule_bands_are_tighter_than_cut_polar_express
        assert 0.0 < low < 1.0 < high < 2.0


# ---------------------------------------------------------------- NS and Gram NS


SHAPES = [(32, 32), (32, 64), (16, 128), (96, 24), (256, 32)]  # aspect ratios 1, 2, 8, 4 (tall), 8 (tall)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_follows_polynomial_image(name, method, rows, cols):
    """float32 output vs the exact float64 polynomial image, on a spectrum down to 1e-6; the
    converged components lie in the schedule's band."""
    schedule = SCHEDULES[name]
    x, u, sigma, v = known_svd(3, rows, cols, 1e-6)
    expected, sigma_hat = polynomial_image(schedule, u, sigma, v)
    out = orthogonalize(x.float(), method, name)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert relative_difference(out, expected).max() < 2e-3
    diagonal = torch.diagonal(u.mT @ out.double() @ v, dim1=-2, dim2=-1)  # output's σ per input σ
    converged = diagonal[sigma_hat >= CONVERGED]
    low, high = schedule.band
    assert converged.min() >= low - 1e-3 and converged.max() <= high + 1e-3


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("smallest", [1.0, 1e-2, 1e-6])
def test_gram_agrees_with_standard(rows, cols, smallest):
    """Equal compute precision (float32 on CPU), batched, random and ill-conditioned inputs."""
    random = torch.randn(2, rows, cols)
    ill, *_ = known_svd(2, rows, cols, smallest)
    x = torch.cat([random, ill.float()])
    gram = orthogonalize(x, "gram")
    standard = orthogonalize(x, "newton_schulz")
    assert relative_difference(gram, standard).max() <= 2e-2


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
def test_well_conditioned_output_singular_values_in_band(method):
    x, *_ = known_svd(4, 24, 96, 0.1)  # every normalized σ is ≥ 0.02: all converge
    out = orthogonalize(x.float(), method)
    sv = singular_values(out)
    low, high = SCHEDULES["polar_express"].band
    assert sv.min() >= low and sv.max() <= high


@pytest.mark.parametrize(
    "method, dtype", [("newton_schulz", torch.float32), ("gram", torch.float32), ("newton_schulz", torch.bfloat16), ("gram", torch.float16)]
)
def test_zero_and_rank_one_inputs(method, dtype):
    zero = orthogonalize(torch.zeros(2, 8, 24), method, dtype=dtype)
    assert torch.equal(zero, torch.zeros(2, 8, 24))
    left, right = torch.randn(8, 1, dtype=torch.float64), torch.randn(1, 24, dtype=torch.float64)
    rank_one = left @ right
    out = orthogonalize(rank_one.float(), method, dtype=dtype)
    assert torch.isfinite(out).all()
    schedule = SCHEDULES["polar_express"]
    level = float(scalar_image(schedule, 1 / schedule.norm_scale))
    expected = level * rank_one / rank_one.norm()
    if dtype == torch.float32:
        assert relative_difference(out, expected) < 1e-4
    else:
        # half-precision noise in the other directions is amplified ~p'(0)^T ≈ 1000×, as for
        # any low-precision NS; the input's own direction must still come out in the band
        u_hat, v_hat = left / left.norm(), right / right.norm()
        along = float(u_hat.mT @ out.double() @ v_hat.mT)
        assert schedule.band[0] <= along <= schedule.band[1]


def test_fp16_gram_with_restart_beats_bf16_standard():
    """On a 1e-6 spectrum, against the exact float64 polynomial image: fp16 Gram NS with the
    default restart is no worse than bf16 standard NS; without restarts it is clearly worse,
    which is why restarts exist."""
    schedule = SCHEDULES["polar_express"]
    x, u, sigma, v = known_svd(4, 64, 256, 1e-6)
    expected, _ = polynomial_image(schedule, u, sigma, v)
    x = x.float()
    bf16_standard = relative_difference(orthogonalize(x, "newton_schulz", dtype=torch.bfloat16), expected).max()
    fp16_gram = relative_difference(orthogonalize(x, "gram", dtype=torch.float16), expected).max()
    no_restart = orthogonalize(x, "gram", dtype=torch.float16, restarts=())
    no_restart_error = relative_difference(no_restart, expected).max()
    assert fp16_gram <= bf16_standard
    assert fp16_gram < 0.1
    assert not torch.isfinite(no_restart_error) or no_restart_error > 5 * fp16_gram


def test_restart_autotuner():
    positions, condition = autotune_restarts("polar_express", 1)
    assert positions == (2,)
    assert math.isfinite(condition) and condition >= 1.0
    _, without = autotune_restarts("polar_express", 0)
    assert not math.isfinite(without) or without > 1e3 * condition
    # the chosen restart is what orthogonalize uses by default
    x = torch.randn(2, 16, 64)
    torch.testing.assert_close(orthogonalize(x, "gram"), orthogonalize(x, "gram", restarts=[2]), rtol=0, atol=0)
    with pytest.raises(ValueError):
        autotune_restarts("polar_express", 5)


def test_restarts_do_not_change_exact_arithmetic():
    """In float64 a restart only regroups the same products: result equals no restart."""
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    base = orthogonalize(x, "gram", restarts=(), dtype=torch.float64)
    for restarts in ([1], [2], [3, 4], [1, 2, 3, 4]):
        got = orthogonalize(x, "gram", restarts=restarts, dtype=torch.float64)
        torch.testing.assert_close(got, base, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="restart"):
        orthogonalize(x, "gram", restarts=[5])


# ---------------------------------------------------------------- fewer steps: polar_express_4 and _3


SHORT = ["polar_express_4", "polar_express_3"]


@pytest.mark.parametrize("name", SHORT)
def test_short_schedules_are_the_stored_greedy_minimax_construction(name):
    """The stored digits are what dion3.ortho.minimax builds (from [1e-3, 1], safety 1e-2, cushion
    0.02), and the band is the one derived_band states for them; the 3-step schedule is the 4-step
    one's first three steps (the construction is greedy)."""
    from dion3.ortho.minimax import derived_band, minimax_schedule

    schedule = SCHEDULES[name]
    built = minimax_schedule(len(schedule))
    np.testing.assert_allclose(np.array(built), np.array(schedule.steps), rtol=1e-10, atol=0)
    assert schedule.norm_scale == 1.02 and schedule.band == derived_band(schedule.steps)
    assert SCHEDULES["polar_express_3"].steps == SCHEDULES["polar_express_4"].steps[:3]


def test_the_construction_at_five_steps_is_close_to_polar_express():
    """Sanity: five steps of the same construction against the stored Polar Express. The first
    polynomial is the same one with the input scaled by 1/1.02 (Polar Express's safety factor);
    the next three are within 1.1% in a; both send singular values ≥ 1e-3·‖X‖_F to within 0.012
    of each other's ends."""
    from dion3.ortho.minimax import image_range, minimax_schedule

    ours, theirs = minimax_schedule(5), SCHEDULES["polar_express"].steps
    (a, b, c), scale = ours[0], 1.02
    np.testing.assert_allclose([a / scale, b / scale**3, c / scale**5], theirs[0], rtol=1e-12)
    for mine, stored in zip(ours[1:4], theirs[1:4]):
        assert 1.0 < mine[0] / stored[0] < 1.011
    (low, high), (their_low, their_high) = image_range(ours), image_range(theirs)
    assert abs(low - their_low) < 0.012 and abs(high - their_high) < 0.012
    assert their_low < low < 1.0 < high < their_high  # ours is a little tighter in exact arithmetic


@pytest.mark.parametrize("name", SHORT)
def test_short_schedule_bands_are_tighter_than_cut_polar_express(name):
    """Polar Express cut after 4 (or 3) steps lands in about [0.41, 1.58] ([0.13, 1.87]); the
    schedule built for that many steps lands inside it, and its band (the same rule) is tighter."""
    from dion3.ortho.minimax import derived_band, image_range

    schedule = SCHEDULES[name]
    cut = SCHEDULES["polar_express"].steps[: len(schedule)]
    (low, high), (cut_low, cut_high) = image_range(schedule.steps), image_range(cut)
    assert cut_low < low and high < cut_high
    band_low, band_high = derived_band(cut)
    assert band_low < schedule.band[0] and schedule.band[1] < band_high
    # the guard's bound follows the band: below 5-step Polar Express cut short, above the 5-step one
    from dion3.rules import update_bound

    assert update_bound("polar_express") < update_bound(name) < band_high * 1.25


def spectrum_above_floor(n: int, floor: float = 1e-3) -> torch.Tensor:
    """σ₁ = 1 and n − 1 values log-spaced from 0.1 down to the smallest, which is `floor`·‖σ‖
    (every σ is at least floor·‖X‖_F, the band's premise): a condition number near 1/floor."""
    smallest = floor
    for _ in range(50):
        tail = torch.logspace(-1.0, math.log10(smallest), n - 1, dtype=torch.float64)
        smallest = floor * math.sqrt(1.0 + float(tail.square().sum()))
    return torch.cat([torch.ones(1, dtype=torch.float64), tail])


def with_spectrum(sigma, batch, rows, cols, generator):
    n = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(batch, rows, n, dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(batch, cols, n, dtype=torch.float64, generator=generator))
    return (u * sigma) @ v.mT


@pytest.mark.parametrize("name", SHORT)
@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows, cols", [(32, 96), (96, 32), (48, 48), (16, 128), (200, 40)])
def test_short_schedules_keep_real_singular_values_in_their_band(name, method, dtype, rows, cols):
    """Through orthogonalize: every output singular value (float64 svdvals) lies in the band for
    inputs whose singular values are all at least 1e-3·‖X‖_F (condition numbers near 1e3), and
    for random Gaussian ones; for log-spaced spectra of condition number 1e3, whose tail falls
    below 1e-3·‖X‖_F, no value exceeds the band and those at least 1e-3·‖X‖_F are in it."""
    schedule = SCHEDULES[name]
    low, high = schedule.band
    generator = torch.Generator().manual_seed(rows * 1000 + cols)
    n = min(rows, cols)
    premise = with_spectrum(spectrum_above_floor(n), 3, rows, cols, generator)
    gaussian = torch.randn(3, rows, cols, dtype=torch.float64, generator=generator)
    sv = torch.linalg.svdvals(orthogonalize(torch.cat([premise, gaussian]).to(dtype), method, name, dtype=dtype).double())
    assert low <= sv[:3].min() and sv.max() <= high
    for matrix, values in zip(gaussian, sv[3:]):  # square ones may have σ below 1e-3·‖X‖_F
        if torch.linalg.svdvals(matrix).min() >= 1e-3 * matrix.norm():
            assert values.min() >= low
    sigma = torch.logspace(0.0, -3.0, n, dtype=torch.float64)
    conditioned = with_spectrum(sigma, 3, rows, cols, generator)
    out = orthogonalize(conditioned.to(dtype), method, name, dtype=dtype).double()
    u, _, vh = torch.linalg.svd(conditioned, full_matrices=False)
    along = torch.diagonal(u.mT @ out @ vh.mT, dim1=-2, dim2=-1)  # output's σ per input σ
    premise_holds = sigma / sigma.norm() >= 1e-3
    assert torch.linalg.svdvals(out).max() <= high
    assert along[:, premise_holds].min() >= low and along.min() > 0.0


@pytest.mark.parametrize("name", SHORT)
@pytest.mark.parametrize("rows, cols", [(24, 96), (96, 24), (16, 64)])
def test_short_schedules_gram_matches_standard_in_float64(name, rows, cols):
    """Gram NS with the schedule's default restart (after step 2 for both) gives standard NS's
    result in float64; the restart really is the default."""
    from dion3.ortho.restarts import default_restarts

    schedule = SCHEDULES[name]
    assert default_restarts(schedule) == (2,)
    x = torch.cat([torch.randn(2, rows, cols, dtype=torch.float64),
                   known_svd(2, rows, cols, 1e-3)[0]])
    gram = orthogonalize(x, "gram", name, dtype=torch.float64)
    torch.testing.assert_close(gram, orthogonalize(x, "newton_schulz", name, dtype=torch.float64), rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(gram, orthogonalize(x, "gram", name, restarts=(2,), dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("name", SHORT)
def test_the_cost_model_counts_the_short_schedules_steps(name):
    """Standard NS costs len(schedule)/5 of Polar Express's products; Gram NS the products of its
    own steps with its default restart."""
    from dion3.ortho.cost import gram_products, orthogonalize_flops

    steps, n, m = len(SCHEDULES[name]), 64, 256
    five = orthogonalize_flops(n, m, "newton_schulz", False)[0]
    assert orthogonalize_flops(n, m, "newton_schulz", False, name)[0] * 5 == five * steps
    assert orthogonalize_flops(m, n, "gram", False, name)[0] == sum(p.flops for p in gram_products(n, m, steps, (2,)))
    assert orthogonalize_flops(n, m, "gram", False, name)[0] < orthogonalize_flops(n, m, "gram", False)[0]
    # with one restart after step 2, Gram NS still wins from m/n > 1.5 with dense products (choose_method's rule)
    for ratio in (1.4, 1.6):
        gram, standard = (orthogonalize_flops(100, int(100 * ratio), method, False, name)[0] for method in ("gram", "newton_schulz"))
        assert (gram < standard) == (ratio > 1.5)


# ---------------------------------------------------------------- interface


def test_auto_picks_gram_only_for_clearly_non_square():
    wide, square, near = torch.randn(2, 16, 64), torch.randn(2, 16, 16), torch.randn(2, 16, 20)
    assert torch.equal(orthogonalize(wide), orthogonalize(wide, "gram"))
    assert torch.equal(orthogonalize(square), orthogonalize(square, "newton_schulz"))
    assert torch.equal(orthogonalize(near), orthogonalize(near, "newton_schulz"))


def test_leading_dims_input_untouched_and_explicit_coefficients():
    x = torch.randn(2, 3, 12, 20)
    before = x.clone()
    out = orthogonalize(x, "newton_schulz", "jordan")
    assert torch.equal(x, before)
    assert out.shape == x.shape
    for i in range(2):
        torch.testing.assert_close(out[i], orthogonalize(x[i], "newton_schulz", "jordan"), rtol=1e-5, atol=1e-6)
    explicit = orthogonalize(x, "newton_schulz", [list(t) for t in SCHEDULES["jordan"].steps])
    torch.testing.assert_close(explicit, out, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("shape", [(3, 12, 20), (3, 20, 12)])  # wide, and tall (transposed inside)
def test_given_norm_matches_measured_and_tall_results_come_back_contiguous(method, shape):
    """A caller that passes each matrix's Frobenius norm (the optimizer measures it during the
    momentum pass) gets the same result as when it is measured here; a wrong norm changes the
    result (so the argument is really used); tall results come back contiguous (the fused
    update reads rows directly)."""
    x = torch.randn(*shape, dtype=torch.float64)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    measured = orthogonalize(x, method)
    given = orthogonalize(x, method, norm=norm)
    torch.testing.assert_close(given, measured, rtol=1e-12, atol=1e-12)
    assert given.is_contiguous() and measured.is_contiguous()
    assert (orthogonalize(x, method, norm=norm * 4) - measured).abs().max() > 1e-3
    with pytest.raises(ValueError, match="norm must have shape"):
        orthogonalize(x, method, norm=norm[:2])
    # an already normalized input (wide or tall) is used as is; it must be in the compute dtype
    scaled = x / (1.02 * norm + 1e-7)
    torch.testing.assert_close(orthogonalize(scaled, method, normalized=True), measured, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="normalized=True"):
        orthogonalize(scaled.float(), method, dtype=torch.float64, normalized=True)


@pytest.mark.parametrize("restarts", [(), (2,)])
def test_gram_tall_result_is_the_transpose_without_a_copy(restarts):
    """Gram NS's tall result Xᵀ·Q equals (Q·X)ᵀ (Q is symmetric) and is contiguous; through
    orthogonalize, a tall input's Gram result matches the transposed wide problem's."""
    from dion3.ortho.newton_schulz import gram_newton_schulz

    schedule = get_schedule("polar_express")
    x = torch.randn(3, 12, 40, dtype=torch.float64)
    x = x / (1.02 * torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True))
    wide = gram_newton_schulz(x, schedule, restarts)
    tall = gram_newton_schulz(x, schedule, restarts, tall_result=True)
    assert tall.shape == (3, 40, 12) and tall.is_contiguous()
    torch.testing.assert_close(tall, wide.mT, rtol=1e-12, atol=1e-12)
    y = torch.randn(2, 40, 12, dtype=torch.float64)
    torch.testing.assert_close(orthogonalize(y, "gram"), orthogonalize(y.mT.contiguous(), "gram").mT,
                               rtol=1e-12, atol=1e-12)


def test_orthogonalize_rejects_bad_input():
    with pytest.raises(ValueError, match="method"):
        orthogonalize(torch.randn(4, 4), "svd")
    with pytest.raises(ValueError, match="ns_coefficients"):
        orthogonalize(torch.randn(4, 4), coefficients="keller")
    with pytest.raises(ValueError):
        orthogonalize(torch.randn(4))
    with pytest.raises(ValueError):
        get_schedule([(1.0, 2.0)])


def _modelled_time(n, m, method, speedup, standard_speedup=1.0):
    """Time units of one orthogonalization, products listed by hand: symmetric products run
    `speedup` times faster than dense ones, and every product of standard NS `standard_speedup`
    times faster than Gram NS's (its compute dtype). Gram NS: 5 steps, one restart after step 2."""
    if method == "newton_schulz":  # per step: X·Xᵀ (sym), A·A (sym), B·X (dense)
        return 5 * (2 * n * n * m / speedup + 2 * n**3 / speedup + 2 * n * n * m) / standard_speedup
    sym_n3 = 3 + 2 + 3 + 4 + 2  # Z,P,R | Z,QZ | Z,P,R | Z,QZ,P,R | Z,QZ
    return 2 * (2 * n * n * m / speedup) + sym_n3 * 2 * n**3 / speedup + 2 * (2 * n * n * m)


@pytest.mark.parametrize("speedup,standard_speedup", [(1.0, 1.0), (1.25, 1.0), (1.6, 1.0), (2.0, 1.0),
                                                      (1.0, 1.3), (1.0, 2.2), (1.6, 1.5)])
def test_choose_method_picks_the_faster_method(speedup, standard_speedup):
    from dion3.ortho import choose_method

    n = 512
    for m in range(n, 32 * n, 16):
        times = {method: _modelled_time(n, m, method, speedup, standard_speedup) for method in ("newton_schulz", "gram")}
        faster = min(times, key=times.get)
        if abs(times["gram"] - times["newton_schulz"]) < 1e-3 * times["gram"]:
            continue  # a tie: either is right
        assert choose_method(n, m, speedup, standard_speedup) == faster, (m / n, speedup, times)
        assert choose_method(m, n, speedup, standard_speedup) == faster  # tall inputs are transposed
    assert choose_method(n, n, 2.0) == "newton_schulz"
