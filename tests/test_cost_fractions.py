"""dion3.optim.cost_fractions: per-shape fractions by orthogonalization cost (hand-computed cases and
the budget property), and the host-side FLOP count of a step."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from dion3.tools.bench.step_cost import MatrixShape, h200_symmetric, orthogonalize_flops
from dion3.ortho.cost import H200_TIME, modeled_seconds, time_features
from dion3.ortho.coefficients import get_schedule
from dion3.rules import selected_row_count
from dion3.tools.train import trainer
from dion3.optim.cost_fractions import (
    cost_allocated_fractions, cost_allocated_groups, matrix_shapes, orthogonalize_cost, step_orthogonalize_flops,
)

STEPS = len(get_schedule("polar_express"))


def ns_flops(rows: int, cols: int) -> int:
    """Standard Newton–Schulz on dense GEMMs, per step on a wide n×m matrix (n ≤ m): XXᵀ (2n²m),
    A² (2n³), (bA + cA²)·X (2n²m), as the orthogonalize_flops docstring counts them."""
    n, m = min(rows, cols), max(rows, cols)
    return STEPS * (4 * n * n * m + 2 * n ** 3)


def test_time_features_by_hand():
    """Standard NS on k = 100 rows of 300 columns runs on a 128 × 304 buffer (Gram side to 128, long
    side to 8), below the symmetric kernels' size: per step XXᵀ (2n²m, reads nm, writes n²), A²
    (2n³, reads 2n², writes n²), (bA + cA²)·X (2n²m, reads n² + nm, writes nm), bf16 operands;
    the selected rows are k·cols float32 entries."""
    n, m = 128, 304
    square, long, traffic, rows = time_features(100, 300, "newton_schulz")
    assert square == STEPS * 2 * n ** 3
    assert long == STEPS * 4 * n * n * m
    assert traffic == STEPS * 2 * ((n * m + n * n) + 3 * n * n + (n * n + 2 * n * m))
    assert rows == 4 * 100 * 300
    assert modeled_seconds(100, 300, "newton_schulz") == pytest.approx(
        sum(w * x for w, x in zip(H200_TIME, (square, long, traffic, rows))), rel=1e-12)
    # every k of one padded block costs the same products; only the rows' own traffic grows
    assert time_features(97, 300, "newton_schulz")[:3] == time_features(128, 300, "newton_schulz")[:3]
    assert time_features(129, 300, "newton_schulz")[0] > square


def test_time_model_matches_the_measured_k_sweep():
    """The model against the H200 record it was fitted on (benchmarks/results/k-sweep-h200-2026-12-02.json):
    each shape's k-independent work as one offset (least squares of relative errors), points that keep the GPU busy
    (k ≥ 1024 or every row, shapes of 4096² and up); relative error rms within 3%, none above 15%."""
    import json
    import pathlib

    record = json.loads((pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
                         / "k-sweep-h200-2026-12-02.json").read_text())
    by_shape: dict = {}
    for r in record["results"]:
        rows, cols = r["shape"]
        if r["algorithm"] == "dion3" and rows * cols >= 4096 * 4096 and (r["k"] >= 1024 or r["k"] == rows):
            by_shape.setdefault((rows, cols), []).append((record["count"] * modeled_seconds(r["k"], cols) * 1e3, r["ms"]))
    assert len(by_shape) == 5
    errors = []
    for points in by_shape.values():
        offset = sum((ms - model) / ms ** 2 for model, ms in points) / sum(1 / ms ** 2 for _, ms in points)
        errors += [(model + offset - ms) / ms for model, ms in points]
    assert len(errors) > 150
    assert (sum(e * e for e in errors) / len(errors)) ** 0.5 < 0.03
    assert max(abs(e) for e in errors) < 0.15


def test_linear_cost_fills_the_narrow_matrix_first():
    """cost = k·C²: a row of A (C = 2) costs 4, of B (C = 4) 16. Uniform ½: 4·4 + 4·16 = 80.
    Floor ⅛: 1 row each, 4 + 16 = 20; A takes its 7 rows (48), B 2 more at 16 (80)."""
    shapes = [MatrixShape("a", 8, 2, 1), MatrixShape("b", 8, 4, 1)]
    fractions = cost_allocated_fractions(shapes, 0.5, floor=0.125, cost=lambda k, c: k * c * c)
    assert fractions == [1.0, 3 / 8]


def test_convex_cost_stops_when_no_row_fits():
    """cost = k²·C, A 4×1, B 4×3: uniform ½ (k = 2) costs 4 + 12 = 16. From a ¼ floor (1 + 3 = 4)
    A's rows cost 3, 5 (total 12), then A's next 7 and B's next 9 both pass 16: A ¾, B ¼."""
    shapes = [MatrixShape("a", 4, 1, 1), MatrixShape("b", 4, 3, 1)]
    assert cost_allocated_fractions(shapes, 0.5, floor=0.25, cost=lambda k, c: k * k * c) == [0.75, 0.25]


