"""`param_groups`: split a model's parameters into the groups Dion3/Muon/NorMuon expect.

The optimizer cannot tell an embedding table or an LM head from a hidden weight matrix, and
orthogonalizing those hurts, so the split is done here from the model's structure:

* hidden weight matrices (≥ 2-D, outside embeddings and the LM head) → the orthogonal algorithm of
  the optimizer the groups are given to (Muon, NorMuon or Dion3), unless `algorithm` names one;
* embeddings (`nn.Embedding` weights) → AdamW with `embed_lr`;
* the LM head, which the caller must name → AdamW with `head_lr`;
* everything else (norm gains, biases, other 0-/1-D parameters) → AdamW with `scalar_lr` and no
  weight decay.

The head is never guessed: a wrong guess would silently orthogonalize the output layer.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from torch import nn

from .validation import ALIASES, MATRIX_ALGORITHMS, SCALAR_ALGORITHMS
from .cost_fractions import cost_allocated_groups

FRACTION_ALLOCATIONS = ("uniform", "cost")  # param_groups(fraction_allocation=...)

# AdamW learning rates for the non-matrix groups, tuned on the `cpu-tiny` preset of
# `dion3 compare` (docs/training.md). The head gets a lower lr than the embedding: its gradient is
# dense (every row, every step) while an embedding row only moves when its token appears.
HEAD_LR = 0.004
EMBED_LR = 0.02
SCALAR_LR = 0.02


def param_groups(
    model: nn.Module,
    lm_head: Optional[Union[str, nn.Module]] = None,
    algorithm: Optional[str] = None,
    lr: Optional[float] = None,
    head_lr: float = HEAD_LR,
    embed_lr: float = EMBED_LR,
    scalar_lr: float = SCALAR_LR,
    scalar_algorithm: str = "adamw",
    fraction_allocation: str = "uniform",
    **options: Any,
) -> list[dict[str, Any]]:
    """Parameter groups for `Dion3`, `Muon` or `NorMuon`.

    lm_head: the output layer, as a module or the name of a module or parameter of `model`
        (e.g. "lm_head"). Required. For a head tied to the embedding, name it all the same.
    algorithm: for the hidden matrices. None (the default) writes no algorithm into their group,
        so the optimizer class decides: `Muon(param_groups(...))` runs Muon, `NorMuon(...)`
        NorMuon, `Dion3(...)` Dion3. A name — "dion3", "dion2", "muon", "normuon", or
        "adamw"/"lion" to train them with a scalar optimizer (the baseline) — is written into the
        group and overrides the class, as any group's algorithm does. No warning is given when it
        differs from the class: a group's algorithm is only there when the caller wrote it, and
        mixing algorithms across groups is a supported use (docs/training.md).
    lr: learning rate of the matrix group; None keeps the optimizer's default.
    head_lr, embed_lr, scalar_lr: learning rates of the AdamW (or Lion) groups.
    fraction_allocation: Dion3's fractions. "uniform" (default): one matrix group, `fraction` (or
        the optimizer's default) on every matrix. "cost": one matrix group per matrix shape, each
        with its own fraction, chosen by orthogonalization cost at the FLOPs of `fraction` on every
        matrix (dion3.optim.cost_fractions.cost_allocated_fractions): short and narrow matrices (k/v
        projections) keep more of their rows, wide MLP matrices fewer. Needs `fraction`, a Dion3 or
        Dion2 group (or `algorithm` None with the Dion3 class) and whole matrices (no num_heads or
        split_sizes). The fractions are fixed: a FractionScheduler sets one fraction on every
        group it schedules, so it refuses these groups unless `groups=` names them.
    options: further settings of the matrix group (fraction, mu, weight_decay, ...).

    Every trainable parameter lands in exactly one group; empty groups are left out.
    """
    if algorithm is not None:
        algorithm = ALIASES.get(algorithm, algorithm)
    if algorithm is not None and algorithm not in MATRIX_ALGORITHMS + SCALAR_ALGORITHMS:
        raise ValueError(
            f"algorithm must be one of {MATRIX_ALGORITHMS + SCALAR_ALGORITHMS}, got {algorithm!r}"
        )
    if scalar_algorithm not in SCALAR_ALGORITHMS:
        raise ValueError(f"scalar_algorithm must be one of {SCALAR_ALGORITHMS}, got {scalar_algorithm!r}")
    if fraction_allocation not in FRACTION_ALLOCATIONS:
        raise ValueError(f"param_groups: fraction_allocation must be one of {FRACTION_ALLOCATIONS}, got {fraction_allocation!r}")
    if fraction_allocation == "cost":
        if options.get("fraction") is None:
            raise ValueError("param_groups: fraction_allocation='cost' needs fraction=..., the uniform fraction "
                             "whose orthogonalization FLOPs the per-shape fractions share")
        if algorithm is not None and algorithm not in ("dion3", "dion2"):
            raise ValueError(f"param_groups: fraction_allocation='cost' needs a row-selecting algorithm (dion3, "
                             f"dion2), got algorithm={algorithm!r}")
    head_ids = _head_parameter_ids(model, lm_head)
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    buckets: dict[str, list[nn.Parameter]] = {"matrix": [], "head": [], "embed": [], "scalar": []}
    seen: set[int] = set()
    for param in model.parameters():  # shared (tied) parameters are listed once
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in head_ids:
            kind = "head"
        elif id(param) in embed_ids:
            kind = "embed"
        elif param.dim() >= 2:
            kind = "matrix"
        else:
            kind = "scalar"
        buckets[kind].append(param)

    matrix_group = dict(options, params=buckets["matrix"])
    if algorithm is not None:
        matrix_group["algorithm"] = algorithm
    if lr is not None:
        matrix_group["lr"] = lr
    matrix_groups = [matrix_group]
    if fraction_allocation == "cost" and matrix_group["params"]:
        matrix_groups = cost_allocated_groups(matrix_group, options["fraction"])
    groups = [
        *matrix_groups,
        {"params": buckets["head"], "algorithm": scalar_algorithm, "lr": head_lr},
        {"params": buckets["embed"], "algorithm": scalar_algorithm, "lr": embed_lr},
        # No weight decay on norm gains and biases: decaying a gain towards 0 only fights the norm.
        {"params": buckets["scalar"], "algorithm": scalar_algorithm, "lr": scalar_lr, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def _head_parameter_ids(model: nn.Module, lm_head: Optional[Union[str, nn.Module]]) -> set[int]:
    if lm_head is None:
        raise ValueError(
            "param_groups: lm_head is required — name the output layer (e.g. lm_head='lm_head') so "
            "it is trained with AdamW instead of being orthogonalized; it is never guessed"
        )
    if isinstance(lm_head, nn.Module):
        if not any(module is lm_head for module in model.modules()):
            raise ValueError("param_groups: the lm_head module given is not part of the model")
        params = list(lm_head.parameters())
    elif isinstance(lm_head, str):
        modules = dict(model.named_modules())
        named = dict(model.named_parameters())
        if lm_head in modules and lm_head != "":
            params = list(modules[lm_head].parameters())
        elif lm_head in named:
            params = [named[lm_head]]
        else:
            candidates = [n for n, m in modules.items() if isinstance(m, nn.Linear)][-3:]
            raise ValueError(
                f"param_groups: lm_head {lm_head!r} names no module or parameter of the model "
                f"(last linear layers: {candidates})"
            )
    else:
        raise ValueError(f"param_groups: lm_head must be a module name or an nn.Module, got {type(lm_head).__name__}")
    if not params:
        raise ValueError(f"param_groups: lm_head {lm_head!r} has no parameters")
    return {id(p) for p in params}
