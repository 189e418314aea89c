"""A fraction that changes between steps: FractionWarmup's values, the scheduler against setting
the fraction by hand and against the float64 reference, validation, checkpoints, the captured
step's graph bookkeeping (CPU, with stand-ins for capture) and, on a GPU, captured vs eager."""
from __future__ import annotations

import copy
import io
import pathlib
import re

import pytest
import torch

import dion3
import gloo
from dion3 import Dion3, FractionScheduler, FractionWarmup, PeriodicFull, param_groups
from dion3.optim.cost_fractions import cost_allocated_fractions, matrix_shapes
from dion3.optim.graph import CapturedStep, selection_key, to_device_scalars
from dion3.tools.train.model import GPT, GPTConfig
from graph_standin import CPUCapturedStep
from reference import ReferenceOptimizer, selected_count

SHAPES = [(16, 12), (16, 12), (20, 8), (2, 12, 10)]  # a 3-D stack: stacked=True
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def make_params(shapes=SHAPES, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).to(device)) for s in shapes]


def grads_at(step, shapes=SHAPES, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen, dtype=dtype).to(device) for s in shapes]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


# ------------------------------------------------------------------------- FractionWarmup
def test_warmup_values_by_hand():
    # 1 → ¼ over 4 steps: 1 − ¾·s/4
    assert [FractionWarmup(0.25, 4)(s) for s in range(7)] == [1.0, 0.8125, 0.625, 0.4375, 0.25, 0.25, 0.25]
    # 4 levels (1, ¾, ½, ¼) over 6 steps: progress s/6 rounded to the nearest third
    assert [FractionWarmup(0.25, 6, levels=4)(s) for s in range(8)] == [1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25, 0.25]
    assert [FractionWarmup(0.5, 2, start=0.75)(s) for s in range(3)] == [0.75, 0.625, 0.5]
    assert FractionWarmup(0.25, 0)(0) == 0.25  # no warm-up: the target from the start


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(target=0.0, steps=10), "target"),
    (dict(target=0.25, steps=10, start=1.5), "start"),
    (dict(target=0.25, steps=-1), "steps"),
    (dict(target=0.25, steps=2.5), "steps"),
    (dict(target=0.25, steps=10, levels=1), "levels"),
])
def test_warmup_rejects_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        FractionWarmup(**kwargs)


# ------------------------------------------------------------------------- PeriodicFull
def test_periodic_full_values_by_hand():
    # every 4th step (steps 3, 7, 11 counted from 0) every row, ½ on the others: ⅝ of the rows on average
    assert [PeriodicFull(0.5, every=4)(s) for s in range(12)] == [0.5, 0.5, 0.5, 1.0] * 3
    assert sum(PeriodicFull(0.5, every=4)(s) for s in range(4000)) / 4000 == 0.5 + 0.5 / 4
    assert [PeriodicFull(0.25, every=1)(s) for s in range(3)] == [1.0] * 3  # every step full
    assert [PeriodicFull(0.25, every=3).full(s) for s in range(6)] == [False, False, True] * 2
    # over a warm-up: the warm-up's fraction on the other steps
    assert [PeriodicFull(FractionWarmup(0.25, 4), every=3)(s) for s in range(7)] == [
        1.0, 0.8125, 1.0, 0.4375, 0.25, 1.0, 0.25]


@pytest.mark.parametrize("args, kwargs, fragment", [
    ((0.0,), dict(every=4), "PeriodicFull: fraction must lie in (0.0, 1.0], got 0.0"),
    ((1.5,), dict(every=4), "fraction must lie in (0.0, 1.0]"),
    ((0.5,), dict(every=0), "PeriodicFull: every must be an integer ≥ 1, got 0"),
    ((0.5,), dict(every=2.0), "every must be an integer ≥ 1"),
    ((0.5,), dict(every=True), "every must be an integer ≥ 1"),
])
def test_periodic_full_rejects_bad_arguments(args, kwargs, fragment):
    with pytest.raises(ValueError) as caught:
        PeriodicFull(*args, **kwargs)
    assert fragment in str(caught.value)


