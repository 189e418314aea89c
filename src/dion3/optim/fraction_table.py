"""`describe_fractions`: a table of the fractions that Dion3 groups give each matrix shape and of
their modeled H200 time, beside the uniform fraction's (the allocation itself: cost_fractions)."""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from torch import nn

from ..algorithms import MATRIX_ALGORITHMS, SELECTING_ALGORITHMS
from ..rules import selected_row_count
from .cost_fractions import matrix_shapes, modeled_time_cost, require_whole_matrices
from .param_groups import param_groups

DION3_DEFAULT_FRACTION = 0.25  # Dion3(fraction=...)'s default: what a group without "fraction" gets
_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")  # a module path's list index: "layers.3.q.weight"


def _names(names: Optional[Sequence[str]]) -> str:
    """Parameter names with module-list indices folded, distinct names of one path braced:
    "blocks.*.attn.{q,k,v}.weight"."""
    if not names:
        return ""
    folded = list(dict.fromkeys(_INDEX.sub("*", name) for name in names))
    if len(folded) == 1:
        return folded[0]
    parts = [name.split(".") for name in folded]
    head = 0
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while all(len(p) > head + tail + 1 for p in parts) and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    middles = [".".join(p[head:len(p) - tail]) for p in parts]
    shown = middles if len(middles) <= 6 else middles[:5] + [f"+{len(middles) - 5} more"]
    return ".".join([*parts[0][:head], "{" + ",".join(shown) + "}", *parts[0][len(parts[0]) - tail:]])


def _is_matrix_group(group: dict) -> bool:
    algorithm = group.get("algorithm")
    if algorithm is None:  # the optimizer class decides: a matrix group if it holds matrices only
        return all(p.dim() >= 2 for p in group["params"])
    return algorithm in MATRIX_ALGORITHMS


