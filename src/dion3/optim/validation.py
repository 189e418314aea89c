"""Validation of parameter groups, hyperparameters and state dicts: every rejection is a
ValueError that names the group, the argument or the parameter (docs/errors.md)."""
from __future__ import annotations

import difflib
import math
import numbers
import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from .. import blocks, rules
from ..buckets import variance_shape
from ..distributed.mesh import local_tensor
from ..ortho import get_schedule
from ..ortho.newton_schulz import METHODS

from ..algorithms import (  # noqa: F401 (re-exported: the front-ends read them from here)
    ALIASES, MATRIX_ALGORITHMS, NORMALIZING_ALGORITHMS, SCALAR_ALGORITHMS, SELECTING_ALGORITHMS,
)
SCOPES = ("local", "global")

# Keys a parameter group may hold besides the optimizer's settings (its defaults): the tensors,
# their names (torch.optim keeps "param_names"), what torch's LR schedulers and SWA write into
# a running optimizer's groups (a group copied from one holds them; dion3.tools.train reads
# initial_lr), and BY_COST_KEYS. Any other key is refused by name: it would be kept and never read.
# BY_COST_KEYS: what param_groups(fraction_allocation="cost" or "most_rows") writes into each
# group it allocates, the budget (the uniform fraction whose modeled step time the fractions
# share), the row weights and, for "most_rows", that rule, so that a FractionScheduler can
# allocate another budget by the same rule.
BUDGET_KEY, WEIGHTS_KEY, MOST_ROWS_KEY = "fraction_budget", "fraction_weights", "fraction_most_rows"
BY_COST_KEYS = (BUDGET_KEY, WEIGHTS_KEY, MOST_ROWS_KEY)
GROUP_KEYS = ("params", "param_names", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr",
              *BY_COST_KEYS)
# Settings that only the orthogonal rules (Dion3, Dion2, Muon, NorMuon) read; an AdamW or Lion
# group reads lr, betas, weight_decay and epsilon of the optimizer's settings.
MATRIX_SETTINGS = ("fraction", "mu", "muon_beta2", "nesterov", "adjust_lr", "flatten", "stacked", "orthogonalizer",
                   "ns_coefficients", "selection_scope", "row_score", "unselected_decay", "num_heads", "split_sizes",
                   "momentum_dtype")
# torch.optim's names of settings that dion3 spells otherwise: suggested where difflib would not
TORCH_NAMES = {"momentum": "mu", "eps": "epsilon"}

# The state entries each algorithm keeps per parameter (expected_state_shapes gives their shapes).
STATE_ENTRIES = {
    "adamw": ("step", "exp_avg", "exp_avg_sq"),
    "lion": ("exp_avg",),
    "muon": ("momentum",),
    "dion2": ("momentum",),
    "dion3": ("momentum", "variance"),
    "normuon": ("momentum", "variance"),
}


def check_group_keys(group: dict, index: int, settings) -> None:
    """Raise ValueError naming every key of the group that is neither a setting of the optimizer
    (`settings`, its defaults) nor one of GROUP_KEYS, with the closest known key."""
    known = sorted(set(settings) | set(GROUP_KEYS))
    unknown = [key for key in group if key not in known]
    if not unknown:
        return
    named, guessed = [], True
    for key in unknown:
        close = [TORCH_NAMES[key]] if key in TORCH_NAMES else difflib.get_close_matches(str(key), known, n=1)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        guessed = guessed and bool(close)
    keys = f"an unknown key {named[0]}" if len(named) == 1 else f"unknown keys {', '.join(named)}"
    allowed = sorted(settings) + list(GROUP_KEYS[:2])
    listed = "" if guessed else f"; a group may hold {', '.join(allowed[:-1])} and {allowed[-1]}"
    raise ValueError(f"parameter group {index} has {keys}, which would be ignored{listed}")


def saved_algorithm(name, where: str) -> Optional[str]:
    """The algorithm a saved group names, aliases resolved (None: saved before groups had one)."""
    if name is None:
        return None
    name = ALIASES.get(name, name)
    if name not in STATE_ENTRIES:
        raise ValueError(f"{where} has unknown algorithm {name!r}; expected one of {tuple(STATE_ENTRIES)}")
    return name


def param_label(names, group_index: Optional[int], index: int, param: Tensor) -> str:
    """How errors name a parameter: its name when named parameters were given, else its index
    and shape; with its group ("'w' of group 0", "2 of group 0 (shape (8,))") unless group_index
    is None, for a message that names the group already."""
    group = "" if group_index is None else f" of group {group_index}"
    if names is not None:
        return f"{names[index]!r}{group}"
    return f"{index}{group} (shape {tuple(param.shape)})"