def test_periodic_full_sets_each_steps_fraction_and_full_steps_move_every_row():
    """Over a uniform group: the fraction set before each step, and the rows that step moves
    (weight decay off: only selected rows move): every row on the full steps, k of ½ otherwise."""
    params = make_params()
    opt = Dion3(params, lr=0.05, fraction=0.5, weight_decay=0.0, stacked=True)
    scheduler = FractionScheduler(opt, PeriodicFull(0.5, every=3))
    rows = [s[-2] for s in SHAPES[:3]] + [SHAPES[3][1]] * 2
    held = []
    for step in range(7):
        held.append(opt.param_groups[0]["fraction"])
        set_grads(params, grads_at(step))
        before = [p.detach().clone() for p in params]
        opt.step()
        scheduler.step()
        moved = _moved_rows(before, [p.detach() for p in params])
        assert moved == [selected_count(r, held[-1]) for r in rows], step
    assert held == [0.5, 0.5, 1.0, 0.5, 0.5, 1.0, 0.5]


def test_periodic_full_over_groups_by_cost_spends_budget_one_on_full_steps():
    """Groups by cost: the schedule is their budget, so a full step is budget 1, every row of
    every shape; the other steps hold the allocation param_groups gave them."""
    model = _linears(64, 256, 512, 256)
    opt = Dion3(param_groups(model, lm_head=False, fraction=0.375, fraction_allocation="cost"))
    costed = [g for g in opt.param_groups if g["algorithm"] == "dion3"]
    given = [g["fraction"] for g in costed]
    assert len(set(given)) > 1 and min(given) < 1.0
    scheduler = FractionScheduler(opt, PeriodicFull(0.375, every=4))
    for step in range(9):
        full = step % 4 == 3
        assert [g["fraction"] for g in costed] == ([1.0] * len(costed) if full else given), step
        assert all(g["fraction_budget"] == (1.0 if full else 0.375) for g in costed)
        scheduler.step()


# ------------------------------------------------------------------------- eager steps
def _moved_rows(before, after):
    """Rows that changed, per matrix (no weight decay: only selected rows move)."""
    out = []
    for x0, x1 in zip(before, after):
        x0, x1 = x0.reshape(-1, *x0.shape[-2:]), x1.reshape(-1, *x1.shape[-2:])
        out += [int((a != b).any(dim=1).sum()) for a, b in zip(x0, x1)]
    return out


def test_scheduled_fraction_equals_setting_it_by_hand():
    """The scheduler sets exactly what a user setting group['fraction'] before each step sets;
    k follows the fraction (rows moved = ⌈f·rows⌉), and groups other than Dion3's are untouched."""
    schedule = FractionWarmup(0.25, 4)
    scheduled, by_hand = make_params(), make_params()
    bias_a, bias_b = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    opt_a = Dion3([dict(params=scheduled, stacked=True), dict(params=[bias_a], algorithm="adamw", lr=0.01)], lr=0.05,
                  weight_decay=0.0)
    opt_b = Dion3([dict(params=by_hand, stacked=True), dict(params=[bias_b], algorithm="adamw", lr=0.01)], lr=0.05,
                  weight_decay=0.0)
    scheduler = FractionScheduler(opt_a, schedule)
    assert scheduler.groups == [0]
    fractions = [1.0, 0.8125, 0.625, 0.4375, 0.25, 0.25]
    for step, fraction in enumerate(fractions):
        opt_b.param_groups[0]["fraction"] = fraction
        assert opt_a.param_groups[0]["fraction"] == fraction and scheduler.get_last_fraction() == [fraction]
        grads = grads_at(step)
        set_grads(scheduled, grads)
        set_grads(by_hand, grads)
        bias_a.grad, bias_b.grad = torch.ones(5), torch.ones(5)
        before = [p.detach().clone() for p in scheduled]
        opt_a.step()
        opt_b.step()
        scheduler.step()
        rows = [s[-2] for s in SHAPES[:3]] + [SHAPES[3][1]] * 2
        assert _moved_rows(before, [p.detach() for p in scheduled]) == [selected_count(r, fraction) for r in rows]
        for a, b in zip(scheduled + [bias_a], by_hand + [bias_b]):
            assert torch.equal(a, b)
    assert opt_a.param_groups[1]["fraction"] == 0.25  # the AdamW group's (unused) default, untouched