def test_counts_weigh_the_budget_and_a_cheaper_row_can_still_fit():
    """cost = k·C. A 4×1 ×3 matrices, B 4×2 ×1: uniform ¼ (k = 1): 3·1 + 2 = 5, the floor too;
    A's next row (1 per row, 3 matrices) would make 8, B's 7: both pass 5, the floor stays. At ½
    (k = 2): budget 6 + 4 = 10; from 5, A's cheaper row first (8), then A's next would make 11
    while B's dearer one fits (10)."""
    shapes = [MatrixShape("a", 4, 1, 3), MatrixShape("b", 4, 2, 1)]
    assert cost_allocated_fractions(shapes, 0.25, floor=0.25, cost=lambda k, c: k * c) == [0.25, 0.25]
    assert cost_allocated_fractions(shapes, 0.5, floor=0.25, cost=lambda k, c: k * c) == [0.5, 0.5]


def test_weights_divide_a_rows_cost_when_the_rows_are_handed_out():
    """The linear case above (rows of A cost 4, of B 16; budget 80; floor 1 row each, 20). B at
    weight 8 scores 16/8 = 2 a row, below A's 4: B takes 3 rows (68; a fourth would make 84), then
    A 3 (80): ½ each. Weights that are all equal change nothing, and neither does B at 4 (a tie:
    A comes first in input order)."""
    shapes = [MatrixShape("a", 8, 2, 1), MatrixShape("b", 8, 4, 1)]
    linear = dict(floor=0.125, cost=lambda k, c: k * c * c)
    assert cost_allocated_fractions(shapes, 0.5, weights=[1, 8], **linear) == [0.5, 0.5]
    for weights in ([3, 3], [1, 4], None):
        assert cost_allocated_fractions(shapes, 0.5, weights=weights, **linear) == [1.0, 3 / 8]
    with pytest.raises(ValueError, match="one weight per shape"):
        cost_allocated_fractions(shapes, 0.5, weights=[1], **linear)
    with pytest.raises(ValueError, match="positive finite number, got 0"):
        cost_allocated_fractions(shapes, 0.5, weights=[1, 0], **linear)
    twice = [MatrixShape("a", 8, 2, 1), MatrixShape("a again", 8, 2, 1)]
    with pytest.raises(ValueError, match="need one weight"):
        cost_allocated_fractions(twice, 0.5, weights=[1, 2], **linear)


def test_newton_schulz_flops_by_hand():
    """Dense standard NS (per step 4n²m + 2n³, n ≤ m). A 4×8: k = 1, 2: 34, 144; B 8×2: k = 2..8:
    48, 64, 80, ... (past k = 2 it is 16k + 16). Uniform ½: 144 + 80 = 224. Floor ¼: 34 + 48 = 82;
    B's rows (16 each) come first, all six (178); A's next (110) would pass 224."""
    assert [ns_flops(k, 8) for k in (1, 2)] == [STEPS * 34, STEPS * 144]
    assert [ns_flops(k, 2) for k in (2, 3, 8)] == [STEPS * 48, STEPS * 64, STEPS * 144]
    shapes = [MatrixShape("a", 4, 8, 1), MatrixShape("b", 8, 2, 1)]
    fractions = cost_allocated_fractions(shapes, 0.5, floor=0.25, cost=orthogonalize_cost("newton_schulz", False))
    assert fractions == [0.25, 1.0]
    # the model counts as the docstring does
    assert orthogonalize_flops(1, 8, "newton_schulz", False)[1] == ns_flops(1, 8)


def _flops(k: int, cols: int) -> float:
    return orthogonalize_flops(k, cols, "auto", h200_symmetric)[1]


def _total(shapes, fractions, cost) -> float:
    return sum(s.count * cost(selected_row_count(s.rows, f), s.cols) for s, f in zip(shapes, fractions))


LLAMA_384 = [MatrixShape("q", 384, 384, 12), MatrixShape("k", 128, 384, 12), MatrixShape("v", 128, 384, 12),
             MatrixShape("o", 384, 384, 12), MatrixShape("gate", 1024, 384, 12), MatrixShape("up", 1024, 384, 12),
             MatrixShape("down", 384, 1024, 12)]