def validate_group(group: dict, index: int) -> None:
    """Raise ValueError naming the group, argument or parameter that is not acceptable."""
    where = f"parameter group {index}"
    algorithm = group["algorithm"]
    if algorithm not in MATRIX_ALGORITHMS + SCALAR_ALGORITHMS:
        raise ValueError(
            f"{where}: unknown algorithm {algorithm!r}; expected one of "
            f"{MATRIX_ALGORITHMS + SCALAR_ALGORITHMS} (or the alias 'nordion2')"
        )
    lr = group["lr"]
    lr_value = float(lr) if isinstance(lr, Tensor) and lr.numel() == 1 else lr
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: lr tensor must hold one value, got shape {tuple(lr.shape)}")
    if not isinstance(lr, Tensor):
        check_number(where, "lr", lr)
    if not math.isfinite(lr_value) or lr_value < 0:
        raise ValueError(f"{where}: lr must be a finite number ≥ 0, got {lr!r}")
    # finite: an infinite decay or epsilon would turn every weight into ±inf or freeze it
    check_range(where, "weight_decay", group["weight_decay"], 0.0, math.inf, high_open=True)
    check_range(where, "epsilon", group["epsilon"], 0.0, math.inf, low_open=True, high_open=True)
    check_flag(where, "flatten", group["flatten"])
    check_flag(where, "stacked", group["stacked"])
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for name, value in zip(("betas[0]", "betas[1]"), betas):
        check_range(where, name, value, 0.0, 1.0, high_open=True)
    if algorithm in SCALAR_ALGORITHMS:
        return
    check_flag(where, "nesterov", group["nesterov"])
    check_range(where, "mu", group["mu"], 0.0, 1.0, high_open=True)
    check_range(where, "muon_beta2", group["muon_beta2"], 0.0, 1.0, high_open=True)
    check_range(where, "fraction", group["fraction"], 0.0, 1.0, low_open=True)
    if group["adjust_lr"] not in rules.ADJUST_LR:
        raise ValueError(f"{where}: unknown adjust_lr {group['adjust_lr']!r}; expected one of {rules.ADJUST_LR}")
    if group["orthogonalizer"] not in METHODS:
        raise ValueError(f"{where}: unknown orthogonalizer {group['orthogonalizer']!r}; expected one of {METHODS}")
    if group["selection_scope"] not in SCOPES:
        raise ValueError(f"{where}: unknown selection_scope {group['selection_scope']!r}; expected one of {SCOPES}")
    if group.setdefault("row_score", "l1") not in rules.ROW_SCORES:  # groups saved before the option lack it
        raise ValueError(f"{where}: unknown row_score {group['row_score']!r}; expected one of {rules.ROW_SCORES}")
    # (0, 1]: 0 would erase the error feedback of every unselected row; 1 is the rule
    check_range(where, "unselected_decay", group.setdefault("unselected_decay", 1.0), 0.0, 1.0, low_open=True)
    if algorithm in SELECTING_ALGORITHMS and group["nesterov"]:
        name = "Dion3" if algorithm == "dion3" else "Dion2"
        raise ValueError(f"{where}: {name} has no Nesterov variant; use nesterov=False")
    get_schedule(group["ns_coefficients"])  # raises on unknown names
    group["momentum_dtype"] = _momentum_dtype_name(where, group.get("momentum_dtype"))
    num_heads, split_sizes = group.get("num_heads"), group.get("split_sizes")
    problem = blocks.option_error(num_heads, split_sizes)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    if group["flatten"] and group["stacked"]:
        raise ValueError(
            f"{where}: flatten=True (every parameter one matrix) and stacked=True (a 3-D parameter a stack of "
            "matrices) contradict each other; put convolution kernels (flatten=True) and expert stacks "
            "(stacked=True, flatten=False) in separate groups"
        )
    for i, p in enumerate(group["params"]):
        label = param_label(group.get("param_names"), None, i, p)  # `where` names the group
        if not p.is_floating_point():
            raise ValueError(
                f"{where}: parameter {label} has dtype {p.dtype}, but algorithm {algorithm!r} "
                "needs real floating-point matrices (float32, bfloat16, float16, float64)"
            )
        if p.dim() >= 2 and 0 in p.shape:  # topk and the NS normalization need ≥ 1 row and column
            raise ValueError(f"{where}: parameter {label} is empty (a dimension is 0); leave it out")
        if group["flatten"] and p.dim() >= 2:
            if not _rows_view_in_place(p):  # else the step would update a reshaped copy
                raise ValueError(
                    f"{where}: parameter {label} cannot be flattened to [rows, -1] in place with "
                    "flatten=True (its memory layout, e.g. channels_last, is not row-major); make it "
                    "contiguous (memory_format=torch.contiguous_format)"
                )
        elif p.dim() == 3 and not group["stacked"]:
            raise ValueError(f"{where}: parameter {label} {_ambiguous_3d(p.shape)}")
        elif p.dim() < 2:
            # the first thing torch users try is Dion3(model.parameters()), which stops at the first bias
            raise ValueError(f"{where}: parameter {label} is {p.dim()}-D, but algorithm {algorithm!r} orthogonalizes "
                             "matrices; put 1-D parameters (biases, norms) in an 'adamw' or 'lion' group. For a whole "
                             "model, pass dion3.param_groups(model, lm_head=...): the hidden matrices in one group, the "
                             "biases, norms, embeddings and LM head in AdamW groups, e.g. "
                             "Dion3(dion3.param_groups(model, lm_head=\"lm_head\"))")
        elif p.dim() > 3:
            raise ValueError(f"{where}: parameter {label} is {p.dim()}-D; pass flatten=True to "
                             f"train it as one {p.shape[0]}×{p.numel() // p.shape[0]} matrix (e.g. a conv weight)")
        _check_blocks(where, label, p, group["flatten"], num_heads, split_sizes)


