"""A parameter group joining the others (add_param_group): its names must agree with theirs, and a
group added to a built optimizer is told when the defaults it takes differ from what the other
groups of its algorithm run.

torch.optim fills whatever a group leaves out from the optimizer's defaults (the constructor's
arguments), never from the other groups. After `Dion3(dion3.param_groups(model, lr=0.015,
mu=0.6, ...))` the groups run lr 0.015 and μ 0.6 while the defaults stay lr 0.01 and μ 0.95, so
`optimizer.add_param_group({"params": [...]})` would train the new matrices at 0.01 and 0.95.
That is kept (which group should a new one copy? the per-shape groups of
fraction_allocation="cost" hold different fractions), and said with a warning that names the
settings to pass; a group that passes them, even equal to the defaults, gets none, and so does
a setting that some group of its algorithm runs too.
"""
from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor

from .validation import NORMALIZING_ALGORITHMS, SCALAR_ALGORITHMS, SELECTING_ALGORITHMS

NAMES_EXAMPLE = '{"params": [...], "param_names": [...]}'


def check_names(group: dict, index: int, others: list[dict]) -> None:
    """Every group carries `param_names` or none does (torch.optim's rule, said with what to pass)."""
    names, count = group.get("param_names"), len(group["params"])
    if names is not None and len(names) != count:
        raise ValueError(f"parameter group {index} has {len(names)} param_names for {count} parameters; "
                         "give one name per parameter")
    if not others or ("param_names" in others[0]) == (names is not None):  # the others agree (checked as they came)
        return
    if names is None:
        raise ValueError(
            f"parameter group {index} has no 'param_names', but the other groups carry them (errors name "
            f"parameters by them): add them, as in {NAMES_EXAMPLE}, or give 'params' as (name, tensor) pairs")
    raise ValueError(f"parameter group {index} has 'param_names', but the other groups have none: leave them "
                     "out, or give every group its names")


def check_unique_names(names, index: int, others: list[dict]) -> None:
    """No two parameters share a name, within the group or with the groups before it: errors name
    parameters by them, and state dicts are matched by them (convert_state_dict). Two models'
    `named_parameters()` in one optimizer would otherwise both hold e.g. 'blocks.0.fc.weight'."""
    if names is None:
        return
    seen: dict = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(f"parameter group {index} gives the name {name!r} to two parameters (positions {seen[name]} "
                             f"and {i}); parameter names must be unique (errors and state dicts tell parameters apart "
                             "by them)")
        seen[name] = i
    for g, other in enumerate(others):
        clash = next((name for name in other.get("param_names") or () if name in seen), None)
        if clash is not None:
            raise ValueError(f"parameter group {index} names a parameter {clash!r}, and so does parameter group {g} "
                             "(another parameter); parameter names must be unique (errors and state dicts tell "
                             f"parameters apart by them), e.g. prefix each model's names ({'a.' + clash!r} and "
                             f"{'b.' + clash!r})")


def read_settings(algorithm: str) -> tuple[str, ...]:
    """The hyperparameters a group of `algorithm` steps with (what a warning compares)."""
    if algorithm in SCALAR_ALGORITHMS:
        return ("lr", "betas", "weight_decay", "epsilon")
    keys = ("lr", "mu", "weight_decay", "adjust_lr")
    keys += ("fraction", "unselected_decay") if algorithm in SELECTING_ALGORITHMS else ("nesterov",)
    keys += ("muon_beta2", "epsilon") if algorithm in NORMALIZING_ALGORITHMS else ()
    return keys


def warn_of_defaults(given, group: dict, index: int, others: list[dict], optimizer_name: str) -> None:
    """Warn when the group added to a built optimizer takes a default (a setting not in `given`,
    the keys the caller passed) that no other group of its algorithm runs."""
    algorithm = group["algorithm"]
    peers = {i: other for i, other in enumerate(others) if other.get("algorithm") == algorithm}
    if not peers:
        return
    differing: dict[str, dict[int, Any]] = {}
    for key in read_settings(algorithm):
        if key in given:
            continue
        held = {i: _setting(other, key) for i, other in peers.items()}
        if all(value != _setting(group, key) for value in held.values()):  # no peer runs the default
            differing[key] = held
    if not differing:
        return
    took = ", ".join(f"{key}={_setting(group, key)!r}" for key in differing)
    run = ", ".join(f"{key}={_values(held)}" for key, held in differing.items())
    example = ", ".join(f"{key!r}: {_example(held)}" for key, held in differing.items())
    warnings.warn(
        f"parameter group {index} ({algorithm!r}) takes {took} from the defaults of this {optimizer_name}, but "
        f"the other {algorithm!r} groups run {run}: torch.optim fills a group from the optimizer's defaults, not "
        f"from the other groups. Pass the settings it should run, e.g. optimizer.add_param_group({{'params': [...], "
        f"{example}}}); settings passed, even equal to the defaults, are not warned about (docs/training.md, "
        '"Adding a group later")',
        UserWarning, stacklevel=3)


def _setting(group: dict, key: str):
    """A group's setting as it was chosen: the lr an LR scheduler started from (initial_lr), a
    tensor lr as a number, betas as a tuple."""
    value = group.get("initial_lr", group["lr"]) if key == "lr" else group[key]
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    return tuple(value) if isinstance(value, list) else value


def _values(held: dict[int, Any]) -> str:
    by_value: dict[Any, list[int]] = {}
    for i, value in held.items():
        by_value.setdefault(value, []).append(i)
    if len(by_value) == 1:
        return repr(next(iter(by_value)))
    return " or ".join(f"{value!r} (group{'s' if len(at) > 1 else ''} {', '.join(map(str, at))})"
                       for value, at in by_value.items())


def _example(held: dict[int, Any]) -> str:
    values = set(held.values())
    return repr(values.pop()) if len(values) == 1 else "..."
