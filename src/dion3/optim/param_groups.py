"""`param_groups`: split a model's parameters into the groups Dion3/Muon/NorMuon expect.

The optimizer cannot tell an embedding table or an LM head from a hidden weight matrix, and
orthogonalizing those hurts, so the split is done here from the model's structure:

* hidden weight matrices (≥ 2-D, outside embeddings and the LM head) → the orthogonal algorithm of
  the optimizer the groups are given to (Muon, NorMuon or Dion3), unless `algorithm` names one.
  A convolution's kernel (out, in, k...) is one out × in·k matrix (a group of its own with
  flatten=True); any other 3-D parameter is a stack of matrices [E, rows, cols] (expert weights),
  each orthogonalized on its own (stacked=True): the shape alone cannot tell the two apart, the
  module can;
* a linear map stored as its transpose, [in, out] (Hugging Face's `Conv1D`, GPT-2 and its kin) →
  the same algorithm in a group of its own whose `adjust_lr` is the transposed one
  ("spectral_norm_transposed", √(out/in) as for the map stored [out, in]), so its lr is the one
  the same map gets from an `nn.Linear`; the rows NorMuon normalizes and Dion3 selects are still
  the stored rows, the map's inputs;
* embeddings (`nn.Embedding` weights) → AdamW with `embed_lr`;
* the LM head, which the caller must name → AdamW with `head_lr`;
* everything else (norm gains, biases, other 0-/1-D parameters) → AdamW with `scalar_lr` and no
  weight decay.

The head is never guessed: a wrong guess would silently orthogonalize the output layer, so a
model without `lm_head` named must not look as if it had one. Every group carries its
parameters' names (`param_names`, kept by torch.optim): errors name the parameter. A model
compiled with torch.compile gives the names of the model it wraps (without `_orig_mod.`, as
torch.distributed.checkpoint's FQNs), so its groups are those of the plain model.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from torch import nn

from .validation import ALIASES, MATRIX_ALGORITHMS, MATRIX_SETTINGS, SCALAR_ALGORITHMS
from .cost_fractions import cost_allocated_groups

FRACTION_ALLOCATIONS = ("uniform", "cost", "most_rows")  # param_groups(fraction_allocation=...)
BY_COST = ("cost", "most_rows")  # the allocations that spend `fraction` as a budget of modeled time

# Modules whose ≥ 3-D weights are convolution kernels (out, in, k...): one matrix each, flattened.
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# adjust_lr of a linear map stored [in, out], from the one asked for the others (the optimizers'
# default, spectral_norm, when none is): the spectral scale turns over, the others are symmetric
TRANSPOSED_ADJUST_LR = {"spectral_norm": "spectral_norm_transposed", "spectral_norm_transposed": "spectral_norm",
                        "rms_norm": "rms_norm", None: None}
# The attribute under which torch.compile's wrapper (OptimizedModule) holds the compiled module.
COMPILE_WRAPPER = "_orig_mod"

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
    fraction_weights: Optional[Mapping[str, float]] = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Parameter groups for `Dion3`, `Muon` or `NorMuon`.

    lm_head: the output layer, as a module or the name of a module or parameter of `model`
        (e.g. "lm_head"); for a head tied to the embedding, name it all the same. None (the
        default): the model has no LM head; a linear layer that projects onto an embedding's
        vocabulary is then refused by name (lm_head=False keeps it a matrix).
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
        with its own fraction, chosen so that the step's modeled H200 time (dion3.ortho.cost.
        modeled_seconds) stays within that of `fraction` on every matrix
        (dion3.optim.cost_fractions.cost_allocated_fractions): short and narrow matrices (k/v
        projections) keep more of their rows, wide MLP matrices fewer. Needs `fraction`, a Dion3 or
        Dion2 group (or `algorithm` None with the Dion3 class) and whole matrices (no num_heads or
        split_sizes). Each of these groups records the budget `fraction` ("fraction_budget") and
        the `fraction_weights` given: a FractionScheduler over them schedules the budget, and
        every group's fraction follows the allocation of the scheduled budget (budget_schedule).
        "most_rows": as "cost", but first the allocation that selects the most rows within the
        budget, searched exactly (cost_allocated_fractions' most_rows): the tall MLP matrices,
        whose rows past their column count are cheap, get most of their rows and the square ones
        few (½'s budget on Llama-8B: 0.64 of the rows against "cost"'s 0.42). A rule variant of
        the frontier study, not yet measured against "cost" (benchmarks/results/frontier).
    fraction_weights: with fraction_allocation "cost" or "most_rows", {part of a parameter name: weight}: the
        matrices whose names contain that part count their rows `weight` times when the budget
        is handed out (e.g. {"mlp": 2.0} moves rows to the MLP matrices within the same modeled
        time; cost_allocated_fractions). Matrices of one shape need one weight.
    options: further settings of the matrix group (fraction, mu, weight_decay, ...). Under
        algorithm "adamw"/"lion" the settings only the orthogonal rules read (fraction, mu, flatten,
        ...) are left out of the group: it does not carry a label it does not follow.

    Every trainable parameter lands in exactly one group; empty groups are left out. Convolution
    kernels form a group of their own with flatten=True (unless `flatten` is among the options);
    the matrix group holding other 3-D parameters gets stacked=True (docs/training.md,
    "Convolutions and expert stacks").
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
    if fraction_weights is not None and fraction_allocation not in BY_COST:
        raise ValueError("param_groups: fraction_weights weigh the rows of fraction_allocation='cost' or "
                         f"'most_rows'; got fraction_allocation={fraction_allocation!r}")
    if fraction_allocation in BY_COST:
        if options.get("fraction") is None:
            raise ValueError(f"param_groups: fraction_allocation={fraction_allocation!r} needs fraction=..., the "
                             "uniform fraction whose modeled step time the per-shape fractions share")
        if algorithm is not None and algorithm not in ("dion3", "dion2"):
            raise ValueError(f"param_groups: fraction_allocation={fraction_allocation!r} needs a row-selecting "
                             f"algorithm (dion3, dion2), got algorithm={algorithm!r}")
    head_ids = _head_parameter_ids(model, lm_head)
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    scalar_run = algorithm in SCALAR_ALGORITHMS  # AdamW/Lion on the matrices: any shape, no flattening
    # kernels of convolutions (their parametrizations' tensors included) and linear maps stored
    # [in, out] get groups of their own, under an orthogonal rule on unflattened matrices only (with
    # flatten among the options every matrix is flattened already)
    by_module = not (scalar_run or options.get("flatten"))
    conv_ids = {id(p) for m in model.modules() if isinstance(m, CONVOLUTIONS) for p in m.parameters()
                if p.dim() >= 3} if by_module else set()
    transposed_ids = {id(m.weight) for m in model.modules() if stores_transposed(m)} if by_module else set()

    buckets: dict[str, list[tuple[str, nn.Parameter]]] = {
        "matrix": [], "transposed": [], "conv": [], "head": [], "embed": [], "scalar": []}
    for name, param in model.named_parameters():  # shared (tied) parameters are listed once, by their first name
        if not param.requires_grad:
            continue
        if id(param) in head_ids:
            kind = "head"
        elif id(param) in embed_ids:
            kind = "embed"
        elif id(param) in conv_ids:
            kind = "conv"
        elif id(param) in transposed_ids:
            kind = "transposed"
        elif param.dim() >= 2:
            kind = "matrix"
        else:
            kind = "scalar"
        buckets[kind].append((plain_name(name), param))

    def group(members, **settings) -> dict:
        # the names go with the tensors: errors name the parameter (torch keeps "param_names")
        return dict(settings, params=[p for _, p in members], param_names=[n for n, _ in members])

    settings = dict(options)
    if scalar_run:  # a label the group would not follow (fraction=0.25 on AdamW) is left out
        settings = {key: value for key, value in options.items() if key not in MATRIX_SETTINGS}
    elif (any(p.dim() == 3 for _, p in buckets["matrix"]) and not settings.get("flatten")
          and "stacked" not in settings):
        settings["stacked"] = True  # not a convolution's kernel: a stack of matrices (expert weights)
    if algorithm is not None:
        settings["algorithm"] = algorithm
    if lr is not None:
        settings["lr"] = lr
    conv_settings = {key: value for key, value in settings.items() if key != "stacked"}
    conv_settings["flatten"] = True  # one out × in·k matrix per kernel
    transposed_settings = dict(settings, adjust_lr=TRANSPOSED_ADJUST_LR[settings.get("adjust_lr", "spectral_norm")])
    matrix_groups = [group(buckets["matrix"], **settings), group(buckets["transposed"], **transposed_settings),
                     group(buckets["conv"], **conv_settings)]
    matrix_groups = [g for g in matrix_groups if g["params"]]
    if fraction_allocation in BY_COST and matrix_groups:
        # one budget over the kernels and the other matrices: one fraction per shape
        try:
            matrix_groups = cost_allocated_groups(matrix_groups, options["fraction"], weights=fraction_weights,
                                                  most_rows=fraction_allocation == "most_rows")
        except ValueError as error:  # the fraction, the weights: said as param_groups' other errors are
            raise ValueError(f"param_groups: {error}") from None
    groups = [
        *matrix_groups,
        group(buckets["head"], algorithm=scalar_algorithm, lr=head_lr),
        group(buckets["embed"], algorithm=scalar_algorithm, lr=embed_lr),
        # No weight decay on norm gains and biases: decaying a gain towards 0 only fights the norm.
        group(buckets["scalar"], algorithm=scalar_algorithm, lr=scalar_lr, weight_decay=0.0),
    ]
    return [g for g in groups if g["params"]]


def stores_transposed(module: nn.Module) -> bool:
    """A linear map whose weight is stored [in, out] and applied as x @ W: Hugging Face's Conv1D
    (transformers.pytorch_utils; GPT-2 and its kin), recognized by its name and its `nf` output
    width, so that transformers need not be imported."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, nn.Parameter) and weight.dim() == 2
            and weight.shape[1] == getattr(module, "nf", None))