def _ambiguous_3d(shape) -> str:
    """Why a 3-D parameter of a group with neither flatten nor stacked is refused: its shape does not
    say whether it is a convolution kernel (out, in, k), one matrix, or E matrices [E, rows, cols]."""
    first, rows, cols = shape
    return ("is 3-D: a convolution kernel (out, in, k) or a stack of matrices [E, rows, cols]? "
            f"Pass flatten=True for a convolution kernel, trained as one {first}×{rows * cols} matrix, or "
            f"stacked=True for {first} matrices of {rows}×{cols} trained each on its own (expert weights); "
            "dion3.param_groups(model) tells the two apart by their module")


def _momentum_dtype_name(where: str, value) -> Optional[str]:
    """momentum_dtype as stored in the group: None (the parameter's dtype), "float32" or "bfloat16"
    (torch dtypes accepted), anything else refused by name."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", "float32": "float32", "fp32": "float32",
             "bfloat16": "bfloat16", "bf16": "bfloat16", None: None}
    if isinstance(value, (str, torch.dtype)) or value is None:
        key = value.strip().lower() if isinstance(value, str) else value
        if key in names:
            return names[key]
    raise ValueError(f"{where}: momentum_dtype must be None (the parameter's dtype), 'float32' or 'bfloat16', "
                     f"got {value!r}")


def _check_blocks(where: str, label: str, param: Tensor, flatten: bool, num_heads, split_sizes) -> None:
    """The group's block split must fit the rows of the parameter's matrices (the rows of the
    flattened matrix with flatten=True, of each matrix of a 3-D batch otherwise)."""
    if num_heads is None and split_sizes is None:
        return
    rows = param.shape[0] if flatten or param.dim() == 2 else param.shape[1]
    try:
        blocks.block_sizes(rows, num_heads, split_sizes)
    except ValueError as error:
        raise ValueError(f"{where}: parameter {label} {error}") from None


def check_fractions(groups: list[dict]) -> None:
    """The fraction of every Dion3/Dion2 group, checked again at each step: a scheduler (or the user)
    may have changed it since the group was validated."""
    for index, group in enumerate(groups):
        if group.get("algorithm") in SELECTING_ALGORITHMS:  # torch's own optimizers (CapturedStep takes them) have none
            check_range(f"parameter group {index}", "fraction", group["fraction"], 0.0, 1.0, low_open=True)


def _rows_view_in_place(param: Tensor) -> bool:
    """Whether the parameter (its local shard, for a DTensor) can be viewed as [rows, -1]
    without a copy, as the flatten=True step needs."""
    local = local_tensor(param.detach())
    try:
        local.view(local.shape[0], math.prod(local.shape[1:]))
    except RuntimeError:
        return False
    return True


def check_state_dict(state_dict: dict[str, Any], param_groups: list[dict]) -> None:
    """Raise ValueError unless each saved group ran this optimizer's algorithm for its group (a
    group saved before groups named one counts as this one) and state_dict has, for every
    parameter, each state entry that algorithm keeps, with the parameter's shape."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("state dict must have 'state' and 'param_groups' entries (from optimizer.state_dict())")
    regroup = ("; if only the grouping changed (e.g. to fraction_allocation='cost'), load "
               "dion3.convert_state_dict(state_dict, optimizer), which matches parameters by name")
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"state dict has {len(saved_groups)} parameter groups but this optimizer has "
            f"{len(param_groups)}; the state dict does not match these parameters{regroup}"
        )
    for index, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"parameter group {index} of the state dict has {len(saved['params'])} parameters but "
                f"this optimizer's has {len(group['params'])}; the state dict does not match these parameters{regroup}"
            )
        algorithm = group["algorithm"]
        saved_as = saved_algorithm(saved.get("algorithm"), f"parameter group {index} of the state dict")
        if saved_as is not None and saved_as != algorithm:  # torch would take the saved group's algorithm
            raise ValueError(
                f"parameter group {index} of the state dict was saved by algorithm {saved_as!r}, but this "
                f"optimizer runs {algorithm!r} there: loading it would train the group with "
                f"{saved_as!r} and the saved settings. To start {algorithm!r} from this state on purpose, "
                "load dion3.convert_state_dict(state_dict, optimizer) instead: it carries over the state entries "
                "both algorithms keep (the momentum), starts the others at zero and takes this optimizer's "
                'settings (docs/training.md, "Switching algorithms")'
            )
        flatten = saved.get("flatten", group.get("flatten", False))
        for i, (pid, p) in enumerate(zip(saved["params"], group["params"])):
            entry = state_dict["state"].get(pid, {})
            for key, shape in expected_state_shapes(algorithm, p, flatten).items():
                if key not in entry:
                    raise ValueError(
                        f"state dict has no {key!r} for parameter {param_label(group.get('param_names'), index, i, p)}, "
                        f"which {algorithm!r} keeps; the state dict does not match these parameters"
                    )
                found = tuple(entry[key].shape) if isinstance(entry[key], Tensor) else ()
                if math.prod(found) != math.prod(shape) or (len(shape) > 0 and found != shape):
                    raise ValueError(
                        f"state {key!r} of parameter {param_label(group.get('param_names'), index, i, p)} "
                        f"has shape {found} in the state dict, expected {shape}; the state dict does not "
                        "match these parameters"
                    )


