"""`convert_state_dict`: start an optimizer from a state dict saved by another algorithm.

`load_state_dict` refuses a state dict whose group was saved by another algorithm than the one
the optimizer's group runs: torch.optim replaces each group by the saved one, so a Muon
checkpoint loaded into Dion3 would quietly train Muon with the saved settings. Switching on
purpose (start Dion3 from a Muon run's momentum, say) goes through `convert_state_dict`, which
rewrites the saved state dict (a dion3 optimizer's, or another's such as torch.optim.AdamW's)
into the one the target optimizer would save: a normal state dict of the target's algorithms,
which `optimizer.load_state_dict` and torch.distributed.checkpoint's `set_optimizer_state_dict`
(it calls `load_state_dict` with it) load without arguments.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch

from .foreign_state import converted_entries, entry_names, is_foreign
from .validation import STATE_ENTRIES, saved_algorithm

_STATE, _GROUPS = "state.", "param_groups."  # keys of DCP's flat form (flatten_optimizer_state_dict=True)


def convert_state_dict(state_dict: Mapping[str, Any],
                       target: Union[torch.optim.Optimizer, Mapping[str, Any]]) -> dict[str, Any]:
    """`state_dict`, saved by a dion3 optimizer (any algorithm in any group) or by another one
    (torch.optim.AdamW, Adam, SGD, ...), rewritten as the state dict that `target` would save, for
    `target.load_state_dict(...)` (or DCP's `set_optimizer_state_dict`): the switch of algorithm
    that `load_state_dict` refuses on its own.

    target: the optimizer that will load the result (its `state_dict()` is the template), or that
        optimizer's own state dict in the form of `state_dict`: for a state dict read through
        torch.distributed.checkpoint, `get_optimizer_state_dict(model, optimizer, options=...)`
        with the options that one was read with (parameters are then matched by FQN; the flat
        form of `flatten_optimizer_state_dict=True`, torchtitan's, included). Otherwise
        parameters are matched by position, group by group, as `load_state_dict` matches them,
        or, where the groups differ (one matrix group saved, one per shape wanted with
        `fraction_allocation="cost"`), by the names both optimizers' groups hold (`param_names`).

    Per parameter, each state entry the target keeps is the saved one when the saved algorithm
    keeps an entry of that name too (the momentum between Dion3, Dion2, Muon and NorMuon, the
    per-row variance between Dion3 and NorMuon, `exp_avg` between AdamW and Lion, every entry
    between equal algorithms), else zero (Dion3 started from Muon gets zero variance); saved
    entries the target does not keep are left out. Everything else is the target's: each group's
    algorithm and settings (lr, fraction, mu, ...), not the saved ones, and in the flat form any
    key outside the optimizer state. Loading casts the momentum to the target's momentum dtype.
    A group saved before groups named their algorithm counts as the target's. From another
    optimizer's state (foreign_state): AdamW/Adam's moments and step carry over into an AdamW
    group as saved, exp_avg into a Lion group, and a matrix's momentum starts at the mean gradient
    they hold turned into a μ-decayed sum, exp_avg / (1 − β₁ᵗ) / (1 − μ) (SGD's: momentum_buffer ·
    (1 − momentum) / (1 − dampening) / (1 − μ)); the rest starts at zero. Neither argument is
    modified: the result's state tensors are the saved ones, new zeros and new tensors computed
    from the saved ones, none of the target's.
    """
    template = target.state_dict() if isinstance(target, torch.optim.Optimizer) else target
    for name, value in (("state_dict", state_dict), ("target's state dict", template)):
        if not isinstance(value, Mapping):
            raise TypeError(f"convert_state_dict: {name} must be a state dict (a mapping), got {type(value).__name__}")
    structured = [_is_structured(d) for d in (state_dict, template)]
    if structured[0] != structured[1]:
        forms = ["{'state': ..., 'param_groups': [...]}" if s else "flat ('state.<fqn>.<entry>' keys)"
                 for s in structured]
        raise ValueError(f"convert_state_dict: the state dict has the form {forms[0]} but the target's has the form "
                         f"{forms[1]}; pass the target's state dict in the saved one's form (docs/training.md, "
                         '"Switching algorithms")')
    if structured[0]:
        return _convert_structured(state_dict, template)
    return _convert_flat(state_dict, template)


def _is_structured(state_dict: Mapping[str, Any]) -> bool:
    if "state" in state_dict and "param_groups" in state_dict:
        return True
    if any(isinstance(k, str) and k.startswith((_STATE, _GROUPS)) for k in state_dict):
        return False
    raise ValueError("convert_state_dict: a state dict must have 'state' and 'param_groups' entries "
                     "(from optimizer.state_dict() or DCP's get_optimizer_state_dict)")


def _target_algorithm(group: Mapping[str, Any], where: str) -> str:
    algorithm = saved_algorithm(group.get("algorithm"), where)
    if algorithm is None:
        raise ValueError(f"convert_state_dict: {where} names no algorithm; the target must be a dion3 optimizer "
                         "(Dion3, Muon, NorMuon) or its state dict")
    return algorithm


def _entries(saved: Mapping[str, Any], own: Mapping[str, Any], saved_as: str, where: str) -> dict[str, Any]:
    """The target's entries of one parameter: saved where the saved algorithm keeps them, else zero."""
    out = {}
    for key, value in own.items():
        if key not in STATE_ENTRIES[saved_as]:
            out[key] = torch.zeros_like(value)
        elif key in saved:
            out[key] = saved[key]
        else:
            raise ValueError(f"convert_state_dict: the state dict has no {key!r} for parameter {where}, which "
                             f"{saved_as!r} keeps; the state dict does not match these parameters")
    return out


def _convert_structured(state_dict: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    saved_groups, groups = list(state_dict["param_groups"]), list(template["param_groups"])
    ids = [pid for g in saved_groups + groups for pid in g["params"]]
    if ids and all(isinstance(pid, str) for pid in ids):  # FQNs (torch.distributed.checkpoint) name themselves
        pairs = _pairs_by_name(saved_groups, groups, "params")
    elif _same_grouping(saved_groups, groups):  # by position, as load_state_dict matches them
        pairs = [list(zip(g["params"], s["params"], [s] * len(g["params"]))) for g, s in zip(groups, saved_groups)]
    else:  # regrouped (e.g. fraction_allocation="cost" after one group): by the names param_groups gives
        if not all("param_names" in g for g in saved_groups + groups):
            counts = [[len(g["params"]) for g in gs] for gs in (saved_groups, groups)]
            raise ValueError(
                f"convert_state_dict: the state dict's groups hold {counts[0]} parameters but the target's hold "
                f"{counts[1]}, and without parameter names (`param_groups`, or (name, tensor) pairs) the "
                "parameters cannot be matched: give both optimizers' groups their names (a torch.optim state dict "
                "saved without them takes them in one line: docs/training.md, \"Switching from AdamW or another "
                "torch optimizer\")")
        pairs = _pairs_by_name(saved_groups, groups, "param_names")
    # saved groups of another optimizer (torch.optim.AdamW, say), by identity
    foreign = {id(g) for g in saved_groups if is_foreign(g, entry_names(state_dict["state"], g["params"]))}
    state: dict[Any, Any] = {}
    for index, (group, members) in enumerate(zip(groups, pairs)):
        target_as = _target_algorithm(group, f"parameter group {index} of the target")
        names = group.get("param_names")
        for i, (pid, saved_pid, saved_group) in enumerate(members):
            if pid not in template["state"]:  # no state of its own (not ours: dion3 creates it up front)
                continue
            saved = state_dict["state"].get(saved_pid, {})
            if id(saved_group) in foreign:
                state[pid] = converted_entries(saved, saved_group, template["state"][pid], group, target_as)
                continue
            label = repr(pid) if isinstance(pid, str) else f"{names[i]!r} of group {index}" if names else \
                f"{i} of group {index}"
            saved_as = saved_algorithm(saved_group.get("algorithm"), f"the state dict's group of parameter {label}")
            state[pid] = _entries(saved, template["state"][pid], saved_as or target_as, label)
    return {"state": state, "param_groups": [dict(g, params=list(g["params"])) for g in groups]}


def _same_grouping(saved_groups: list, groups: list) -> bool:
    return len(saved_groups) == len(groups) and all(
        len(saved["params"]) == len(group["params"]) for saved, group in zip(saved_groups, groups))


def _pairs_by_name(saved_groups: list, groups: list, names: str) -> list[list[tuple[Any, Any, Mapping[str, Any]]]]:
    """(target id, saved id, saved group) per parameter of each target group, matched by the names
    in each group's list `names`: "params" where the ids are FQNs, else "param_names" (which
    optimizers built from named parameters, as `param_groups` builds them, save)."""
    saved_by_name = {name: (pid, g) for g in saved_groups for name, pid in zip(g[names], g["params"])}
    missing = [name for g in groups for name in g[names] if name not in saved_by_name]
    if missing:
        raise ValueError(f"convert_state_dict: the state dict has no parameter {missing[0]!r} (of {len(missing)} "
                         "missing); it does not match these parameters")
    return [[(pid, *saved_by_name[name]) for name, pid in zip(g[names], g["params"])] for g in groups]


def _split(state_dict: Mapping[str, Any], prefix: str) -> dict[tuple[str, str], Any]:
    """{(fqn, name): value} of the flat keys `prefix + fqn + "." + name` (names hold no dot)."""
    out = {}
    for key, value in state_dict.items():
        if isinstance(key, str) and key.startswith(prefix) and "." in key[len(prefix):]:
            fqn, name = key[len(prefix):].rsplit(".", 1)
            out[(fqn, name)] = value
    return out


def _per_fqn(split: dict[tuple[str, str], Any]) -> dict[str, dict[str, Any]]:
    """{fqn: {name: value}} of _split's {(fqn, name): value}."""
    out: dict[str, dict[str, Any]] = {}
    for (fqn, name), value in split.items():
        out.setdefault(fqn, {})[name] = value
    return out


def _convert_flat(state_dict: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    saved_settings, target_settings = _per_fqn(_split(state_dict, _GROUPS)), _per_fqn(_split(template, _GROUPS))
    saved_entries, by_param = _per_fqn(_split(state_dict, _STATE)), _per_fqn(_split(template, _STATE))
    out = {k: v for k, v in template.items() if not (isinstance(k, str) and k.startswith(_STATE))}
    for fqn, own in by_param.items():
        if fqn not in saved_settings:
            raise ValueError(f"convert_state_dict: the state dict has no parameter {fqn!r}; it does not match "
                             "these parameters")
        target_as = _target_algorithm(target_settings.get(fqn, {}), f"the target's group of {fqn!r}")
        saved = saved_entries.get(fqn, {})
        if is_foreign(saved_settings[fqn], saved):  # another optimizer's (torch.optim.AdamW, say)
            entries = converted_entries(saved, saved_settings[fqn], own, target_settings[fqn], target_as)
        else:
            saved_as = saved_algorithm(saved_settings[fqn].get("algorithm"), f"the state dict's group of {fqn!r}")
            entries = _entries({name: saved[name] for name in own if name in saved}, own, saved_as or target_as,
                               repr(fqn))
        for name, value in entries.items():
            out[f"{_STATE}{fqn}.{name}"] = value
    return out
