"""Fractions by cost where more rows can cost less (dion3.optim.cost_fractions): rows priced at the
cheapest way to select at least k of them. The allocation never exceeds the budget, no allocation
selects as many rows of every shape in no more time, no shape's next row fits, and where cost never
falls with k the rows are those of the per-row rule that came before."""
from __future__ import annotations

import functools
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dion3.optim.cost_fractions import BUDGET_TOLERANCE, cost_allocated_fractions, efficient_rows
from dion3.ortho.cost import MatrixShape, modeled_seconds
from dion3.rules import selected_row_count

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _time(shapes, ks, cost) -> float:
    return sum(s.count * cost(k, s.cols) for s, k in zip(shapes, ks))


def _rows(shapes, fractions) -> list[int]:
    return [selected_row_count(s.rows, f) for s, f in zip(shapes, fractions)]


def per_row_rule(shapes, fraction, cost, floor=None, weights=None) -> list[float]:
    """The rule before the envelope, written out: from ⌈floor·rows⌉, the shape whose next row costs
    the least (cost(k + 1) − cost(k), divided by its weight; first in order among equals) gets one
    more, while one fits. Shapes must be distinct."""
    floor = fraction / 4 if floor is None else floor
    weights = weights or [1.0] * len(shapes)
    ks = [selected_row_count(s.rows, floor) for s in shapes]
    limit = _time(shapes, [selected_row_count(s.rows, fraction) for s in shapes], cost) * (1 + BUDGET_TOLERANCE)
    total = _time(shapes, ks, cost)
    while True:
        options = []
        for i, (s, k) in enumerate(zip(shapes, ks)):
            step = cost(k + 1, s.cols) - cost(k, s.cols) if k < s.rows else math.inf
            if step < math.inf and total + s.count * step <= limit:
                options.append((step / weights[i], i))
        if not options:
            return [k / s.rows for s, k in zip(shapes, ks)]
        i = min(options)[1]
        total += shapes[i].count * (cost(ks[i] + 1, shapes[i].cols) - cost(ks[i], shapes[i].cols))
        ks[i] += 1


def check_allocation(shapes, fraction, fractions, cost, floor=None) -> None:
    """Within the budget, at or above the floor, undominated and not extendable by one shape.
    Time adds up over shapes, so an allocation B with as many rows everywhere as A costs at least
    A's time plus, for each shape B raises, cost(b) − cost(a): B ≥ A at no more time exists iff
    some shape has a larger k at no more cost. brute_force_check searches every B instead."""
    floor = fraction / 4 if floor is None else floor
    ks = _rows(shapes, fractions)
    limit = _time(shapes, _rows(shapes, [fraction] * len(shapes)), cost) * (1 + BUDGET_TOLERANCE)
    total = _time(shapes, ks, cost)
    assert total <= limit
    for s, k, f in zip(shapes, ks, fractions):
        assert selected_row_count(s.rows, floor) <= k <= s.rows and k == round(f * s.rows)  # whole rows
        for larger in range(k + 1, s.rows + 1):
            raised = cost(larger, s.cols) - cost(k, s.cols)
            assert raised > 0, (s, k, larger)  # as many rows everywhere, more here, in no more time
            assert total + s.count * raised > limit, (s, k, larger)  # a shape could still be raised


def test_efficient_rows_by_hand():
    """costs 5, 3, 4, 4, 6, 5 for k = 1..6: 6 rows cost less than 5; 4 rows as much as 3 (so 3 is
    bought as 4) and less than 5 or 6; 2 rows less than any more; 1 row more than 2."""
    table = {1: 5.0, 2: 3.0, 3: 4.0, 4: 4.0, 5: 6.0, 6: 5.0}
    cost = lambda k, cols: table[k]  # noqa: E731
    assert efficient_rows(cost, 1, 1, 6) == [(2, 3.0), (4, 4.0), (6, 5.0)]
    assert efficient_rows(cost, 1, 3, 6) == [(4, 4.0), (6, 5.0)]
    assert efficient_rows(cost, 1, 6, 6) == [(6, 5.0)]


ISSUE = [MatrixShape("192x64", 192, 64, 2), MatrixShape("64x64", 64, 64, 2), MatrixShape("256x64", 256, 64, 2),
         MatrixShape("64x256", 64, 256, 2)]


