"""State dicts of other optimizers (torch.optim.AdamW, Adam, SGD, ...): how to tell one from a
dion3 state dict, how errors name it, and what of it `convert_state_dict` carries over.

A saved group is another optimizer's when it names no algorithm (every dion3 group does, but
those saved before groups named one) and either holds one of the flags every torch.optim
optimizer writes into its groups (`maximize`, `foreach`, ...) or its parameters' state holds an
entry that no dion3 algorithm keeps (SGD's `momentum_buffer`, say).

What carries over (docs/training.md, "Switching from AdamW or another torch optimizer"):

* into an AdamW group, from torch's Adam or AdamW: `exp_avg`, `exp_avg_sq` and `step` as saved
  (the group runs torch's own fused AdamW update); `max_exp_avg_sq` (amsgrad) is dropped;
* into a Lion group, from Adam or AdamW: `exp_avg` as saved (both are an EMA of the gradients);
* into a matrix group (Dion3, Dion2, Muon, NorMuon): the momentum, from Adam/AdamW's first
  moment or SGD's momentum buffer. Those are means of recent gradients, the matrix rules'
  momentum is a μ-decayed sum of them (M ← μM + G), so the mean m is turned into the sum that
  gradients averaging m add up to: M = m / (1 − μ), with μ the new group's. Adam/AdamW's mean is
  its bias-corrected first moment, exp_avg / (1 − β₁ᵗ) (t its `step`), the one its own update
  reads; SGD's is momentum_buffer · (1 − momentum) / (1 − dampening).
* everything else (NorMuon/Dion3's per-row variance, which measures the orthogonalized update,
  not the gradient; any entry of another optimizer) starts at zero.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, Optional

import torch

from .validation import MATRIX_ALGORITHMS, STATE_ENTRIES, param_label

TORCH_FLAGS = ("maximize", "foreach", "differentiable", "capturable", "fused")
DION3_ENTRIES = frozenset(key for keys in STATE_ENTRIES.values() for key in keys)
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq", "step")

# (entries a torch.optim optimizer keeps, its name), most specific first
TORCH_STATES = (
    (("exp_avg", "exp_avg_sq", "mu_product"), "torch.optim.NAdam"),
    (("exp_avg", "exp_avg_sq"), None),  # Adam or AdamW: told apart by the group (adam_name)
    (("exp_avg", "exp_inf"), "torch.optim.Adamax"),
    (("momentum_buffer",), "torch.optim.SGD"),
    (("square_avg", "acc_delta"), "torch.optim.Adadelta"),
    (("square_avg",), "torch.optim.RMSprop"),
    (("sum",), "torch.optim.Adagrad"),
    (("prev", "step_size"), "torch.optim.Rprop"),
)


def is_foreign(group: Mapping[str, Any], entries: Iterable[str]) -> bool:
    """Whether a saved group (with its parameters' state entry names) is another optimizer's."""
    if group.get("algorithm") is not None:
        return False
    return any(flag in group for flag in TORCH_FLAGS) or bool(set(entries) - DION3_ENTRIES)


def adam_name(group: Mapping[str, Any]) -> str:
    decoupled = group.get("decoupled_weight_decay")
    return "torch.optim.AdamW" if decoupled else "torch.optim.Adam" if decoupled is False else "torch.optim.AdamW (or Adam)"


def held(group: Mapping[str, Any], entries: Iterable[str]) -> str:
    """What a foreign group's state holds, said for an error: "exp_avg/exp_avg_sq, as
    torch.optim.AdamW saves"."""
    entries = set(entries)
    for keys, name in TORCH_STATES:
        if set(keys) <= entries:
            return f"{'/'.join(keys)}, as {name or adam_name(group)} saves"
    return f"{'/'.join(sorted(entries))}, which no dion3 algorithm keeps"


def entry_names(state: Mapping[Any, Any], ids: Iterable[Any]) -> list[str]:
    """The state entry names the parameters `ids` have in `state`, in order of first appearance."""
    names: dict[str, None] = {}
    for pid in ids:
        entry = state.get(pid)
        if isinstance(entry, Mapping):
            names.update(dict.fromkeys(entry))
    return list(names)


def check_not_foreign(state_dict: Mapping[str, Any], param_groups: list[dict]) -> None:
    """Raise ValueError, naming the optimizer, the parameter and its group, where `state_dict` was
    saved by another optimizer than dion3's: `load_state_dict` would take that optimizer's groups
    (their `eps`, `momentum`, ...) for dion3's, so the switch goes through convert_state_dict."""
    saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(state, Mapping):
        return  # not an optimizer's state dict at all: check_state_dict says so
    same_grouping = len(saved_groups) == len(param_groups) and all(
        isinstance(saved, Mapping) and len(saved.get("params", ())) == len(group["params"])
        for saved, group in zip(saved_groups, param_groups))
    for index, saved in enumerate(saved_groups):
        if not isinstance(saved, Mapping):
            continue
        ids = list(saved.get("params", ()))
        entries = entry_names(state, ids)
        if not is_foreign(saved, entries):
            continue
        first = next((i for i, pid in enumerate(ids) if state.get(pid)), None)
        if first is None:  # an optimizer that never stepped: its settings tell
            settings = ", ".join(key for key in saved if key not in ("params", "param_names"))
            what = f"its group {index} holds no state, and settings of torch.optim ({settings})"
        elif same_grouping:
            group = param_groups[index]
            label = param_label(group.get("param_names"), index, first, group["params"][first])
            keeps = "/".join(STATE_ENTRIES[group["algorithm"]])
            what = (f"for parameter {label} it holds {held(saved, entries)}, where this optimizer's "
                    f"{group['algorithm']!r} keeps {keeps}")
        else:
            names = saved.get("param_names")
            label = f"{names[first]!r} of group {index}" if names else f"{first} of group {index}"
            what = f"for parameter {label} it holds {held(saved, entries)}"
        raise ValueError(
            f"the state dict was saved by another optimizer: {what}. To start from it, load "
            "dion3.convert_state_dict(state_dict, optimizer) instead, which carries over what maps (AdamW's first "
            "moment or SGD's momentum buffer as the momentum) and starts the rest at zero (docs/training.md, "
            "\"Switching from AdamW or another torch optimizer\")"
        )


def converted_entries(saved: Mapping[str, Any], saved_group: Mapping[str, Any], own: Mapping[str, Any],
                      target_group: Mapping[str, Any], target_as: str) -> dict[str, Any]:
    """The entries `own` (the target's, a template) of one parameter, from another optimizer's
    state `saved` of that parameter (module docstring); new tensors, none of the arguments'."""
    # torch.optim.Adam/AdamW (their groups alone hold `amsgrad`; NAdam, RAdam and Adamax step otherwise)
    adam = all(key in saved for key in ADAM_MOMENTS) and "betas" in saved_group and "amsgrad" in saved_group
    out = {}
    for key, value in own.items():
        carried = None
        if target_as == "adamw" and adam and key in ADAM_MOMENTS:
            carried = saved[key].clone() if isinstance(saved[key], torch.Tensor) else saved[key]
        elif target_as == "lion" and adam and key == "exp_avg":
            carried = saved["exp_avg"].clone()
        elif target_as in MATRIX_ALGORITHMS and key == "momentum":
            carried = _momentum(saved, saved_group, adam, float(target_group["mu"]))
        out[key] = torch.zeros_like(value) if carried is None else carried
    return out


def _momentum(saved: Mapping[str, Any], saved_group: Mapping[str, Any], adam: bool, mu: float) -> Optional[torch.Tensor]:
    """M = m / (1 − μ) from the saved mean m of recent gradients (module docstring), in float64 and
    rounded once into the saved dtype, in the order the docs write it; None where the saved state
    holds no such mean."""
    if adam:
        beta1, steps = float(saved_group["betas"][0]), float(saved["step"])
        if steps == 0:
            return None
        mean = saved["exp_avg"]
        return (mean.to(torch.float64) / (1.0 - beta1 ** steps) / (1.0 - mu)).to(mean.dtype)
    buffer, dampening = saved.get("momentum_buffer"), float(saved_group.get("dampening", 0.0))
    if buffer is None or dampening >= 1.0:
        return None
    momentum = float(saved_group.get("momentum", 0.0))
    return (buffer.to(torch.float64) * (1.0 - momentum) / (1.0 - dampening) / (1.0 - mu)).to(buffer.dtype)
