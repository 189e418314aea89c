"""Orthogonalization cost of parameter groups, and Dion3 fractions chosen per matrix shape by it.

`cost_allocated_fractions` spends a uniform fraction's step time where rows are cheapest;
`cost_allocated_groups` splits a Dion3 group into one group per matrix shape with those
fractions; `step_orthogonalize_flops` counts what one optimizer step orthogonalizes
(`fraction_table.describe_fractions` tabulates what the fractions came to). All on the host (parameter shapes and group settings only, no device work).

The allocation spends modeled time (dion3.ortho.cost.modeled_seconds, fitted on one H200: padded
products, their rates and traffic), not FLOPs: equal FLOPs on Llama-8B stepped 1.10× slower,
because the rows went to products that run slower per FLOP and to k that pad up to the next
multiple of 128 (benchmarks/results/steps-h200-2026-12-02.md). The model is the same whichever
device a run trains on, so every rank and every run allocates alike. FLOP counts
(step_orthogonalize_flops, orthogonalize_cost) assume the H200 symmetric-kernel rule,
`h200_symmetric` (symmetric products from n ≥ SYMMETRIC_MIN_N).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from ..algorithms import MATRIX_ALGORITHMS, SELECTING_ALGORITHMS
from ..buckets import matrix_view
from ..ortho.cost import MatrixShape, Symmetric, h200_symmetric, modeled_seconds, orthogonalize_flops
from ..ortho.padding import SHORT_MULTIPLE
from ..rules import selected_row_count
from .validation import BUDGET_KEY, MOST_ROWS_KEY, WEIGHTS_KEY

# cost(k, cols): what selecting k rows of one k × cols matrix costs a step (seconds, FLOPs, ...)
Cost = Callable[[int, int], float]
# The name study records give this rule (dion3.tools.study.runs.Run.cost_rule; records without one
# allocated by FLOPs). A change that moves a study model's or preset's allocation needs a new name,
# so that records of the old and new rule never count as one setting.
COST_RULE = "time"
ROW_GRID = SHORT_MULTIPLE  # most_rows searches row counts on this grid: the Gram side pads k to it
BUDGET_TOLERANCE = 1e-9  # relative: sums of the same FLOPs in another order may differ in the last bits


def orthogonalize_cost(method: str = "auto", symmetric: Symmetric = h200_symmetric,
                       schedule: Any = "polar_express") -> Cost:
    """cost(k, cols): executed orthogonalization FLOPs with these orthogonalizer settings."""
    return lambda k, cols: orthogonalize_flops(k, cols, method, symmetric, schedule)[1]


def modeled_time_cost(method: str = "auto", schedule: Any = "polar_express") -> Cost:
    """cost(k, cols): modeled seconds (dion3.ortho.cost.modeled_seconds) with these settings."""
    return lambda k, cols: modeled_seconds(k, cols, method, schedule)


def _check_shapes(shapes: Sequence) -> None:
    if len(shapes) == 0:
        raise ValueError("no matrix shape to allocate fractions to; give at least one")
    for shape in shapes:
        for name in ("rows", "cols", "count"):
            value = getattr(shape, name, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the matrix shape {shape!r} has {name} {value!r}, not a positive integer")


def efficient_rows(cost: Cost, cols: int, low: int, rows: int) -> list[tuple[int, float]]:
    """(k, cost(k, cols)) for each k in [low, rows] that every larger k up to rows costs strictly
    more than, k and cost ascending, ending at rows: the first is the cheapest way to select at
    least `low` rows, and after each entry the next is the cheapest way to select at least one
    row more (a larger count at no more cost is the better buy, so the most rows of a price)."""
    points, cheapest = [], math.inf
    for k in range(rows, low - 1, -1):
        price = float(cost(k, cols))
        if price < cheapest:
            points.append((k, price))
            cheapest = price
    points.reverse()
    return points


def cost_allocated_fractions(
    shapes: Sequence[MatrixShape], fraction: float, floor: Optional[float] = None, method: str = "auto",
    schedule: Any = "polar_express", cost: Optional[Cost] = None, weights: Optional[Sequence[float]] = None,
    most_rows: bool = False,
) -> list[float]:
    """One fraction per shape (each k/rows, k the rows it selects) whose costs add up to at most
    those of `fraction` on every shape.

    shapes: `count` matrices of rows × cols each (dion3.ortho.cost.MatrixShape, or anything with
        those three attributes). Shapes with equal rows and cols are one shape: they get one fraction.
    floor: the least fraction of any shape, in (0, fraction]; None: fraction / 4.
    method, schedule: the orthogonalizer settings the default cost models;
    cost: cost(k, cols) of one k × cols matrix; None: modeled_time_cost(method, schedule), the
        modeled H200 seconds (orthogonalize_cost(...) counts executed FLOPs instead).
    weights: one positive weight per shape (None: all 1): a row of a shape with weight w counts w
        times, so its cost is divided by w when the rows are handed out (a shape whose rows matter
        more for the loss gets more of them within the same budget). Equal shapes need equal weights.

    Rule (water-filling by cost on the cheapest way to at least k rows): more rows can cost less
    (the modeled time of a 192×64 matrix is lower at k = 96 than at k = 24: the orthogonalizer
    and the padded tile change with k), so k rows are priced at min over k' ≥ k of cost(k'), and
    a shape that pays that price selects the most rows k' it buys (efficient_rows). Every shape
    starts at the cheapest way to ⌈floor·rows⌉ rows; then, again and again, the shape whose next
    row costs the least (that price's rise, divided by the shape's weight; first in input order
    among equals) gets it on each of its matrices, among the shapes below all their rows whose
    additions still fit the budget, until none fits. Orthogonalizing k rows costs about k²·cols,
    so a row is cheap where k and cols are small: short matrices (k/v projections) and narrow ones
    get their rows first, and the budget they leave keeps a small fraction on the wide MLP
    matrices. The modeled time steps up where k passes a multiple of 128 (the GPU computes k at
    its next multiple): after each step up, the rows up to the next one cost only their own
    traffic and are taken, so a shape mostly ends on a multiple of 128 (or all its rows), and one
    uniform shape can get more than `fraction` (k = 96 of 384 rows computes 128 anyway).
    So the result never costs more than the budget (the floor's rows cost no more than
    `fraction`'s at these prices), no shape's next row fits it, and no other allocation selects
    as many rows of every shape in no more time: each shape's k costs less than any larger k.
    Where cost never falls as k grows, the price of a row is cost(k + 1) − cost(k) and the rows
    are those of the per-row water-filling that came before this envelope, row for row.

    most_rows: start the water-filling from the allocation that selects the most rows (each
    weighted) within the budget, searched exactly over every shape's row counts on the grid of
    ROW_GRID rows (the Gram side's padding), its floor's count and all its rows. The price of a
    row is not monotone in k: past k = cols the Gram side turns to the columns and a further row
    costs only its share of the long side, far less than the rows just below cols. So the
    water-filling, which buys the cheapest next row, stops short of the cheap rows of tall
    matrices (gate and up projections) and spends the budget on square ones; at ½'s budget it
    selects 0.42 of Llama-8B's rows, the search 0.64.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction!r}")
    if floor is None:
        floor = fraction / 4
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 < floor <= fraction:
        raise ValueError(f"floor must lie in (0, fraction] = (0, {fraction:g}], got {floor!r}")
    _check_shapes(shapes)
    cost = cost or modeled_time_cost(method, schedule)
    weight_of = _shape_weights(shapes, weights)

    # identical shapes are interchangeable: merge them, so they cannot end up with different k
    merged: dict[tuple[int, int], int] = {}
    for shape in shapes:
        merged[(shape.rows, shape.cols)] = merged.get((shape.rows, shape.cols), 0) + shape.count
    keys = list(merged)
    cached: dict[tuple[int, int], float] = {}

    def flops(k: int, cols: int) -> float:
        if (k, cols) not in cached:
            cached[(k, cols)] = float(cost(k, cols))
        return cached[(k, cols)]

    budget = sum(merged[(rows, cols)] * flops(selected_row_count(rows, fraction), cols) for rows, cols in keys)
    limit = budget * (1 + BUDGET_TOLERANCE)
    # each shape steps along its efficient row counts, starting at the cheapest way to its floor's rows
    points = [efficient_rows(flops, cols, selected_row_count(rows, floor), rows) for rows, cols in keys]
    at = [0] * len(keys)  # shape i selects points[i][at[i]] rows
    if most_rows:
        at = _most_rows(points, [merged[key] for key in keys], [weight_of[key] for key in keys], limit)
    total = sum(merged[key] * points[i][at[i]][1] for i, key in enumerate(keys))
    while True:
        best, best_step = None, math.inf
        for i, key in enumerate(keys):
            if at[i] + 1 == len(points[i]):
                continue  # all its rows
            # the price of one more row: the cheapest way to select at least one more (each of its matrices)
            step = points[i][at[i] + 1][1] - points[i][at[i]][1]
            if total + merged[key] * step <= limit and step / weight_of[key] < best_step:
                best, best_step = i, step / weight_of[key]
        if best is None:
            break
        total += merged[keys[best]] * (points[best][at[best] + 1][1] - points[best][at[best]][1])
        at[best] += 1
    k = [points[i][at[i]][0] for i in range(len(keys))]
    chosen = {key: k[i] / key[0] for i, key in enumerate(keys)}
    return [chosen[(shape.rows, shape.cols)] for shape in shapes]


def _most_rows(points: list[list[tuple[int, float]]], counts: list[int], weights: list[float],
               limit: float) -> list[int]:
    """For each shape, the index into its efficient points (k, cost) of the allocation whose
    weighted rows Σ count·weight·k are the most within `limit` (Σ count·cost), over the points at
    a multiple of ROW_GRID rows, the first (the floor's) and the last (all rows); ties: the least
    cost. Exact: the allocations are built shape by shape, keeping only those that no other beats
    in both cost and rows, and only those that leave each later shape at least its cheapest point.
    In float64 tensors: with a dozen distinct shapes of thousands of rows the kept allocations
    number millions, too many for Python tuples at start-up on every rank."""
    least = [count * shape_points[0][1] for shape_points, count in zip(points, counts)]
    slack = limit * 1e-12  # the sums below add in another order than the final check does
    spent, rows = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    parents: list[tuple[torch.Tensor, torch.Tensor]] = []  # per shape: each entry's previous entry and point
    for i, (shape_points, count, weight) in enumerate(zip(points, counts, weights)):
        last = len(shape_points) - 1
        candidates = torch.tensor([j for j, (k, _) in enumerate(shape_points) if j in (0, last) or k % ROW_GRID == 0])
        prices = torch.tensor([count * shape_points[j][1] for j in candidates.tolist()], dtype=torch.float64)
        gains = torch.tensor([count * weight * shape_points[j][0] for j in candidates.tolist()], dtype=torch.float64)
        grown_spent = (spent[:, None] + prices[None, :]).flatten()
        grown_rows = (rows[:, None] + gains[None, :]).flatten()
        index = (grown_spent <= limit - sum(least[i + 1:]) + slack).nonzero().flatten()
        # by cost, then the most rows first (stable: among equals, the earlier entry and point)
        index = index[torch.argsort(-grown_rows[index], stable=True)]
        index = index[torch.argsort(grown_spent[index], stable=True)]
        ordered = grown_rows[index]
        before = torch.cat([ordered.new_full((1,), -math.inf), torch.cummax(ordered, dim=0).values[:-1]])
        index = index[ordered > before]  # more rows than every cheaper allocation
        parents.append((index // len(candidates), candidates[index % len(candidates)]))
        spent, rows = grown_spent[index].clone(), grown_rows[index].clone()
    # the floor's rows fit the budget (they cost no more than the fraction's), so some entry is kept;
    # rows rise with cost along the kept entries: the last has the most, at the least cost for them
    chosen, entry = [], len(spent) - 1
    for previous, point in reversed(parents):
        chosen.append(int(point[entry]))
        entry = int(previous[entry])
    return chosen[::-1]


def _shape_weights(shapes: Sequence, weights: Optional[Sequence[float]]) -> dict[tuple[int, int], float]:
    """{(rows, cols): weight} from one weight per shape (None: 1 each), checked."""
    if weights is None:
        return {(shape.rows, shape.cols): 1.0 for shape in shapes}
    weights = list(weights)
    if len(weights) != len(shapes):
        raise ValueError(f"weights has {len(weights)} entries for {len(shapes)} shapes; give one weight per shape")
    out: dict[tuple[int, int], float] = {}
    for shape, weight in zip(shapes, weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 < weight < math.inf:
            raise ValueError(f"the weight of shape {shape.rows}x{shape.cols} must be a positive finite number, "
                             f"got {weight!r}")
        key = (shape.rows, shape.cols)
        if out.setdefault(key, float(weight)) != float(weight):
            raise ValueError(f"shape {shape.rows}x{shape.cols} is given the weights "
                             f"{out[key]:g} and {weight:g}; equal shapes share one fraction, so they need one weight")
    return out


def matrix_shapes(params: Iterable[Tensor], flatten: bool = False) -> list[MatrixShape]:
    """The orthogonalized matrices of `params`, same shapes counted together in first-seen order:
    a 2-D parameter is one matrix, a higher one a batch of [..., rows, cols] matrices, or with
    `flatten` one [rows, numel/rows] matrix (as the optimizer views them, buckets.matrix_view)."""
    counts: dict[tuple[int, int], int] = {}
    for p in params:
        if p.dim() < 2:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is not a matrix; the cost model prices "
                             "matrices only")
        view = matrix_view(p.detach(), flatten)  # the optimizer's own view rule; a view, no copy
        rows, cols, count = view.shape[-2], view.shape[-1], math.prod(view.shape[:-2])
        counts[(rows, cols)] = counts.get((rows, cols), 0) + count
    return [MatrixShape(f"{rows}x{cols}", rows, cols, count) for (rows, cols), count in counts.items()]


def _group_flops(group: dict, symmetric: Symmetric) -> Cost:
    return orthogonalize_cost(group.get("orthogonalizer", "auto"), symmetric, group.get("ns_coefficients", "polar_express"))


def require_whole_matrices(group: dict, where: str) -> None:
    if group.get("num_heads") is not None or group.get("split_sizes") is not None:
        raise ValueError(f"{where}: groups split into blocks (num_heads, split_sizes) are not supported; "
                         "the cost model counts whole matrices")


def cost_allocated_groups(group: Union[dict, Sequence[dict]], fraction: float, floor: Optional[float] = None,
                          cost: Optional[Cost] = None, weights: Optional[Mapping[str, float]] = None,
                          most_rows: bool = False) -> list[dict]:
    """`group` (a Dion3 parameter group) split into one group per matrix shape, each with its
    fraction from cost_allocated_fractions at the uniform `fraction`, costed with `cost` or else
    the modeled time of the group's orthogonalizer and ns_coefficients (defaults where it names
    none). Other settings are copied.
    Several groups (a list; e.g. flattened convolution kernels beside the other matrices) share
    one budget: each matrix is viewed by its own group's rule, a shape gets one fraction whichever
    group its matrices are in, and each group is split by shape (shapes in first-seen order,
    then groups in order); the cost is the first group's.
    weights: {part of a parameter name: weight} (e.g. {"mlp": 2.0}): the weight of every matrix
    whose name contains that part (1 for the others), handed to cost_allocated_fractions per
    shape; needs the groups' param_names.
    most_rows: cost_allocated_fractions' search for the most rows first.
    With the default cost and no floor, each group records the budget ("fraction_budget"), the
    weights ("fraction_weights") and most_rows ("fraction_most_rows", when set), so that a
    FractionScheduler can allocate another budget alike (budget_schedule)."""
    schedulable = floor is None and cost is None
    groups = [group] if isinstance(group, dict) else list(group)
    members = []  # (group index, parameter index, its matrices' (rows, cols), their count)
    for g, each in enumerate(groups):
        require_whole_matrices(each, "fractions by cost")
        for i, p in enumerate(each["params"]):
            (shape,) = matrix_shapes([p], bool(each.get("flatten", False)))
            members.append((g, i, (shape.rows, shape.cols), shape.count))
    counts: dict[tuple[int, int], int] = {}
    for _, _, key, count in members:
        counts[key] = counts.get(key, 0) + count
    shapes = [MatrixShape(f"{rows}x{cols}", rows, cols, count) for (rows, cols), count in counts.items()]
    first = groups[0] if groups else {}
    cost = cost or modeled_time_cost(first.get("orthogonalizer", "auto"), first.get("ns_coefficients", "polar_express"))
    shape_weights = None
    if weights is not None:
        named = [(None if groups[g].get("param_names") is None else groups[g]["param_names"][i], key)
                 for g, i, key, _ in members]
        shape_weights = _weights_by_name(named, weights, shapes)
    fractions = dict(zip(counts, cost_allocated_fractions(shapes, fraction, floor, cost=cost, weights=shape_weights,
                                                          most_rows=most_rows)))
    out = []
    for key in counts:
        for g, each in enumerate(groups):
            mine = [i for owner, i, at, _ in members if owner == g and at == key]
            if mine:
                split = dict(each, params=[each["params"][i] for i in mine], fraction=fractions[key])
                if each.get("param_names") is not None:  # each parameter keeps its name
                    split["param_names"] = [each["param_names"][i] for i in mine]
                if schedulable:
                    split[BUDGET_KEY] = float(fraction)
                    if weights is not None:
                        split[WEIGHTS_KEY] = dict(weights)
                    if most_rows:
                        split[MOST_ROWS_KEY] = True
                out.append(split)
    return out


def _weights_by_name(named: Sequence[tuple[Optional[str], tuple[int, int]]], weights: Mapping[str, float],
                     shapes: Sequence[MatrixShape]) -> list[float]:
    """One weight per shape of `shapes` from {name part: weight}: each parameter ((name, its
    matrices' (rows, cols)) in `named`) takes the weight of the one part its name contains (1 for
    none); the parameters of a shape must agree."""
    if any(name is None for name, _ in named):
        raise ValueError("fraction weights pick matrices by name, but the group has no param_names "
                         "(param_groups(...) writes them)")
    if not weights:
        raise ValueError("the fraction weights are empty; give {part of a parameter name: weight}")
    for part, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 < weight < math.inf:
            raise ValueError(f"the fraction weight of {part!r} must be a positive finite number, got {weight!r}")
    used = set()
    by_shape: dict[tuple[int, int], tuple[float, str]] = {}
    for name, key in named:
        matching = [part for part in weights if part in name]
        if len(matching) > 1:
            raise ValueError(f"parameter {name!r} matches the fraction weights of {matching}; "
                             "give parts that pick each matrix once")
        used.update(matching)
        weight = float(weights[matching[0]]) if matching else 1.0
        seen = by_shape.setdefault(key, (weight, name))
        if seen[0] != weight:
            raise ValueError(f"{seen[1]!r} (weight {seen[0]:g}) and {name!r} (weight {weight:g}) "
                             f"share the shape {key[0]}x{key[1]}, which gets one fraction: give them one weight")
    unused = [part for part in weights if part not in used]
    if unused:
        raise ValueError(f"no matrix of the group has {unused} in its name; each part given a fraction weight must "
                         "pick a matrix")
    return [by_shape[(shape.rows, shape.cols)][0] for shape in shapes]


def step_orthogonalize_flops(groups: Sequence[dict], symmetric: Symmetric = h200_symmetric) -> float:
    """Executed orthogonalization FLOPs of one optimizer step over these parameter groups, at
    their fractions now: Dion3/Dion2 groups ⌈f·rows⌉ rows of each matrix, Muon/NorMuon every
    row, scalar (AdamW, Lion) groups nothing."""
    total = 0.0
    for group in groups:
        algorithm = group.get("algorithm")
        if algorithm not in MATRIX_ALGORITHMS:
            continue
        require_whole_matrices(group, "step_orthogonalize_flops")
        cost = _group_flops(group, symmetric)
        selecting = algorithm in SELECTING_ALGORITHMS
        for shape in matrix_shapes(group["params"], bool(group.get("flatten", False))):
            k = selected_row_count(shape.rows, group["fraction"]) if selecting else shape.rows
            total += shape.count * cost(k, shape.cols)
    return total