def test_scheduled_fraction_matches_float64_reference(exact_orthogonalizer):
    """Against tests/reference.py (float64, one matrix at a time) fed the same fractions."""
    shapes = [(16, 12), (12, 20)]
    params = make_params(shapes, dtype=torch.float64)
    opt = Dion3(params, lr=0.05, mu=0.6, weight_decay=0.1)
    scheduler = FractionScheduler(opt, FractionWarmup(0.25, 3))
    ref = ReferenceOptimizer(params, "dion3", lr=0.05, mu=0.6, weight_decay=0.1)
    for step in range(5):
        ref.fraction = [1.0, 0.75, 0.5, 0.25, 0.25][step]
        grads = grads_at(step, shapes, torch.float64)
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
        scheduler.step()
        assert [len(chosen[0]) for chosen in ref.selected] == [selected_count(r, ref.fraction) for r, _ in shapes]
        for p, expected in zip(params, ref.params):
            torch.testing.assert_close(p.detach(), expected, rtol=2e-6, atol=2e-7)


def test_dion2_groups_are_scheduled_and_their_rows_follow_k():
    # Dion2 selects rows like Dion3: the scheduler takes its groups by default, and the rows that
    # move each step are k = ⌈f·rows⌉ of the 16-row matrix (weight decay off, so only they move).
    params = make_params([(16, 12)])
    opt = Dion3([dict(params=params, algorithm="dion2")], lr=0.1, weight_decay=0.0)
    scheduler = FractionScheduler(opt, FractionWarmup(0.25, 2))  # 1, 0.625, 0.25
    moved = []
    for step in range(3):
        before = params[0].detach().clone()
        set_grads(params, grads_at(step, [(16, 12)]))
        opt.step()
        scheduler.step()
        moved.append(int((params[0].detach() != before).any(dim=1).sum()))
    assert moved == [16, 10, 4]
    assert scheduler.get_last_fraction() == [0.25]


def test_fraction_outside_range_raises_naming_the_group():
    params = make_params()
    opt = Dion3([dict(params=[torch.nn.Parameter(torch.ones(3))], algorithm="adamw"), dict(params=params, stacked=True)])
    with pytest.raises(ValueError, match=r"parameter group 1 \(fraction schedule at step 0\): fraction must lie in \(0.0, 1.0\], got 1.5"):
        FractionScheduler(opt, lambda step: 1.5)
    scheduler = FractionScheduler(opt, lambda step: 0.5 if step < 2 else 0.0)
    scheduler.step()
    with pytest.raises(ValueError, match=r"parameter group 1 \(fraction schedule at step 2\).*got 0.0"):
        scheduler.step()
    with pytest.raises(ValueError, match="parameter group 0 has algorithm 'adamw'"):
        FractionScheduler(opt, lambda step: 0.5, groups=[0])
    with pytest.raises(ValueError, match="no parameter group with algorithm 'dion3' or 'dion2'"):
        FractionScheduler(Dion3([dict(params=[torch.nn.Parameter(torch.ones(3))], algorithm="adamw")]), lambda s: 0.5)
    with pytest.raises(TypeError, match="callable"):
        FractionScheduler(opt, 0.25)
    # set by hand between steps, like lr: checked when the step runs
    opt.param_groups[1]["fraction"] = 2.0
    set_grads(params, grads_at(0))
    with pytest.raises(ValueError, match=r"parameter group 1: fraction must lie in \(0.0, 1.0\], got 2.0"):
        opt.step()


