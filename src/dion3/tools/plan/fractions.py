"""`dion3 fractions`: the fractions that `param_groups(..., fraction_allocation="cost")` gives
each matrix shape of a preset (or of --shapes), with the rows each selects and their modeled H200
time against the uniform fraction's (dion3.optim.fraction_table.describe_fractions). Host-side:
the matrices are meta tensors, nothing is allocated or run on a device."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

import torch

from ...optim.cost_fractions import cost_allocated_fractions, cost_allocated_groups
from ...optim.fraction_table import describe_fractions
from ...rules import selected_row_count
from ..bench.presets import MODELS, named_model
from ..setting_names import Dion3Setting, fraction_text, parse_fraction

ORTHOGONALIZERS = ("auto", "newton_schulz", "gram")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dion3 fractions", description=__doc__)
    p.add_argument("--preset", help=f"one of {', '.join(sorted(MODELS))}: every model name of "
                   "dion3.tools.models, every layer of the model (default llama-8b)")
    p.add_argument("--shapes", help="custom matrices ROWSxCOLS[:COUNT],... instead of a preset")
    p.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json of a Llama-family decoder instead "
                   "of a preset (as `dion3 plan --hf-config`; experts as stacks of their matrices)")
    p.add_argument("--fraction", default="1/4",
                   help="the uniform fraction to allocate, written 1/4 or 0.25 (default 1/4: dion3-1/4-cost, as "
                        "`dion3 compare` and `dion3 bench` name it)")
    p.add_argument("--most-rows", action="store_true",
                   help="the most rows within that time (fraction_allocation=\"most_rows\", dion3-F-rows) instead of "
                        "the water-filling's (\"cost\")")
    p.add_argument("--orthogonalizer", default="auto", choices=ORTHOGONALIZERS,
                   help="the group's orthogonalizer, which the time model prices (default auto)")
    return p


def groups(matrices, fraction: float, orthogonalizer: str = "auto", experts: Optional[dict] = None,
           most_rows: bool = False) -> list[dict]:
    """One Dion3 group of meta matrices (named as the preset names them; a shape in `experts` as
    stacks [E, rows, cols]), split by cost as param_groups splits a model's (with most_rows: as
    fraction_allocation="most_rows" does)."""
    params, names = [], []
    for shape in matrices:
        stack = (experts or {}).get(shape.name)
        size = (stack, shape.rows, shape.cols) if stack else (shape.rows, shape.cols)
        params += [torch.empty(size, device="meta") for _ in range(shape.count)]
        names += [shape.name] * shape.count
    group = dict(params=params, param_names=names)
    if orthogonalizer != "auto":
        group["orthogonalizer"] = orthogonalizer
    return cost_allocated_groups(group, fraction, most_rows=most_rows)


def row_share(matrices, fraction: float, experts: Optional[dict] = None, allocation: str = "cost") -> float:
    """The share of all the rows (each matrix of a stack counted) that `fraction` selects under
    param_groups' fraction_allocation `allocation` ("uniform", "cost", "most_rows"): what the study
    records as a Dion3 run's average_fraction, so that one name ("½ by cost") can be compared across
    models, where the same budget buys different shares."""
    # a stack of E experts is E matrices of its shape, as cost_allocated_groups counts them
    shapes = [dataclasses.replace(m, count=m.count * (experts or {}).get(m.name, 1)) for m in matrices]
    fractions = ([fraction] * len(shapes) if allocation == "uniform" else
                 cost_allocated_fractions(shapes, fraction, most_rows=allocation == "most_rows"))
    selected = sum(s.count * selected_row_count(s.rows, f) for s, f in zip(shapes, fractions))
    return selected / sum(s.count * s.rows for s in shapes)


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        try:
            fraction = parse_fraction(args.fraction)
        except ValueError as error:
            raise ValueError(f"--fraction: {error}") from None
        described = named_model(args.preset, args.shapes, args.hf_config, "fractions")
        if described.note:
            print(f"dion3 fractions: note: {described.note}", file=sys.stderr)
        preset, experts = described.preset, described.experts
    except ValueError as error:
        print(f"dion3 fractions: {error}", file=sys.stderr)
        return 2
    allocation = "most_rows" if args.most_rows else "cost"
    setting = Dion3Setting(fraction, allocation)
    print(f"{preset.name} ({preset.description}): {setting.name}, fractions per matrix shape within the "
          f"modeled H200 step time of {fraction_text(fraction)} on every matrix"
          + (", the most rows" if args.most_rows else "")
          + f" (param_groups(..., fraction={fraction!r}, fraction_allocation=\"{allocation}\"), "
          f"orthogonalizer {args.orthogonalizer})\n")
    print(describe_fractions(groups(preset.matrices, fraction, args.orthogonalizer, experts, args.most_rows), fraction))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