def allocation_rule(group: dict) -> tuple[Optional[tuple], bool]:
    """What a group by cost was allocated with besides its budget: its row weights (sorted pairs)
    and whether the most rows were searched first."""
    weights = group.get(WEIGHTS_KEY)
    return None if weights is None else tuple(sorted(dict(weights).items())), bool(group.get(MOST_ROWS_KEY, False))


def _allocation_of(group: dict) -> Optional[tuple]:
    """The rule (allocation_rule) of a group that param_groups allocated by cost (it records its
    budget); None for a group of a fraction of its own, or one saved before groups recorded it."""
    return None if BUDGET_KEY not in group else allocation_rule(group)


def _allocation_text(rule: Optional[tuple]) -> str:
    if rule is None:
        return "a fraction of its own"
    weights, most_rows = rule
    return ("the most rows" if most_rows else "fractions by cost") + (f", rows weighted {dict(weights)}" if weights else "")


def warn_of_allocation_change(state_dict: dict[str, Any], param_groups: list[dict]) -> None:
    """Warn where a saved group was allocated by another rule than this optimizer's group: torch
    loads every saved group setting, so the checkpoint's fractions come back, not those this
    optimizer was built with (a run resumed with fraction_allocation="most_rows" from a checkpoint
    by cost, say). The budget is not compared: a FractionScheduler moves it like a learning rate."""
    pairs = [(index, _allocation_of(saved), _allocation_of(group))
             for index, (saved, group) in enumerate(zip(state_dict["param_groups"], param_groups))]
    changed = [(index, saved, own) for index, saved, own in pairs if saved is not None and saved != own]
    if not changed:
        return
    index, saved, own = changed[0]
    warnings.warn(
        f"load_state_dict: parameter group{'s' if len(changed) > 1 else ''} {', '.join(str(c[0]) for c in changed)} "
        f"of the state dict {'were' if len(changed) > 1 else 'was'} allocated by another rule than this optimizer's "
        f"(group {index}: {_allocation_text(saved)}, here {_allocation_text(own)}); torch loads every saved group "
        "setting, so the checkpoint's fractions are the ones that train on. To resume with this optimizer's, load "
        "dion3.convert_state_dict(state_dict, optimizer), which keeps the target's settings", stacklevel=3)


def expected_state_shapes(algorithm: str, param: Tensor, flatten: bool) -> dict[str, tuple[int, ...]]:
    """The state entries (and their shapes) the optimizer keeps for param under algorithm."""
    shape = tuple(param.shape)
    return {key: () if key == "step" else variance_shape(param, flatten) if key == "variance" else shape
            for key in STATE_ENTRIES[algorithm]}


def check_number(where, name, value) -> None:
    """A real number, not a bool (True is an int in Python) nor a string: TypeError naming its type."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__} {value!r}")


def check_flag(where, name, value) -> None:
    """True or False: a string such as "no" is truthy and would switch the setting on."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}")


def check_range(where, name, value, low, high, low_open=False, high_open=False) -> None:
    check_number(where, name, value)
    ok = not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{where}: {name} must lie in {lo}{low}, {high}{hi}, got {value!r}")