def plain_name(name: str) -> str:
    """A parameter's or module's name in the model that torch.compile wrapped: its wrapper
    (OptimizedModule, at the root or at a compiled submodule) adds `_orig_mod.`, which
    torch.distributed.checkpoint's FQNs leave out as well."""
    return ".".join(part for part in name.split(".") if part != COMPILE_WRAPPER)


def _head_parameter_ids(model: nn.Module, lm_head: Optional[Union[str, nn.Module, bool]]) -> set[int]:
    if lm_head is None or lm_head is False:
        if lm_head is None:
            _refuse_an_unnamed_head(model)
        return set()
    if isinstance(lm_head, nn.Module):
        if not any(module is lm_head for module in model.modules()):
            raise ValueError("param_groups: the lm_head module given is not part of the model")
        params = list(lm_head.parameters())
    elif isinstance(lm_head, str):
        modules = {plain_name(n): m for n, m in model.named_modules()}
        named = {plain_name(n): p for n, p in model.named_parameters()}
        key = plain_name(lm_head)
        if key in modules and key != "":
            params = list(modules[key].parameters())
        elif key in named:
            params = [named[key]]
        else:
            candidates = [n for n, m in modules.items() if isinstance(m, nn.Linear)][-3:]
            raise ValueError(
                f"param_groups: lm_head {lm_head!r} names no module or parameter of the model "
                f"(last linear layers: {candidates})"
            )
    else:
        raise TypeError(f"param_groups: lm_head must be a module name, an nn.Module, None (no head) or False, "
                        f"got {type(lm_head).__name__}")
    if not params:
        raise ValueError(f"param_groups: lm_head {lm_head!r} has no parameters")
    return {id(p) for p in params}


def _refuse_an_unnamed_head(model: nn.Module) -> None:
    """lm_head=None means the model has no LM head. A linear layer that projects onto the vocabulary
    of one of its embeddings (out_features = num_embeddings, untied) looks like one: refused by
    name rather than orthogonalized silently (lm_head=False keeps it a matrix on purpose)."""
    vocabularies = {m.num_embeddings: plain_name(n) for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in ((plain_name(n), m) for n, m in model.named_modules()):
        if (isinstance(module, nn.Linear) and module.out_features in vocabularies
                and id(module.weight) not in embedded and module.out_features > module.in_features):
            raise ValueError(
                f"param_groups: lm_head=None means the model has no LM head, but {name!r} projects "
                f"{module.in_features} features onto the {module.out_features}-token vocabulary of embedding "
                f"{vocabularies[module.out_features]!r}: name it (lm_head={name!r}) so that AdamW trains it, or "
                "pass lm_head=False to orthogonalize it as a matrix"
            )
