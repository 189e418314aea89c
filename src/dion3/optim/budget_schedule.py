"""A fraction schedule over groups allocated by cost sets their budget, not one fraction.

`param_groups(model, fraction=0.25, fraction_allocation="cost")` gives each matrix shape a group
with the fraction that the allocation by cost (cost_fractions.cost_allocated_groups) hands that
shape within the modeled step time of 0.25 on every matrix, and records the budget in each group
("fraction_budget"; the row weights, when given, in "fraction_weights"). One fraction set on all
those groups would erase the per-shape fractions, so over them the value a FractionScheduler
applies is the budget: each group gets the fraction that the same allocation gives its shape at
that budget, and "fraction_budget" says which budget the fractions spend now. A warm-up from 1 to
0.25 thus starts at every row of every matrix and ends at the fractions param_groups gave.

The allocation is a pure function of the groups' matrix shapes, parameter names, weights and
orthogonalizer settings and of the budget, so every rank computes the same fractions with no
collective. It runs on the host (0.1-0.2 s for Llama-8B's shapes), once per distinct budget:
a warm-up with `levels=L` computes L of them, one without levels one per step of its ramp.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .cost_fractions import cost_allocated_groups
from .validation import BUDGET_KEY, allocation_rule, check_range

# What the allocation reads of a group: its matrices, their names (the weights pick them by name),
# how they are viewed as matrices, and the orthogonalizer settings the cost model prices.
ALLOCATION_KEYS = ("params", "param_names", "flatten", "orthogonalizer", "ns_coefficients", "num_heads", "split_sizes")


def by_cost(group: dict) -> bool:
    """Whether the group's fraction was allocated by cost (it records its budget)."""
    return group.get(BUDGET_KEY) is not None


def _groups(indices: Sequence[int]) -> str:
    return f"group{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


class BudgetAllocation:
    """The fractions by cost of some groups of an optimizer (`indices`) at any budget: one per
    group, in the order of `indices`, kept per distinct budget (a schedule's budgets repeat)."""

    def __init__(self, optimizer: torch.optim.Optimizer, indices: Sequence[int]):
        self.indices = list(indices)
        groups = [optimizer.param_groups[i] for i in self.indices]
        # the inputs as they are now: the schedule reallocates the matrices it was built over
        self._inputs = [{key: list(g[key]) if isinstance(g[key], (list, tuple)) else g[key]
                         for key in ALLOCATION_KEYS if key in g} for g in groups]
        weights, self._most_rows = allocation_rule(groups[0])
        self._weights = None if weights is None else dict(weights)
        self._owner = {id(p): n for n, g in enumerate(self._inputs) for p in g["params"]}
        self._cache: dict[float, list[float]] = {}

    def fractions(self, budget: float) -> list[float]:
        if budget not in self._cache:
            self._cache[budget] = self._allocate(budget)
        return self._cache[budget]

    def _allocate(self, budget: float) -> list[float]:
        if budget == 1.0:  # every row of every matrix spends the whole budget, whatever the cost model
            return [1.0] * len(self._inputs)
        fractions: list[Optional[float]] = [None] * len(self._inputs)
        # the rule param_groups applied: shapes merged over the groups, each shape one fraction
        for part in cost_allocated_groups(self._inputs, budget, weights=self._weights, most_rows=self._most_rows):
            n = self._owner[id(part["params"][0])]
            if fractions[n] not in (None, part["fraction"]):
                raise ValueError(f"FractionScheduler: parameter group {self.indices[n]} holds matrices of several "
                                 "shapes, which fractions by cost tell apart; param_groups(fraction_allocation='cost') "
                                 "gives each shape a group of its own")
            fractions[n] = part["fraction"]
        return fractions


def budget_allocation(optimizer: torch.optim.Optimizer, indices: Sequence[int]) -> Optional[BudgetAllocation]:
    """The allocation by cost that a schedule over these groups follows, checked: every group is
    by cost, from one budget and weights, and holds the allocation's fraction at that budget.
    None where no group is by cost (the schedule then sets the fraction itself)."""
    groups = optimizer.param_groups
    costed = [i for i in indices if by_cost(groups[i])]
    if not costed:
        return None
    others = [i for i in indices if i not in costed]
    if others:
        raise ValueError(
            f"FractionScheduler: {_groups(costed)} hold fractions by cost (param_groups(..., fraction_allocation="
            f"'cost')) and {_groups(others)} a fraction of {'their' if len(others) > 1 else 'its'} own; a schedule "
            "sets the budget of the first and the fraction of the others, so one scheduler cannot take both: build "
            f"one for each, FractionScheduler(optimizer, schedule, groups={costed}) and another with groups={others}")
    allocations: dict[tuple, list[int]] = {}
    for i in costed:
        check_range(f"parameter group {i}", BUDGET_KEY, groups[i][BUDGET_KEY], 0.0, 1.0, low_open=True)
        key = (float(groups[i][BUDGET_KEY]), *allocation_rule(groups[i]))
        allocations.setdefault(key, []).append(i)
    if len(allocations) > 1:
        listed = "; ".join(f"{_groups(members)}: budget {budget:g}"
                           + (f", fraction_weights {dict(weights)}" if weights else "")
                           + (", the most rows" if most_rows else "")
                           for (budget, weights, most_rows), members in allocations.items())
        raise ValueError(f"FractionScheduler: the groups by cost were allocated apart ({listed}), and a schedule "
                         "sets one budget; build one FractionScheduler per allocation, each with groups=[...] "
                         "naming its groups")
    ((budget, _, _),) = allocations
    allocation = BudgetAllocation(optimizer, costed)
    for i, expected in zip(costed, allocation.fractions(budget)):
        if groups[i]["fraction"] != expected:
            raise ValueError(
                f"FractionScheduler: group {i} holds fraction {groups[i]['fraction']:g}, but the allocation by cost of "
                f"budget {budget:g} over the scheduled groups gives it {expected:g}. Groups of two param_groups calls "
                "are two allocations: schedule each with its own FractionScheduler(groups=[...]); and give the "
                "orthogonalizer and ns_coefficients to param_groups, whose allocation prices them, not only to "
                "the optimizer")
    return allocation