def describe_fractions(groups: Any, fraction: Optional[float] = None, **options: Any) -> str:
    """A table of the fractions that `groups` give each matrix shape, and what they cost.

    groups: parameter groups (param_groups(..., fraction_allocation="cost") or any other Dion3
        groups, also an optimizer's param_groups), or a model: then the groups are
        param_groups(model, fraction=fraction, fraction_allocation="cost", **options) (lm_head=...
        among the options).
    fraction: the uniform fraction the allocation spent (param_groups' `fraction`): each shape's
        k and modeled time at it are listed beside the allocated ones. None: the groups' own
        fraction where they all hold one; else no comparison.

    Per group and matrix shape: the parameters (module-list indices folded to *), rows × cols, the
    number of matrices, the fraction, the rows k = ⌈f·rows⌉ each matrix selects, and the modeled
    time of those selections on one H200 (dion3.ortho.cost.modeled_seconds at the group's
    orthogonalizer and ns_coefficients). A group without `algorithm` is read as the Dion3 class
    reads it (a missing fraction: Dion3's default, 0.25); Muon/NorMuon groups select every row.
    Scalar (AdamW, Lion) groups are named in one line. Host-side only: shapes and settings, no
    device work (groups of meta tensors do).
    """
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0.0 < fraction <= 1.0):
        raise ValueError(f"describe_fractions: fraction must lie in (0, 1], got {fraction!r}")
    if isinstance(groups, nn.Module):
        if fraction is None:
            raise ValueError("describe_fractions: a model needs fraction=..., the uniform fraction to allocate by cost")
        groups = param_groups(groups, fraction=fraction, fraction_allocation="cost", **options)
    elif options:
        raise TypeError(f"describe_fractions: options {sorted(options)} are for a model (param_groups), not for groups")
    groups = list(groups)

    entries, scalar = [], []
    for index, group in enumerate(groups):
        if not group["params"]:
            continue
        if not _is_matrix_group(group):
            scalar.append(index)
            continue
        require_whole_matrices(group, "describe_fractions")
        algorithm = group.get("algorithm")
        selecting = algorithm is None or algorithm in SELECTING_ALGORITHMS
        group_fraction = group.get("fraction", DION3_DEFAULT_FRACTION) if selecting else 1.0
        seconds = modeled_time_cost(group.get("orthogonalizer", "auto"), group.get("ns_coefficients", "polar_express"))
        params, names, flatten = list(group["params"]), group.get("param_names"), bool(group.get("flatten", False))
        keys = [(s.rows, s.cols) for p in params for s in matrix_shapes([p], flatten)]
        for shape in matrix_shapes(params, flatten):
            members = [i for i, key in enumerate(keys) if key == (shape.rows, shape.cols)]
            k = selected_row_count(shape.rows, group_fraction) if selecting else shape.rows
            entries.append(dict(group=index, algorithm=algorithm or "dion3", selecting=selecting,
                                names=_names([names[i] for i in members] if names else None),
                                shape=shape, fraction=group_fraction, k=k, seconds=shape.count * seconds(k, shape.cols),
                                cost=seconds))
    if not entries:
        return "describe_fractions: no matrix groups (every group is a scalar one: nothing is orthogonalized)"
    selecting = any(e["selecting"] for e in entries)
    if fraction is None:
        held = {e["fraction"] for e in entries if e["selecting"]}
        fraction = held.pop() if len(held) == 1 else None
    compare = fraction is not None and selecting
    for e in entries:
        shape = e["shape"]
        e["uniform_k"] = selected_row_count(shape.rows, fraction) if compare and e["selecting"] else e["k"]
        e["uniform_seconds"] = shape.count * e["cost"](e["uniform_k"], shape.cols)
    total = sum(e["seconds"] for e in entries)
    uniform = sum(e["uniform_seconds"] for e in entries)
    unit, scale = ("ms", 1e3) if max(total, uniform) >= 1e-3 else ("µs", 1e6)
    time = lambda seconds: f"{seconds * scale:#.4g}"  # noqa: E731

    algorithms = any(e["algorithm"] != "dion3" for e in entries)  # a column only where groups differ
    columns = ["group", *(["algorithm"] if algorithms else []), "parameters", "rows × cols", "matrices", "fraction",
               "k", f"modeled {unit}", *([f"k at {fraction:g}", f"{unit} at {fraction:g}"] if compare else [])]
    table = [columns, ["---"] * len(columns)]
    for e in entries:
        shape = e["shape"]
        table.append([str(e["group"]), *([e["algorithm"]] if algorithms else []), e["names"] or "—",
                      f"{shape.rows}×{shape.cols}", str(shape.count), f"{e['fraction']:.4g}", str(e["k"]),
                      time(e["seconds"]), *([str(e["uniform_k"]), time(e["uniform_seconds"])] if compare else [])])
    table.append(["all", *([""] if algorithms else []), "", "", str(sum(e["shape"].count for e in entries)), "", "",
                  time(total), *(["", time(uniform)] if compare else [])])
    lines = ["| " + " | ".join(row) + " |" for row in table] + [""]
    what = "Modeled H200 time of one step's selections (orthogonalization and the selected rows' traffic)"
    if not selecting:
        lines.append(f"{what}: {time(total)} {unit}. No group selects rows (Muon, NorMuon: every row).")
    elif compare:
        lines.append(f"{what}: {time(total)} {unit} with these fractions, {time(uniform)} {unit} at {fraction:g} on "
                     f"every matrix ({total / uniform:.3f}×).")
    else:
        lines.append(f"{what}: {time(total)} {unit}. The groups hold different fractions: pass fraction= (the "
                     "uniform fraction given to param_groups) to compare with it.")
    if selecting:
        lines.append("Fractions by cost are a pure function of the matrix shapes, the uniform fraction and the "
                     "orthogonalizer settings: they price rows with the H200 time model (dion3.ortho.cost."
                     "modeled_seconds, H200_TIME) whatever device runs them, so every device and every rank, CPU "
                     "included, gets the same fractions. The times are that model's, not measurements on this machine.")
    if scalar:
        counted = sum(len(groups[i]["params"]) for i in scalar)
        kinds = sorted({groups[i].get("algorithm", "?") for i in scalar})
        lines.append(f"Not orthogonalized: group{'s' if len(scalar) > 1 else ''} {', '.join(map(str, scalar))} "
                     f"({'/'.join(kinds)}, {counted} parameter{'s' if counted != 1 else ''}).")
    return "\n".join(lines)