@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_flop_budget_is_spent_down_to_one_row(fraction):
    fractions = cost_allocated_fractions(LLAMA_384, fraction, cost=orthogonalize_cost())
    budget = _total(LLAMA_384, [fraction] * len(LLAMA_384), _flops)
    assert _total(LLAMA_384, fractions, _flops) <= budget * (1 + 1e-12)
    assert all(fraction / 4 <= f <= 1.0 for f in fractions)
    for i, shape in enumerate(LLAMA_384):
        k = selected_row_count(shape.rows, fractions[i])
        assert k == round(fractions[i] * shape.rows)  # whole rows
        if k < shape.rows:
            more = list(fractions)
            more[i] = (k + 1) / shape.rows
            assert _total(LLAMA_384, more, _flops) > budget
    # same shape, same fraction; the short k/v matrices get their rows before the wide MLP ones
    assert fractions[0] == fractions[3] and fractions[1] == fractions[2] and fractions[4] == fractions[5]
    assert fractions[1] >= fraction and fractions[4] <= fraction


@pytest.mark.parametrize("model", ["llama-384", "llama-1b", "llama-8b", "llama-70b-slice"])
@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_modeled_time_budget_lands_on_computed_rows(model, fraction):
    """The default (modeled time): within the uniform fraction's modeled time, no shape's next row
    fits, and at ¼ on the Llama presets every shape's k is a multiple of 128 (the rows the GPU
    computes anyway: ortho.padding) or all its rows. (Elsewhere the selected rows' own traffic can
    stop a shape inside a block: 70B's down at ⅛ ends at 1377 rows.)"""
    from dion3.tools.bench.presets import MODELS

    shapes = LLAMA_384 if model == "llama-384" else list(MODELS[model].matrices)
    fractions = cost_allocated_fractions(shapes, fraction)
    budget = _total(shapes, [fraction] * len(shapes), modeled_seconds)
    assert _total(shapes, fractions, modeled_seconds) <= budget * (1 + 1e-9)
    for i, shape in enumerate(shapes):
        k = selected_row_count(shape.rows, fractions[i])
        assert model == "llama-384" or fraction != 0.25 or k == shape.rows or k % 128 == 0, (shape, k)
        if k < shape.rows:
            more = list(fractions)
            more[i] = (k + 1) / shape.rows
            assert _total(shapes, more, modeled_seconds) > budget


def test_modeled_time_moves_rows_back_to_the_mlp_on_llama_8b():
    """Equal FLOPs stepped 1.10× slower on Llama-8B (benchmarks/results/steps-h200-2026-12-02.md):
    the time model keeps more of gate/up, whose products run fastest per FLOP, and takes fewer
    rows of q/o and down than the FLOP rule."""
    from dion3.tools.bench.presets import MODELS

    shapes = list(MODELS["llama-8b"].matrices)  # q/o, k/v, gate/up, down
    by_time = [selected_row_count(s.rows, f) for s, f in zip(shapes, cost_allocated_fractions(shapes, 0.25))]
    by_flops = [selected_row_count(s.rows, f)
                for s, f in zip(shapes, cost_allocated_fractions(shapes, 0.25, cost=orthogonalize_cost()))]
    assert by_time[1] == by_flops[1] == 1024  # k/v: every row either way
    assert by_time[0] < by_flops[0] and by_time[3] < by_flops[3]
    assert _total(shapes, [k / s.rows for s, k in zip(shapes, by_flops)], modeled_seconds) > \
        1.05 * _total(shapes, [0.25] * 4, modeled_seconds)


# A step cost by blocks of 128 rows (the grid most_rows searches): T (cols 1) is concave past its
# second block, S (cols 2) convex; a block's rows all cost its price, so only block ends are worth buying.
_BLOCKS = {1: [10, 36, 37, 38], 2: [4, 12, 24, 40]}