def test_groups_of_different_fractions_are_scheduled_only_when_named():
    """Fractions set per group by hand would all be replaced by one schedule: the default group
    choice refuses them, an explicit `groups` schedules on purpose."""
    params = make_params([(16, 12), (20, 8)])
    opt = Dion3([dict(params=params[:1], fraction=0.5), dict(params=params[1:], fraction=0.25)])
    with pytest.raises(ValueError, match=r"different fractions \(group 0: 0.5, group 1: 0.25\).*groups=\[\.\.\.\].*"
                                         r"fraction_allocation='cost'"):
        FractionScheduler(opt, FractionWarmup(0.5, 4))
    assert [g["fraction"] for g in opt.param_groups] == [0.5, 0.25]  # the refused scheduler set nothing
    scheduler = FractionScheduler(opt, FractionWarmup(0.5, 4), groups=[1])
    assert scheduler.get_last_fraction() == [1.0] and opt.param_groups[0]["fraction"] == 0.5


def _build(params):
    opt = Dion3(params, lr=0.05, mu=0.6, weight_decay=0.1, stacked=True)
    return opt, FractionScheduler(opt, FractionWarmup(0.25, 6))


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_state_dict_round_trip_mid_schedule_is_bit_identical(optimizer_first):
    unbroken, resumed = make_params(), make_params()
    opt_u, sched_u = _build(unbroken)
    opt_r, sched_r = _build(resumed)
    for step in range(8):
        if step == 3:  # mid-schedule: save, rebuild everything, load
            buffer = io.BytesIO()
            torch.save({"model": [p.detach() for p in resumed], "optim": opt_r.state_dict(), "sched": sched_r.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            resumed = [torch.nn.Parameter(t.clone()) for t in saved["model"]]
            opt_r, sched_r = _build(resumed)
            assert opt_r.param_groups[0]["fraction"] == 1.0  # a fresh scheduler starts at step 0
            loads = [lambda: opt_r.load_state_dict(saved["optim"]), lambda: sched_r.load_state_dict(saved["sched"])]
            for load in loads if optimizer_first else loads[::-1]:
                load()
            assert sched_r.last_step == 3 and opt_r.param_groups[0]["fraction"] == FractionWarmup(0.25, 6)(3)
        for params, opt, sched in ((unbroken, opt_u, sched_u), (resumed, opt_r, sched_r)):
            set_grads(params, grads_at(step))
            opt.step()
            sched.step()
    for a, b in zip(unbroken, resumed):
        assert torch.equal(a, b)
    for a, b in zip(unbroken, resumed):
        for key, value in opt_u.state[a].items():
            assert torch.equal(value, opt_r.state[b][key]), key


def test_resume_without_scheduler_state_differs():
    """The round trip above can fail: restarting the schedule from step 0 changes the run."""
    unbroken, resumed = make_params(), make_params()
    opt_u, sched_u = _build(unbroken)
    opt_r, sched_r = _build(resumed)
    for step in range(6):
        if step == 3:
            saved = copy.deepcopy(opt_r.state_dict())
            opt_r, sched_r = _build(resumed)
            opt_r.load_state_dict(saved)  # the scheduler's state is not loaded
        for params, opt, sched in ((unbroken, opt_u, sched_u), (resumed, opt_r, sched_r)):
            set_grads(params, grads_at(step))
            opt.step()
            sched.step()
    assert any(not torch.equal(a, b) for a, b in zip(unbroken, resumed))


def test_scheduler_state_dict_is_checked():
    opt, sched = _build(make_params())
    with pytest.raises(ValueError, match="last_step"):
        sched.load_state_dict({"last_step": -1})
    with pytest.raises(ValueError, match="does not match"):
        sched.load_state_dict({"last_step": 2, "groups": [3]})


# ------------------------------------------------------------------------- groups by cost: a budget
def _readme_usage_line() -> tuple[str, float]:
    """The README's usage line (its one `optimizer = ...` of fractions by cost), as written there,
    and the budget it names."""
    line = next(line for line in README.read_text().splitlines()
                if line.startswith("optimizer = dion3.Dion3(") and 'fraction_allocation="cost"' in line)
    return line, float(re.search(r"fraction=([0-9.]+)", line)[1])


def _allocated(groups, budget):
    """The fraction by cost of each group's shape at `budget`, from the allocation itself (every
    group by cost holds one shape); every row at budget 1."""
    shapes = [shape for g in groups for shape in matrix_shapes(g["params"], g.get("flatten", False))]
    assert len(shapes) == len(groups)
    return [1.0] * len(groups) if budget == 1.0 else cost_allocated_fractions(shapes, budget)


def test_the_readme_usage_line_warms_up_its_budget_by_cost():
    """The README's usage line (fractions by cost) under a fraction warm-up: the schedule is the
    budget, and at each step every group holds the fraction that the allocation by cost gives its
    shape at the scheduled budget (1 at the start, the README's fractions at the end)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=128, vocab_size=256))
    namespace = {"dion3": dion3, "model": model}
    line, budget_given = _readme_usage_line()
    exec(line, namespace)
    optimizer = namespace["optimizer"]
    costed = [g for g in optimizer.param_groups if g["algorithm"] == "dion3"]
    given = [g["fraction"] for g in costed]
    assert len(set(given)) > 1 and given == _allocated(costed, budget_given)
    warmup = FractionWarmup(budget_given, steps=6)
    scheduler = FractionScheduler(optimizer, warmup)
    tokens = torch.randint(0, 256, (4, 16))
    losses, seen = [], []
    for step in range(9):
        budget = warmup(step)
        assert [g["fraction"] for g in costed] == _allocated(costed, budget), step
        assert all(g["fraction_budget"] == budget for g in costed)
        seen.append(tuple(g["fraction"] for g in costed))
        loss = model(tokens, tokens)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert seen[0] == (1.0,) * len(costed) and list(seen[-1]) == given and len(set(seen)) > 2
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(torch.isfinite(t).all() for p in model.parameters() for t in optimizer.state[p].values())
    assert len(scheduler._allocation._cache) == len({warmup(step) for step in range(9)})  # one allocation per budget


def test_a_budget_schedule_resumes_from_its_checkpoint():
    """The optimizer's saved groups carry the fractions and budget of the saved step; a fresh
    optimizer and scheduler loaded from them (either order) hold the same."""
    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=128, vocab_size=256))
        optimizer = Dion3(param_groups(model, lm_head="lm_head", fraction=0.25, fraction_allocation="cost"))
        return optimizer, FractionScheduler(optimizer, FractionWarmup(0.25, steps=4))

    optimizer, scheduler = build()
    for _ in range(2):
        scheduler.step()
    saved = copy.deepcopy((optimizer.state_dict(), scheduler.state_dict()))
    for optimizer_first in (True, False):
        resumed, resumed_scheduler = build()
        loads = [lambda: resumed.load_state_dict(saved[0]), lambda: resumed_scheduler.load_state_dict(saved[1])]
        for load in loads if optimizer_first else loads[::-1]:
            load()
        for a, b in zip(optimizer.param_groups, resumed.param_groups):
            assert (a["fraction"], a.get("fraction_budget")) == (b["fraction"], b.get("fraction_budget"))
    assert optimizer.param_groups[0]["fraction_budget"] == FractionWarmup(0.25, steps=4)(2)


def _linears(*sizes):
    return torch.nn.Sequential(*[torch.nn.Linear(a, b, bias=False) for a, b in zip(sizes, sizes[1:])])


def _named(prefix, groups):
    """A second model's groups beside the first's: its parameter names prefixed (names are unique)."""
    return [dict(g, param_names=[prefix + n for n in g["param_names"]]) for g in groups]


@pytest.mark.parametrize("groups, fragment", [
    # by cost beside a fraction of its own: a budget and a fraction are two schedules
    (lambda a, b: param_groups(a, lm_head=False, fraction=0.25, fraction_allocation="cost")
     + [dict(params=list(b.parameters()), param_names=["b.0", "b.1"], fraction=0.25)],
     "groups 0, 1, 2 hold fractions by cost (param_groups(..., fraction_allocation='cost')) and group 3 a fraction "
     "of its own; a schedule sets the budget of the first and the fraction of the others, so one scheduler cannot "
     "take both: build one for each, FractionScheduler(optimizer, schedule, groups=[0, 1, 2]) and another with groups=[3]"),
    # two budgets
    (lambda a, b: param_groups(a, lm_head=False, fraction=0.25, fraction_allocation="cost")
     + _named("b.", param_groups(b, lm_head=False, fraction=0.5, fraction_allocation="cost")),
     "the groups by cost were allocated apart (groups 0, 1, 2: budget 0.25; groups 3, 4: budget 0.5)"),
    # two allocations of one budget: together they would allocate otherwise
    (lambda a, b: param_groups(a, lm_head=False, fraction=0.25, fraction_allocation="cost")
     + _named("b.", param_groups(b, lm_head=False, fraction=0.25, fraction_allocation="cost")),
     "but the allocation by cost of budget 0.25 over the scheduled groups gives it"),
], ids=["mixed", "two-budgets", "two-allocations"])
def test_a_budget_schedule_refuses_groups_it_cannot_allocate_together(groups, fragment):
    a, b = _linears(64, 256, 512, 256), _linears(64, 256, 384)
    opt = Dion3(groups(a, b))
    held = [g["fraction"] for g in opt.param_groups]
    with pytest.raises(ValueError) as caught:
        FractionScheduler(opt, FractionWarmup(0.25, 4))
    assert fragment in str(caught.value)
    assert [g["fraction"] for g in opt.param_groups] == held  # the refused scheduler set nothing
    costed = [i for i, g in enumerate(opt.param_groups) if "fraction_budget" in g]
    allocations = [costed[:3], costed[3:]]  # each allocation, named, is scheduled on its own
    FractionScheduler(opt, FractionWarmup(0.25, 4), groups=allocations[0])
    if allocations[1]:
        FractionScheduler(opt, FractionWarmup(0.25, 4), groups=allocations[1])
    assert all(opt.param_groups[i]["fraction"] == 1.0 for i in costed)


# ------------------------------------------------------------------------- captured step bookkeeping
def test_captured_step_keeps_one_graph_per_k_and_drops_the_least_recent():
    """warmup_steps=2, max_graphs=2, 16/20-row matrices: fractions 1 (k 16, 20), 0.625 (10, 13),
    0.25 (4, 5) from FractionWarmup(levels=3), then back to 1 by hand: a dropped k is captured
    again (its kernels were compiled by its eager steps already). Fresh gradient tensors every
    step (set_to_none) must reach the graphs' fixed buffers. Results equal a plain eager run."""
    shapes = [(16, 12), (20, 8)]
    params, plain = make_params(shapes), make_params(shapes)
    opt = Dion3(params, lr=0.05, weight_decay=0.1)
    opt_plain = Dion3(plain, lr=0.05, weight_decay=0.1)
    step = CPUCapturedStep(opt, warmup_steps=2, max_graphs=2)
    scheduler = FractionScheduler(opt, FractionWarmup(0.25, 12, levels=3))
    fractions = []
    for i in range(16):
        if i == 13:
            opt.param_groups[0]["fraction"] = 1.0
        fractions.append(opt.param_groups[0]["fraction"])
        opt_plain.param_groups[0]["fraction"] = fractions[-1]
        for p, g in zip(params, grads_at(i, shapes)):
            p.grad = g.clone()  # a new tensor every step
        set_grads(plain, grads_at(i, shapes))
        step()
        opt_plain.step()
        if i < 12:
            scheduler.step()
    full, mid, low = (16, 20), (10, 13), (4, 5)
    assert fractions == [1.0] * 3 + [0.625] * 6 + [0.25] * 4 + [1.0] * 3
    expected = (
        [("eager", full)] * 2 + [("capture", full), ("replay", full)]
        + [("eager", mid)] * 2 + [("capture", mid), ("replay", mid)] + [("replay", mid)] * 3
        + [("eager", low)] * 2 + [("capture", low), ("replay", low)] + [("replay", low)]
        + [("capture", full), ("replay", full)] + [("replay", full)] * 2
    )
    assert step.log == expected
    assert step.captures == 4 and list(step.graphs) == [low, full]  # mid was dropped for full
    assert step.eager_calls == {full: 2, mid: 2, low: 2}
    assert step.graph is step.graphs[full] and step.calls == 16
    for a, b in zip(params, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_captured_step_keeps_one_graph_per_level_of_a_budget_by_cost():
    """A budget warm-up with levels=3 over groups by cost: each level's allocation is one set of
    k, so the step warms up and captures once per level; it equals the plain eager run."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = _linears(64, 256, 512, 256)
        opt = Dion3(param_groups(model, lm_head=False, lr=0.02, fraction=0.25, fraction_allocation="cost"))
        runs.append((list(model.parameters()), opt, FractionScheduler(opt, FractionWarmup(0.25, 12, levels=3))))
    (params, opt, scheduler), (plain, opt_plain, plain_scheduler) = runs
    step = CPUCapturedStep(opt, warmup_steps=2)
    keys = []
    for i in range(14):  # 3 steps at budget 1, 6 at 0.625, 5 at 0.25
        keys.append(selection_key(opt))
        shapes = [tuple(p.shape) for p in params]
        for p, g in zip(params, grads_at(i, shapes)):
            p.grad = g.clone()
        set_grads(plain, grads_at(i, shapes))
        step()
        opt_plain.step()
        scheduler.step()
        plain_scheduler.step()
    levels = list(dict.fromkeys(keys))
    assert len(levels) == 3 and levels[0] == (256, 512, 256)  # every row at budget 1
    assert step.captures == 3 and step.eager_calls == {key: 2 for key in levels}
    assert [kind for kind, _ in step.log].count("eager") == 6
    for a, b in zip(params, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_captured_step_keeps_two_graphs_for_periodic_full_steps():
    """PeriodicFull(¼, every=3): two sets of k (every row; ¼), each warmed up and captured once,
    replayed from then on, and the run equals a plain eager one."""
    shapes = [(16, 12), (20, 8)]
    params, plain = make_params(shapes), make_params(shapes)
    opt, opt_plain = Dion3(params, lr=0.05, weight_decay=0.1), Dion3(plain, lr=0.05, weight_decay=0.1)
    step = CPUCapturedStep(opt, warmup_steps=2, max_graphs=4)
    schedules = [FractionScheduler(o, PeriodicFull(0.25, every=3)) for o in (opt, opt_plain)]
    for i in range(15):
        set_grads(params, grads_at(i, shapes))
        set_grads(plain, grads_at(i, shapes))
        step()
        opt_plain.step()
        for scheduler in schedules:
            scheduler.step()
    full, quarter = (16, 20), (4, 5)
    assert step.captures == 2 and set(step.graphs) == {full, quarter}
    assert step.eager_calls == {full: 2, quarter: 2}
    assert [kind for kind, _ in step.log].count("replay") == 15 - 4  # every call after its key's warm-up
    for a, b in zip(params, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_captured_step_runs_a_changing_k_eagerly():
    """A fraction that changes k every step never reaches warmup_steps + 1 calls for one k: no
    graph until the schedule settles."""
    opt = Dion3(make_params([(16, 12)]), lr=0.05)
    step = CPUCapturedStep(opt, warmup_steps=3, max_graphs=4)
    scheduler = FractionScheduler(opt, FractionWarmup(0.25, 12))
    for i in range(20):
        set_grads(opt.param_groups[0]["params"], grads_at(i, [(16, 12)]))
        step()
        scheduler.step()
    kinds = [kind for kind, _ in step.log]
    assert kinds[:15] == ["eager"] * 15  # 12 warm-up steps (k 16 → 5) + 3 at k = 4
    assert kinds[15:] == ["capture"] + ["replay"] * 5 and step.captures == 1


def test_release_drops_the_graphs_and_the_next_calls_warm_up_again():
    """After release() no graph is alive (a distributed script calls it before destroying its
    process group) and the step goes on: warm-up, capture, replay, equal to a plain eager run."""
    shapes = [(16, 12)]
    params, plain = make_params(shapes), make_params(shapes)
    opt, opt_plain = Dion3(params, lr=0.05), Dion3(plain, lr=0.05)
    step = CPUCapturedStep(opt, warmup_steps=2, max_graphs=4)
    for i in range(8):
        if i == 4:
            step.release()
            assert not step.graphs and step.graph is None
        set_grads(params, grads_at(i, shapes))
        set_grads(plain, grads_at(i, shapes))
        step()
        opt_plain.step()
    kinds = [kind for kind, _ in step.log]
    once = ["eager", "eager", "capture", "replay", "replay"]  # a capture call also replays
    assert kinds == once + once
    assert step.captures == 2 and len(step.graphs) == 1
    assert torch.equal(params[0], plain[0])


class _PlainSGD(torch.optim.Optimizer):
    """X ← X − lr·G with lr read as a device scalar. torch's own SGD turns a tensor lr into a
    Python number (.item(), a host sync) unless compiled, so its step cannot be captured."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(group["lr"] * p.grad)


def test_captured_step_of_a_torch_optimizer_has_one_selection():
    """No Dion3 group (a torch.optim.Optimizer whose groups have no 'algorithm' key): one graph."""
    weight = torch.nn.Parameter(torch.ones(4, 3))
    step = CPUCapturedStep(_PlainSGD([weight], lr=0.1), warmup_steps=2, max_graphs=4)
    for _ in range(4):
        weight.grad = torch.ones(4, 3)
        step()
    assert [kind for kind, _ in step.log] == ["eager", "eager", "capture", "replay", "replay"]
    assert list(step.graphs) == [()] and torch.allclose(weight, torch.full((4, 3), 0.6))


def test_captured_step_argument_checks():
    with pytest.raises(ValueError, match="max_graphs"):
        CapturedStep(Dion3(make_params(), stacked=True), max_graphs=0)


# ------------------------------------------------------------------------- distributed (gloo)
def test_distributed_schedule_matches_one_process(tmp_path):
    import schedule_worker

    results = gloo.spawn_and_read(schedule_worker.worker, 2, tmp_path / "results.json")
    for name, error in results["errors"].items():
        assert error <= 1e-5, (name, error)
    assert set(results["errors"]) == {f"{layout}/{scope}" for layout in ("fsdp", "ddp") for scope in ("global", "local")}
    # four fractions with one k per rank chunk: one cached plan, not four
    assert results["local_slot_entries"] == [1, 1]
    assert results["disagreement_raised"] == [True, True]


# ------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_schedule_equals_eager_on_cuda():
    """Levels 1 → ¾ → ½ → ¼ then back to 1 with max_graphs=2 (graphs dropped and captured
    again, sharing one memory pool), an LR schedule, fresh gradient tensors every other step."""
    device = "cuda"
    shapes = [(256, 128)] * 3 + [(128, 384), (4, 64, 96)]
    eager, graph = make_params(shapes, device=device), make_params(shapes, device=device)
    opt_eager = Dion3(eager, lr=0.02, mu=0.6, weight_decay=0.1, stacked=True)
    opt_graph = Dion3(graph, lr=0.02, mu=0.6, weight_decay=0.1, stacked=True)
    to_device_scalars(opt_eager, torch.device(device))
    step = CapturedStep(opt_graph, warmup_steps=2, max_graphs=2)
    warmup = FractionWarmup(0.25, 24, levels=4)
    schedules = [FractionScheduler(o, warmup) for o in (opt_eager, opt_graph)]
    lrs = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40) for o in (opt_eager, opt_graph)]
    for i in range(40):
        if i == 32:
            for o in (opt_eager, opt_graph):
                o.param_groups[0]["fraction"] = 1.0
        if i % 2:
            for p in graph:
                p.grad = None
        for params in (eager, graph):
            for p, g in zip(params, grads_at(i, shapes, device=device)):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)
        opt_eager.step()
        step()
        for s in lrs + (schedules if i < 32 else []):
            s.step()
    assert step.captures >= 5 and len(step.graphs) == 2 and step.graph is not None
    for a, b in zip(eager, graph):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