@pytest.mark.parametrize("fraction", [0.5, 0.375])
def test_more_rows_for_less_time_on_the_reported_shapes(fraction):
    """`dion3 fractions --shapes 192x64:2,64x64:2,256x64:2,64x256:2` at ½ and ⅜ gave ⅛ and 3/32
    everywhere at 1.025× and 1.022× the budget. The modeled µs of one k × 64 matrix (every rows):
    Gram NS up to k = 80 (0.4622 + 0.00014·(k − 1) to k = 64, 0.4810 from 65, 0.4933 from 73),
    standard NS from 81, cheaper: 0.3710 from 81, 0.3892 from 89, 0.4084 from 97, 0.4287 from 105,
    0.4502 from 113 (blocks of 8: the long side pads to 8), each + 0.00014 a row in its block;
    64 × 256: 0.6657 + 0.00056·(k − 1). Per matrix pair the budget is cost(96) + cost(32) +
    cost(128) + cost(32, 256) = 0.3902 + 0.4666 + 0.4738 + 0.6832 = 2.0138 at ½, and cost(72) +
    cost(24) + cost(96) + cost(24, 256) = 0.4820 + 0.4655 + 0.3902 + 0.6787 = 2.0164 at ⅜.
    From the floors (⅛: 24, 8, 32, 8 rows; 3/32: 18, 6, 24, 6) the 64-column shapes start at
    k = 81, the cheapest way to at least their floor: 1.8748 at ½ (1.8734 at ⅜). Then by price:
    the rows at 0.00014 (192x64 and 256x64 to 88, 64x64 to all 64), 64x256's at 0.00056 (all
    64): 1.9162 (1.9162); then the steps up at 89 (0.0172), 97 (0.0182), 105 (0.0193), 192x64
    first among equals, each followed by its block's rows: 192x64 to 96, 256x64 to 96, 192x64
    to 104, 256x64 to 104, 192x64 to 112 (2.0114 at either); 256x64's step at 105
    (0.0193) and 192x64's at 113 (0.0205) pass both budgets. So 112, 64, 104, 64 rows at either."""
    fractions = cost_allocated_fractions(ISSUE, fraction)
    assert _rows(ISSUE, fractions) == [112, 64, 104, 64]
    check_allocation(ISSUE, fraction, fractions, modeled_seconds)
    budget = _time(ISSUE, _rows(ISSUE, [fraction] * 4), modeled_seconds)
    assert _time(ISSUE, _rows(ISSUE, [fraction / 4] * 4), modeled_seconds) > budget  # what was reported
    # brute force: every allocation with as many rows of each shape costs more
    chosen = _rows(ISSUE, fractions)
    time = _time(ISSUE, chosen, modeled_seconds)
    for ks in itertools.product(*(range(k, s.rows + 1) for s, k in zip(ISSUE, chosen))):
        assert ks == tuple(chosen) or _time(ISSUE, ks, modeled_seconds) > time


def brute_force_check(shapes, fraction, fractions, cost, floor) -> None:
    """Every allocation from the floors up: none with as many rows of every shape costs no more
    than the chosen one (other than itself), and none that raises one shape fits the budget."""
    chosen = _rows(shapes, fractions)
    time = _time(shapes, chosen, cost)
    limit = _time(shapes, _rows(shapes, [fraction] * len(shapes)), cost) * (1 + BUDGET_TOLERANCE)
    assert time <= limit
    lows = [selected_row_count(s.rows, floor) for s in shapes]
    for ks in itertools.product(*(range(low, s.rows + 1) for s, low in zip(shapes, lows))):
        if ks != tuple(chosen) and all(k >= c for k, c in zip(ks, chosen)):
            assert _time(shapes, ks, cost) > time, (ks, chosen)
            if sum(k != c for k, c in zip(ks, chosen)) == 1:
                assert _time(shapes, ks, cost) > limit, (ks, chosen)


@st.composite
def tables(draw, monotone=False):
    """2–3 distinct shapes of up to 6 rows, cols 1–3, and a cost table per cols over k = 1..6
    (integers: sums are exact), rising with k where `monotone`."""
    shapes = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 3)), min_size=2,
                           max_size=3, unique_by=lambda t: t[:2]))
    steps = st.integers(0, 9) if monotone else st.integers(-6, 9)
    table = {}
    for cols in {c for _, c, _ in shapes}:
        values = [draw(st.integers(1, 20))]
        for _ in range(5):
            values.append(max(1, values[-1] + draw(steps)))
        table.update({(k + 1, cols): float(v) for k, v in enumerate(values)})
    weights = draw(st.one_of(st.none(), st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=len(shapes),
                                                  max_size=len(shapes))))
    fraction = draw(st.sampled_from([1 / 6, 0.25, 1 / 3, 0.5, 2 / 3, 1.0]))
    floor = draw(st.sampled_from([None, fraction]))
    return ([MatrixShape(f"{r}x{c}", r, c, n) for r, c, n in shapes], lambda k, c: table[(k, c)], weights, fraction,
            floor)