def _block_cost(k: int, cols: int) -> float:
    return _BLOCKS[cols][-(-k // 128) - 1]


def test_most_rows_passes_the_concave_block_that_the_water_filling_stops_before():
    """T and S, 512 rows each; uniform ½ (256 rows each) costs 36 + 12 = 48, the ⅛ floor (128 each)
    4 + 10 = 14. Water-filling: S's next block (+8, 22), S's next (+12, 34); then T's +26 and S's
    +16 both pass 48: T ¼, S ¾, 512 rows. The most rows within 48: all of T (38) and S's floor (4),
    640 rows at 42, where S's next block (+8) no longer fits."""
    shapes = [MatrixShape("t", 512, 1, 1), MatrixShape("s", 512, 2, 1)]
    assert cost_allocated_fractions(shapes, 0.5, cost=_block_cost) == [0.25, 0.75]
    assert cost_allocated_fractions(shapes, 0.5, cost=_block_cost, most_rows=True) == [1.0, 0.25]
    # weighted rows: S's rows at weight 3 make T's floor and S's 384 rows (128 + 3·384 = 1280 at 34)
    # the most, against all of T and S's floor (512 + 3·128 = 896)
    assert cost_allocated_fractions(shapes, 0.5, cost=_block_cost, most_rows=True, weights=[1, 3]) == [0.25, 0.75]


@pytest.mark.parametrize("fraction", [0.375, 0.5])
def test_most_rows_selects_at_least_the_rows_of_every_allocation_on_the_grid(fraction):
    """Against every allocation of llama-384's shapes on the 128-row grid (each shape's floor, the
    multiples of 128 above it and all its rows, enumerated) within the modeled time of the uniform
    fraction: none selects more rows than most_rows, and most_rows stays within that time. The
    water-filling selects fewer (its greedy step stops below the tall matrices' cheap rows)."""
    import itertools

    shapes = LLAMA_384
    budget = _total(shapes, [fraction] * len(shapes), modeled_seconds) * (1 + 1e-9)
    choices = []
    for shape in shapes:
        low = selected_row_count(shape.rows, fraction / 4)
        choices.append(sorted({low, shape.rows, *range(128 * -(-low // 128), shape.rows, 128)}))
    best = 0
    for ks in itertools.product(*choices):
        spent = sum(s.count * modeled_seconds(k, s.cols) for s, k in zip(shapes, ks))
        if spent <= budget:
            best = max(best, sum(s.count * k for s, k in zip(shapes, ks)))

    def rows(fractions):
        return sum(s.count * selected_row_count(s.rows, f) for s, f in zip(shapes, fractions))

    most = cost_allocated_fractions(shapes, fraction, most_rows=True)
    assert rows(most) >= best and _total(shapes, most, modeled_seconds) <= budget
    assert rows(cost_allocated_fractions(shapes, fraction)) < best


@pytest.mark.parametrize("seed", range(8))
def test_most_rows_is_the_most_weighted_rows_on_the_grid_for_random_shapes_and_weights(seed):
    """Three or four random shapes (rows up to 1280, several matrices each) and weights, against every
    allocation on the grid (floor, multiples of 128, all rows) enumerated: the search prunes the
    allocations that cannot leave the later shapes their cheapest rows, and must lose none of the
    best; the water-filling after it only adds rows."""
    import functools
    import itertools
    import random

    rng = random.Random(seed)
    shapes = [MatrixShape(f"s{i}", rng.choice([192, 384, 640, 1024, 1280]), rng.choice([128, 384, 768]), rng.choice([1, 3, 8]))
              for i in range(rng.choice([3, 4]))]
    shapes = list({(s.rows, s.cols): s for s in shapes}.values())  # one weight per distinct shape
    weights = [rng.choice([0.5, 1.0, 2.0]) for _ in shapes]
    fraction = rng.choice([0.25, 0.375, 0.5])
    price = functools.lru_cache(maxsize=None)(modeled_seconds)
    budget = _total(shapes, [fraction] * len(shapes), price) * (1 + 1e-9)
    choices = []
    for shape in shapes:
        low = selected_row_count(shape.rows, fraction / 4)
        choices.append(sorted({low, shape.rows, *range(128 * -(-low // 128), shape.rows, 128)}))
    best = max(sum(s.count * w * k for s, w, k in zip(shapes, weights, ks)) for ks in itertools.product(*choices)
               if sum(s.count * price(k, s.cols) for s, k in zip(shapes, ks)) <= budget)
    most = cost_allocated_fractions(shapes, fraction, most_rows=True, weights=weights)
    got = sum(s.count * w * selected_row_count(s.rows, f) for s, w, f in zip(shapes, weights, most))
    assert got >= best - 1e-9 and _total(shapes, most, price) <= budget


def test_most_rows_searches_a_dozen_large_shapes():
    """Twelve distinct DeepSeek-like shapes (up to 18432 × 7168, up to 256 each), where the search
    keeps millions of allocations on the way: the result stays within the budget and selects at
    least the water-filling's rows."""
    import random

    rng = random.Random(0)
    picks = [(rng.choice([1024, 2048, 4096, 7168, 14336, 18432]), rng.choice([1024, 2048, 4096, 7168]),
              rng.choice([1, 8, 64, 256])) for _ in range(18)]
    shapes = [MatrixShape(f"{r}x{c}", r, c, n) for r, c, n in dict(((r, c), (r, c, n)) for r, c, n in picks).values()][:12]
    assert len(shapes) == 12
    budget = _total(shapes, [0.5] * len(shapes), modeled_seconds) * (1 + 1e-9)
    most = cost_allocated_fractions(shapes, 0.5, most_rows=True)
    greedy = cost_allocated_fractions(shapes, 0.5)

    def rows(fractions):
        return sum(s.count * selected_row_count(s.rows, f) for s, f in zip(shapes, fractions))

    assert _total(shapes, most, modeled_seconds) <= budget and rows(most) >= rows(greedy)


def test_most_rows_groups_record_their_rule_and_a_schedule_follows_it():
    """param_groups(fraction_allocation="most_rows") marks its groups, and a FractionScheduler's
    allocation of the groups' own budget gives back their fractions (it would not with the
    water-filling: ½ by cost is another allocation on these shapes)."""
    from dion3 import Dion3
    from dion3.optim.budget_schedule import BudgetAllocation
    from dion3.optim.param_groups import param_groups

    model = nn.Sequential(nn.Linear(384, 1024, bias=False), nn.Linear(1024, 384, bias=False),
                          nn.Linear(384, 384, bias=False))
    groups = param_groups(model, fraction=0.5, fraction_allocation="most_rows")
    assert all(g["fraction_most_rows"] is True and g["fraction_budget"] == 0.5 for g in groups)
    optimizer = Dion3(groups)
    allocation = BudgetAllocation(optimizer, range(len(groups)))
    assert allocation.fractions(0.5) == [g["fraction"] for g in groups]
    by_cost = param_groups(model, fraction=0.5, fraction_allocation="cost")
    assert sorted(g["fraction"] for g in by_cost) != sorted(g["fraction"] for g in groups)


def test_identical_shapes_get_the_uniform_fraction():
    for cost in (None, orthogonalize_cost()):
        for rows, cols, fraction in ((384, 384, 0.25), (1024, 384, 0.3), (10, 7, 0.5)):
            shapes = [MatrixShape("a", rows, cols, 3), MatrixShape("b", rows, cols, 5), MatrixShape("c", rows, cols, 1)]
            expected = selected_row_count(rows, fraction) / rows
            assert cost_allocated_fractions(shapes, fraction, cost=cost) == [expected] * 3
        assert cost_allocated_fractions([MatrixShape("a", 384, 384, 2)], 0.25, cost=cost) == [0.25]


def test_errors_name_the_argument():
    shapes = [MatrixShape("a", 8, 8, 1)]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="fraction must lie in"):
            cost_allocated_fractions(shapes, bad)
    for bad in (0.0, 0.5):
        with pytest.raises(ValueError, match="floor must lie in"):
            cost_allocated_fractions(shapes, 0.25, floor=bad)
    with pytest.raises(ValueError, match="no matrix shape to allocate fractions to"):
        cost_allocated_fractions([], 0.25)
    for bad in (MatrixShape("a", 0, 8, 1), MatrixShape("a", 8, -1, 1), MatrixShape("a", 8, 8, 0)):
        with pytest.raises(ValueError, match="not a positive integer"):
            cost_allocated_fractions([bad], 0.25)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4, bias=False)  # 4×8
        self.b = nn.Linear(2, 8, bias=False)  # 8×2
        self.c = nn.Linear(8, 4, bias=False)  # 4×8 again
        self.lm_head = nn.Linear(2, 5, bias=False)
        self.norm = nn.LayerNorm(2)


def test_matrix_shapes_and_groups_per_shape():
    model = Tiny()
    params = [model.a.weight, model.b.weight, model.c.weight]
    assert [(s.rows, s.cols, s.count) for s in matrix_shapes(params)] == [(4, 8, 2), (8, 2, 1)]
    assert [(s.rows, s.cols, s.count) for s in matrix_shapes([torch.zeros(3, 4, 6)])] == [(4, 6, 3)]
    assert [(s.rows, s.cols, s.count) for s in matrix_shapes([torch.zeros(3, 4, 6)], flatten=True)] == [(3, 24, 1)]
    group = {"params": params, "algorithm": "dion3", "lr": 0.1, "orthogonalizer": "newton_schulz"}
    split = cost_allocated_groups(group, 0.5, floor=0.25, cost=orthogonalize_cost("newton_schulz", False))
    # as test_newton_schulz_flops_by_hand, with two 4×8 matrices: budget 2·144 + 80 = 368, floor
    # 2·34 + 48 = 116, B's six rows at 16 (212), then A's next row adds 2·110 and passes 368
    assert [[id(p) for p in g["params"]] for g in split] == [[id(model.a.weight), id(model.c.weight)], [id(model.b.weight)]]
    assert [g["fraction"] for g in split] == [0.25, 1.0]
    assert all(g["lr"] == 0.1 and g["algorithm"] == "dion3" for g in split)


def test_param_groups_split_the_matrices_by_cost():
    """param_groups(..., fraction_allocation="cost"): the matrix group becomes one group per shape
    with the allocated fractions (allocation itself: the hand-computed cases above), the other
    groups stay as with "uniform", and Dion3 takes the groups as they are."""
    from dion3 import Dion3, param_groups

    model = Tiny()
    options = dict(lm_head="lm_head", lr=0.1, fraction=0.5, mu=0.6, orthogonalizer="newton_schulz")
    uniform = param_groups(model, **options)
    cost = param_groups(model, fraction_allocation="cost", **options)
    fractions = cost_allocated_fractions([MatrixShape("a", 4, 8, 2), MatrixShape("b", 8, 2, 1)], 0.5,
                                         method="newton_schulz")
    assert [[id(p) for p in g["params"]] for g in cost[:2]] == [[id(model.a.weight), id(model.c.weight)], [id(model.b.weight)]]
    assert [g["fraction"] for g in cost[:2]] == fractions and fractions != [0.5, 0.5]
    assert all(g["lr"] == 0.1 and g["mu"] == 0.6 and "algorithm" not in g for g in cost[:2])
    assert [{k: v for k, v in g.items() if k != "params"} for g in cost[2:]] == [
        {k: v for k, v in g.items() if k != "params"} for g in uniform[1:]]
    optimizer = Dion3(cost)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="fraction_allocation must be one of"):
        param_groups(model, fraction_allocation="cheap", **options)
    with pytest.raises(ValueError, match="needs fraction="):
        param_groups(model, lm_head="lm_head", fraction_allocation="cost")
    with pytest.raises(ValueError, match="row-selecting algorithm"):
        param_groups(model, algorithm="muon", fraction_allocation="cost", **options)


def test_fraction_weights_pick_matrices_by_name_and_shape():
    """param_groups(..., fraction_weights={part of a name: weight}): each shape's weight comes from
    its matrices' names (a and c share a shape, so they share a weight), and the groups carry the
    fractions that weights give per shape; mistakes are named."""
    from dion3 import param_groups

    model = Tiny()
    options = dict(lm_head="lm_head", lr=0.1, fraction=0.5, orthogonalizer="newton_schulz")
    shapes = [MatrixShape("a", 4, 8, 2), MatrixShape("b", 8, 2, 1)]
    for weights, per_shape in (({"b.": 4.0}, [1.0, 4.0]), ({"a.": 8.0, "c.": 8.0}, [8.0, 1.0])):
        groups = param_groups(model, fraction_allocation="cost", fraction_weights=weights, **options)
        expected = cost_allocated_fractions(shapes, 0.5, method="newton_schulz", weights=per_shape)
        assert [g["fraction"] for g in groups[:2]] == expected
        # what a FractionScheduler needs to allocate another budget by the same rule
        assert all((g["fraction_budget"], g["fraction_weights"]) == (0.5, weights) for g in groups[:2])
    assert cost_allocated_fractions(shapes, 0.5, method="newton_schulz", weights=[8.0, 1.0]) != \
        cost_allocated_fractions(shapes, 0.5, method="newton_schulz")  # the weights move rows here
    with pytest.raises(ValueError, match="'a.weight' .weight 2. and 'c.weight' .weight 1. share the shape 4x8"):
        param_groups(model, fraction_allocation="cost", fraction_weights={"a.": 2.0}, **options)
    with pytest.raises(ValueError, match=r"no matrix of the group has \['mlp'\]"):
        param_groups(model, fraction_allocation="cost", fraction_weights={"mlp": 2.0}, **options)
    with pytest.raises(ValueError, match="the fraction weight of 'b.' must be a positive finite number, got -1"):
        param_groups(model, fraction_allocation="cost", fraction_weights={"b.": -1}, **options)
    with pytest.raises(ValueError, match="matches the fraction weights of"):
        param_groups(model, fraction_allocation="cost", fraction_weights={"a.": 2.0, "weight": 2.0}, **options)
    with pytest.raises(ValueError, match="fraction_weights weigh the rows of fraction_allocation='cost'"):
        param_groups(model, fraction_weights={"b.": 2.0}, **options)


def test_step_flops_by_hand():
    """Dion3 ½ of a 4×8 (2 rows: 144 per NS step) and a 8×2 (4 rows: 80), Muon on a 8×2 (all 8
    rows: 144), AdamW nothing."""
    model = Tiny()
    groups = [
        {"params": [model.a.weight, model.b.weight], "algorithm": "dion3", "fraction": 0.5, "orthogonalizer": "newton_schulz"},
        {"params": [model.b.weight], "algorithm": "muon", "orthogonalizer": "newton_schulz"},
        {"params": [model.lm_head.weight], "algorithm": "adamw"},
    ]
    assert step_orthogonalize_flops(groups, symmetric=False) == STEPS * (144 + 80 + 144)


def test_training_run_counts_its_optimizer_flops():
    """A 3-step run of the tiny GPT: each run counts the FLOPs of its groups' fractions, and the
    per-step count is the same every step (fixed fractions); AdamW counts none."""
    from dion3.tools.train import data
    from dion3.tools.train.model import GPTConfig

    config = GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32)
    tokens = torch.tensor(list((b"def f(x):\n    return x + 1\n" * 200)[:3000]))
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    schedule = trainer.Schedule(steps=3, batch_size=2, eval_every=3, eval_batches=1)
    run = {allocation: trainer.train(trainer.RunSpec("d", "dion3", 0.04, 0.25, 0.3, fraction_allocation=allocation), config,
                                     schedule, corpus, torch.device("cpu"))
           for allocation in ("uniform", "cost")}
    # d = 32: q, k, v, proj 32×32 (8 rows at ¼), fc 128×32 (32 rows), proj 32×128 (8 rows), by the per-matrix model
    per_step = sum(orthogonalize_flops(k, cols, "auto", h200_symmetric)[1] for k, cols in [(8, 32)] * 4 + [(32, 32), (8, 128)])
    assert orthogonalize_flops(32, 32, "auto", h200_symmetric)[1] == ns_flops(32, 32)  # square: standard NS
    assert run["uniform"].optimizer_flops == 3 * per_step and run["uniform"].average_fraction == 0.25
    # cost: the same fractions every step, so the average is the row-weighted mean of the groups' fractions
    groups = trainer.build_optimizer(trainer.GPT(dataclasses.replace(config, vocab_size=256)),
                                     trainer.RunSpec("d", "dion3", 0.04, 0.25, fraction_allocation="cost")).param_groups
    dion3 = [g for g in groups if g["algorithm"] == "dion3"]
    rows = [sum(p.shape[0] for p in g["params"]) for g in dion3]
    assert len(dion3) == 3 and sum(rows) == 4 * 32 + 128 + 32
    assert run["cost"].average_fraction == pytest.approx(sum(r * g["fraction"] for r, g in zip(rows, dion3)) / sum(rows))
    assert run["cost"].optimizer_flops == pytest.approx(3 * step_orthogonalize_flops(groups))
    assert run["cost"].optimizer_flops > 0
    adamw = trainer.train(trainer.RunSpec("a", "adamw", 0.01), config, schedule, corpus, torch.device("cpu"))
    assert adamw.optimizer_flops == 0.0


def _table(text: str) -> list[dict]:
    """The rows of describe_fractions' table (not its total), by column name."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    return [r for r in rows if r["group"] != "all"]


def test_describe_fractions_prints_the_groups_allocation():
    """The table of param_groups(..., fraction_allocation="cost") on Tiny at ½ (newton_schulz):
    the fractions and k that cost_allocated_groups gives the same matrices, the k checked by hand
    (k = ⌈f·rows⌉: 4×8 at ¼ is 1 row, 8×2 at 1 all 8; at the uniform ½, 2 and 4), the modeled
    time of each shape's matrices, and the line that the allocation is the same on every device."""
    from dion3 import describe_fractions, param_groups

    model = Tiny()
    options = dict(lm_head="lm_head", lr=0.1, fraction=0.5, orthogonalizer="newton_schulz")
    groups = param_groups(model, fraction_allocation="cost", **options)
    text = describe_fractions(groups, 0.5)
    rows = _table(text)
    by_hand = cost_allocated_groups(dict(params=[model.a.weight, model.b.weight, model.c.weight],
                                         orthogonalizer="newton_schulz"), 0.5)
    assert [(r["rows × cols"], int(r["matrices"])) for r in rows] == [("4×8", 2), ("8×2", 1)]
    assert [float(r["fraction"]) for r in rows] == [g["fraction"] for g in by_hand] == [0.25, 1.0]
    assert [int(r["k"]) for r in rows] == [selected_row_count(4, 0.25), selected_row_count(8, 1.0)] == [1, 8]
    assert [int(r["k at 0.5"]) for r in rows] == [2, 4]
    assert [r["parameters"] for r in rows] == ["{a,c}.weight", "b.weight"]
    for row, (k, cols, count) in zip(rows, [(1, 8, 2), (8, 2, 1)]):
        assert float(row["modeled µs"]) == pytest.approx(count * modeled_seconds(k, cols, "newton_schulz") * 1e6, rel=1e-3)
    assert "same fractions" in text and "every device and every rank, CPU included" in text and "H200" in text
    assert "Not orthogonalized: groups 2, 3 (adamw, 3 parameters)" in text
    # a model in, the same table: param_groups(model, fraction=..., fraction_allocation="cost", ...)
    assert describe_fractions(model, **options) == text
    # uniform groups: one group, every shape at ½, the comparison equal to the allocation
    uniform = _table(describe_fractions(param_groups(model, **options)))
    assert [(r["group"], r["fraction"], r["k"], r["k at 0.5"]) for r in uniform] == [("0", "0.5", "2", "2"),
                                                                                   ("0", "0.5", "4", "4")]
    # without the uniform fraction, groups of different fractions are listed without a comparison
    assert "k at" not in describe_fractions(groups) and "pass fraction=" in describe_fractions(groups)
    with pytest.raises(ValueError, match="a model needs fraction="):
        describe_fractions(model, lm_head="lm_head")
    with pytest.raises(TypeError, match="are for a model"):
        describe_fractions(groups, 0.5, lm_head="lm_head")
    with pytest.raises(ValueError, match="fraction must lie in"):
        describe_fractions(groups, 1.5)


def test_dion3_fractions_of_a_hugging_face_config(tmp_path, capsys):
    """--hf-config: Llama-3-8B's config.json gets llama-8b's fractions; a Mixtral-style config's
    experts are stacks whose every expert counts as a matrix (8 experts × 2 stacks × 2 layers)
    and share their shape's fraction; a model named twice is refused."""
    from dion3.tools.cli import main

    config = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
                  num_key_value_heads=8, vocab_size=128256)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["fractions", "--hf-config", str(tmp_path / "config.json"), "--fraction", "3/8"]) == 0
    from_config = _table(capsys.readouterr().out)
    assert main(["fractions", "--preset", "llama-8b", "--fraction", "3/8"]) == 0
    assert from_config == _table(capsys.readouterr().out)
    moe = dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_hidden_layers=2, num_local_experts=8,
               num_experts_per_tok=2, vocab_size=100)
    (tmp_path / "moe.json").write_text(json.dumps(moe))
    assert main(["fractions", "--hf-config", str(tmp_path / "moe.json"), "--fraction", "1/2"]) == 0
    rows = {r["parameters"]: r for r in _table(capsys.readouterr().out)}
    assert (rows["experts.gate,up"]["rows × cols"], rows["experts.gate,up"]["matrices"]) == ("512×128", str(8 * 2 * 2))
    assert (rows["experts.down"]["rows × cols"], rows["experts.down"]["matrices"]) == ("128×512", str(8 * 2))
    assert main(["fractions", "--hf-config", str(tmp_path / "moe.json"), "--preset", "llama-8b"]) == 2
    assert "--preset and --hf-config each name the model" in capsys.readouterr().err


def test_dion3_fractions_command(capsys):
    """`dion3 fractions`: a preset's fractions and k as cost_allocated_fractions gives them (llama-384
    at ¼: q/o ⅓, k/v 1, gate/up ⅛, down ⅔, as docs/training.md lists them); --shapes; bad input."""
    from dion3.tools.bench.presets import PRESETS
    from dion3.tools.cli import main

    assert main(["fractions", "--preset", "llama-384", "--fraction", "0.25"]) == 0
    text = capsys.readouterr().out
    shapes = PRESETS["llama-384"].matrices
    expected = cost_allocated_fractions(shapes, 0.25)
    rows = _table(text)
    assert [r["parameters"] for r in rows] == ["q,o", "k,v", "gate,up", "down"]
    assert [float(r["fraction"]) for r in rows] == pytest.approx(expected, rel=1e-3)
    assert [int(r["k"]) for r in rows] == [selected_row_count(s.rows, f) for s, f in zip(shapes, expected)] \
        == [128, 128, 128, 256]
    assert [int(r["k at 0.25"]) for r in rows] == [96, 32, 256, 96]
    assert "CPU included" in text
    # --most-rows: at ½ the llama-384 MLP's gate/up keep every row (of 1024; past 384 rows the price
    # of a row is small) and q/o and down ⅓, 0.78 of all rows
    assert main(["fractions", "--preset", "llama-384", "--fraction", "1/2", "--most-rows"]) == 0
    text = capsys.readouterr().out
    assert "dion3-1/2-rows" in text and 'fraction_allocation="most_rows"' in text
    assert [int(r["k"]) for r in _table(text)] == [128, 128, 1024, 128]
    assert main(["fractions", "--shapes", "64x64:2,16x64:3", "--fraction", "0.5"]) == 0
    assert [(r["rows × cols"], r["matrices"]) for r in _table(capsys.readouterr().out)] == [("64×64", "2"), ("16×64", "3")]
    assert main(["fractions", "--preset", "nope"]) == 2
    assert "unknown model 'nope'; dion3 fractions --preset takes 14b, 7b, cpu-small, cpu-tiny" in capsys.readouterr().err
    assert main(["fractions", "--fraction", "0"]) == 2