@PROPERTY_SETTINGS
@given(tables())
def test_small_cases_by_brute_force(case):
    shapes, cost, weights, fraction, floor = case
    fractions = cost_allocated_fractions(shapes, fraction, floor=floor, cost=cost, weights=weights)
    brute_force_check(shapes, fraction, fractions, cost, fraction / 4 if floor is None else floor)
    check_allocation(shapes, fraction, fractions, cost, floor)


@PROPERTY_SETTINGS
@given(tables(monotone=True))
def test_where_cost_never_falls_the_rows_are_the_per_row_rules(case):
    shapes, cost, weights, fraction, floor = case
    assert cost_allocated_fractions(shapes, fraction, floor=floor, cost=cost, weights=weights) == \
        per_row_rule(shapes, fraction, cost, floor, weights)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 320), st.sampled_from([16, 64, 96, 128, 160, 256, 384, 512]), st.integers(1, 8)),
                min_size=1, max_size=4, unique_by=lambda t: t[:2]),
       st.sampled_from([0.125, 0.25, 0.375, 0.5, 0.75, 1.0]), st.sampled_from(["polar_express", "polar_express_4"]))
def test_modeled_time_on_random_shapes(shapes, fraction, schedule):
    """The default cost (modeled H200 seconds), whose bumps are the ones reported."""
    shapes = [MatrixShape(f"{r}x{c}", r, c, n) for r, c, n in shapes]
    cost = lambda k, cols: modeled_seconds(k, cols, "auto", schedule)  # noqa: E731
    check_allocation(shapes, fraction, cost_allocated_fractions(shapes, fraction, schedule=schedule), cost)


def _study_shapes() -> dict[str, list[MatrixShape]]:
    """The bench presets (dion3.tools.bench.presets.PRESETS: llama-384, llama-hf-110m and -350m are
    study models) and the other study models' matrices as their trainers group them
    (dion3.tools.study.MODELS; cpu-tiny: `dion3 compare`'s preset), with the fractions they had
    before the envelope where every shape's k was already the cheapest way to itself."""
    from dion3.tools.bench.presets import PRESETS, parse_shapes

    # gpt-tiny, the smoke model: its old allocations were dominated (benchmarks/results/fractions-by-cost-2026-12-06.md)
    shapes = {name: _merged(preset.matrices) for name, preset in PRESETS.items() if name != "gpt-tiny"}
    for name, text in (("gpt-25m", "512x512:32,2048x512:8,512x2048:8"), ("gpt-120m", "768x768:64,3072x768:16,768x3072:16"),
                       ("llama-hf", "512x512:16,256x512:16,1536x512:16,512x1536:8"),
                       ("cpu-tiny", "256x256:8,1024x256:2,256x1024:2")):
        shapes[name] = list(parse_shapes(text).matrices)
    return shapes


def _merged(matrices) -> list[MatrixShape]:
    """One entry per matrix shape, as param_groups groups a model's matrices (7b's k, v are 4096 ×
    4096 like its q, o: one shape, one fraction)."""
    counts: dict[tuple[int, int], int] = {}
    for m in matrices:
        counts[(m.rows, m.cols)] = counts.get((m.rows, m.cols), 0) + m.count
    return [MatrixShape(f"{r}x{c}", r, c, n) for (r, c), n in counts.items()]


@pytest.mark.parametrize("fraction", [0.25, 0.375, 0.5])
def test_presets_and_study_models_keep_their_fractions(fraction):
    """llama-384 as the quality study ran it (benchmarks/results/fractions-by-cost-2026-12-06.md),
    and every preset and study model as the per-row rule allocates it (their costs do not fall
    within their allocations' reach), with 4 Newton–Schulz steps too."""
    before = {0.25: [1 / 3, 1.0, 0.125, 2 / 3], 0.375: [2 / 3, 1.0, 0.25, 1.0], 0.5: [1.0, 1.0, 0.25, 2 / 3]}
    from dion3.tools.bench.presets import PRESETS

    assert cost_allocated_fractions(list(PRESETS["llama-384"].matrices), fraction) == pytest.approx(before[fraction],
                                                                                                    rel=1e-12)
    for name, shapes in _study_shapes().items():
        for schedule in ("polar_express", "polar_express_4"):
            cost = functools.lru_cache(maxsize=None)(lambda k, cols: modeled_seconds(k, cols, "auto", schedule))
            assert cost_allocated_fractions(shapes, fraction, schedule=schedule) == \
                per_row_rule(shapes, fraction, cost), (name, schedule)
