"""dion3 in torchtitan (0.3): Dion3, NorMuon and Muon by name in a torchtitan job config.

torchtitan builds its optimizers in `OptimizersContainer` from a list of `ParamGroupConfig`s —
an FQN regex (first match wins), an optimizer name and that group's keyword arguments — and
creates one optimizer per name. `Dion3OptimizersContainer` is that container with three more
names, "Dion3", "NorMuon" and "Muon", and an optional fraction schedule. A job config selects it
through its `optimizer` field, which the trainer builds after parallelizing the model:

    from dion3.integrations.torchtitan import dion3_optimizer

    def llama3_debugmodel_dion3() -> Trainer.Config:      # a config_registry function
        config = llama3_debugmodel()
        config.optimizer = dion3_optimizer(config.model_spec.model, lr=0.02, adamw_lr=8e-4)
        return config

`param_group_configs` writes the groups by torchtitan's FQNs: norms and biases (AdamW without
weight decay), token embeddings, the output head and MoE router gates (AdamW), the row blocks
of a fused `wqkv` (its heads, `num_heads`), and everything else — attention and MLP matrices,
expert stacks [E, out, in] — in the orthogonal group. That group declares its 3-D parameters
expert stacks (stacked=True: each expert its own matrix), as torchtitan's are (its models have
no convolutions). A 1-D parameter that reaches the orthogonal group is refused by name when the
optimizer is built, never trained by accident.

The parameters are torchtitan's DTensors (FSDP2, TP, HSDP, EP): dion3 reads each one's own mesh
and placements (`distributed_mesh=None`). The container's flat, FQN-keyed state dict is what
torchtitan's checkpointer saves through DCP; dion3's state entries are DTensors with the
parameters' placements, so a checkpoint resumes on another layout. The fraction schedule's
position is saved beside them (`FRACTION_STEP_KEY`).

With `fraction_allocation="cost"` the container splits every Dion3/Dion2 group of whole matrices
into one group per global matrix shape, with fractions by orthogonalization cost
(dion3.optim.cost_fractions.cost_allocated_groups, the rule of `param_groups(fraction_allocation=
"cost")`); with "most_rows", the same split, with the most rows that the same modeled time buys
(`param_groups(fraction_allocation="most_rows")`). Groups split into blocks (the fused `wqkv`'s
heads) keep their one fraction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

try:
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dion3.integrations.torchtitan needs torchtitan 0.3: pip install 'dion3[torchtitan]'"
    ) from error

import torch
from torch import nn
from torch.optim import Optimizer

from ..algorithms import ALIASES, SELECTING_ALGORITHMS
from ..optim import Dion3, FractionScheduler, FractionWarmup, Muon, NorMuon
from ..optim.cost_fractions import cost_allocated_groups
from ..optim.param_groups import BY_COST

__all__ = [
    "Dion3OptimizersContainer", "FRACTION_STEP_KEY", "OPTIMIZERS", "dion3_optimizer",
    "fused_qkv_heads", "param_group_configs",
]

OPTIMIZERS = {"Dion3": Dion3, "NorMuon": NorMuon, "Muon": Muon}

# Keys torchtitan writes into every group it builds (its `implementation` setting): they name
# torch kernels that dion3 does not have, so its groups leave them out.
CONTAINER_KEYS = ("fused", "foreach")

# Where the fraction schedule's position sits in the container's flat state dict.
FRACTION_STEP_KEY = "dion3.fraction_schedule.last_step"

# FQN patterns of torchtitan's models (Llama 3, Qwen 3, DeepSeek V3, ...); searched with re.search.
NO_DECAY_PATTERN = r"(norm\.weight|\.bias)$"
ADAMW_PATTERN = r"(^|\.)(tok_embeddings|output|lm_head)\.|\.router\.gate\."
FUSED_QKV_PATTERN = r"\.wqkv\.weight$"

FRACTION_ALLOCATIONS = ("uniform", *BY_COST)  # Dion3OptimizersContainer.Config.fraction_allocation


def _check_allocation(where: str, fraction_allocation: str, fraction_schedule: Any) -> None:
    if fraction_allocation not in FRACTION_ALLOCATIONS:
        raise ValueError(f"{where}: fraction_allocation must be one of {FRACTION_ALLOCATIONS}, "
                         f"got {fraction_allocation!r}")
    if fraction_allocation in BY_COST and fraction_schedule is not None:
        raise ValueError(f"{where}: fraction_schedule cannot be combined with fraction_allocation="
                         f"{fraction_allocation!r}: a schedule sets one fraction on every Dion3 group, the "
                         "per-shape fractions by cost are fixed; drop one of them")


def _is_cost_split(group: dict) -> bool:
    """A Dion3-optimizer group that fraction_allocation 'cost' or 'most_rows' splits by shape: row-selecting
    (dion3, dion2) and of whole matrices (no num_heads, no split_sizes)."""
    algorithm = group.get("algorithm", "dion3")
    return (ALIASES.get(algorithm, algorithm) in SELECTING_ALGORITHMS
            and group.get("num_heads") is None and group.get("split_sizes") is None)


def _split_by_cost(group: dict, settings: dict[str, Any], pattern: str, allocation: str) -> list[dict]:
    """`group` split into one group per global matrix shape with fractions by cost (allocation
    "cost", or "most_rows": the most rows within the same modeled time), `params` and
    `param_names` split alike. settings: the group's settings with the constructor's beneath
    (fraction, flatten, orthogonalizer and ns_coefficients price the rows).

    The shapes are the parameters' global ones (a DTensor's `.shape`): stand-ins on the meta
    device with those shapes go through cost_allocated_groups, so no local shard is read and no
    collective runs, and every rank derives the same groups from the same model."""
    fraction = settings.get("fraction")
    if fraction is None:
        raise ValueError(f"Dion3OptimizersContainer: fraction_allocation={allocation!r} needs a fraction in the group of "
                         f"pattern {pattern!r} (its uniform fraction, whose orthogonalization FLOPs the "
                         "per-shape fractions share)")
    params, names = list(group["params"]), list(group["param_names"])
    stand_ins = [torch.empty(tuple(p.shape), device="meta") for p in params]
    index = {id(s): i for i, s in enumerate(stand_ins)}
    parts = cost_allocated_groups(dict(settings, params=stand_ins), fraction, most_rows=allocation == "most_rows")
    out = []
    for part in parts:
        members = [index[id(s)] for s in part["params"]]
        out.append(dict(group, params=[params[i] for i in members],
                        param_names=[names[i] for i in members], fraction=part["fraction"]))
    return out


def _builder(cls: type[Optimizer]) -> Callable[..., Optimizer]:
    def build(param_groups, **kwargs) -> Optimizer:
        groups = [{k: v for k, v in group.items() if k not in CONTAINER_KEYS} for group in param_groups]
        return cls(groups, **kwargs)

    build.__name__ = build.__qualname__ = f"build_{cls.__name__}"
    return build


class Dion3OptimizersContainer(OptimizersContainer):
    """torchtitan's OptimizersContainer that also knows "Dion3", "NorMuon" and "Muon".

    Config.fraction_schedule: a `dion3.FractionWarmup` (or None) applied to every Dion3 group;
    stepped after the optimizers in `step()` — the trainer calls `optimizers.step()` and then
    `lr_schedulers.step()`, so the fraction and the learning rate advance together — and saved
    in the state dict under FRACTION_STEP_KEY.
    Config.fraction_allocation: "uniform" (default) keeps each group's `fraction`; "cost" splits
    every "Dion3" group of row-selecting whole matrices (algorithm dion3/dion2, no num_heads or
    split_sizes) into one group per global matrix shape, with fractions by orthogonalization cost
    at the FLOPs of the group's fraction (`_split_by_cost`); "most_rows" splits alike, with the
    most rows within that modeled time. The split is a function of the
    model's global shapes and FQN order, so every rank and every reload builds the same groups,
    and each parameter's group settings (its fraction) are saved under its FQN. Under pipeline
    parallelism each model part shares its own budget. Refused with a fraction schedule.
    `optimizer_factory_kwargs_by_name={"Dion3": {...}}` passes constructor arguments that are
    not group settings (orthogonalizer, check_finite).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        fraction_schedule: Optional[FractionWarmup] = None
        """Dion3's row fraction as a function of the step (None: each group's `fraction`)."""

        fraction_allocation: str = "uniform"
        """"uniform": each group's `fraction`; "cost": per-shape fractions by orthogonalization cost;
        "most_rows": per-shape fractions with the most rows in the same modeled time."""

    def __init__(self, config: Config, *, model_parts) -> None:
        _check_allocation("Dion3OptimizersContainer", config.fraction_allocation, config.fraction_schedule)
        # read by _build_param_groups, which the base class calls while it builds the optimizers
        self._fraction_allocation = config.fraction_allocation
        self._dion3_factory_kwargs = dict(config.optimizer_factory_kwargs_by_name.get("Dion3", {}))
        self._cost_split_groups = 0
        super().__init__(config, model_parts=model_parts)
        if config.fraction_allocation in BY_COST and self._cost_split_groups == 0:
            raise ValueError(f"Dion3OptimizersContainer: fraction_allocation={config.fraction_allocation!r} but no "
                             "parameter group runs Dion3 or Dion2 on whole matrices (optimizer_name 'Dion3', no "
                             "num_heads/split_sizes)")
        self.fraction_schedulers: list[FractionScheduler] = []
        if config.fraction_schedule is not None:
            selecting = [o for o in self.optimizers
                         if any(g.get("algorithm") in SELECTING_ALGORITHMS for g in o.param_groups)]
            if not selecting:
                raise ValueError("Dion3OptimizersContainer: fraction_schedule is set but no parameter group "
                                 "runs Dion3 (optimizer_name 'Dion3')")
            self.fraction_schedulers = [FractionScheduler(o, config.fraction_schedule) for o in selecting]

    def _build_param_groups(self, model: nn.Module, param_group_configs: list[ParamGroupConfig],
                            impl_kwargs: dict[str, Any]) -> tuple[dict[str, list[dict]], dict[str, list[str]]]:
        groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        if self._fraction_allocation not in BY_COST or "Dion3" not in groups:
            return groups, patterns
        split_groups, split_patterns = [], []
        for group, pattern in zip(groups["Dion3"], patterns["Dion3"], strict=True):
            settings = {**self._dion3_factory_kwargs, **group}
            if not _is_cost_split(settings):
                split_groups.append(group)
                split_patterns.append(pattern)
                continue
            self._cost_split_groups += 1
            for part in _split_by_cost(group, settings, pattern, self._fraction_allocation):
                split_groups.append(part)
                split_patterns.append(f"{pattern} (fraction {part['fraction']:.4g} by cost"
                                      + (", most rows)" if self._fraction_allocation == "most_rows" else ")"))
        groups["Dion3"], patterns["Dion3"] = split_groups, split_patterns
        return groups, patterns

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        if name in OPTIMIZERS:
            return _builder(OPTIMIZERS[name])
        return OptimizersContainer._resolve_optimizer_factory(name)

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        super().step(closure)
        for scheduler in self.fraction_schedulers:
            scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.fraction_schedulers:
            state[FRACTION_STEP_KEY] = self.fraction_schedulers[0].last_step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != FRACTION_STEP_KEY})
        if not self.fraction_schedulers:
            return
        if FRACTION_STEP_KEY not in state_dict:
            raise ValueError(f"Dion3OptimizersContainer: the checkpoint has no {FRACTION_STEP_KEY!r} "
                             "(it was saved without a fraction schedule); the schedule cannot resume")
        for scheduler in self.fraction_schedulers:
            scheduler.load_state_dict({"last_step": int(state_dict[FRACTION_STEP_KEY]), "groups": scheduler.groups})


def fused_qkv_heads(model_config: Any) -> Optional[int]:
    """The number of head_dim-row blocks of a fused `wqkv` weight (n_heads + 2·n_kv_heads), read
    from a torchtitan decoder config; None when its attention has no fused QKV projection.

    torchtitan's FusedQKVLinear stacks, for each KV group, its query heads, then its key head,
    then its value head, head_dim rows each: every block is one head, so `num_heads` set to this
    count gives each head its own selection and orthogonalization — what separate per-head
    weights would get, and never a mix of query, key and value rows."""
    attention = getattr(model_config, "first_attention", None)
    qkv = getattr(attention, "qkv_linear", None)
    if qkv is None or not hasattr(qkv, "wqkv"):
        return None
    return qkv.n_heads + 2 * qkv.n_kv_heads


def param_group_configs(
    algorithm: str = "Dion3",
    lr: float = 0.02,
    adamw_lr: float = 8e-4,
    weight_decay: float = 0.1,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    qkv_heads: Optional[int] = None,
    **options: Any,
) -> list[ParamGroupConfig]:
    """torchtitan ParamGroupConfigs for `Dion3OptimizersContainer`, in match order:

    1. norm gains and biases → AdamW (adamw_lr, no weight decay);
    2. `tok_embeddings`, the output head (`output` / `lm_head`), MoE router gates → AdamW;
    3. with `qkv_heads`: fused `wqkv` weights → `algorithm` with num_heads=qkv_heads;
    4. everything else (attention and MLP matrices, expert stacks) → `algorithm`, with
       stacked=True: a 3-D parameter is a stack of experts [E, out, in], one matrix each.

    algorithm: "Dion3", "NorMuon" or "Muon". options: further settings of the orthogonal groups
    (fraction, selection_scope, mu, nesterov, adjust_lr, ...). Every pattern must match some
    parameter (torchtitan refuses one that matches none), so give `qkv_heads` only for a model
    with a fused `wqkv` (see `fused_qkv_heads`)."""
    if algorithm not in OPTIMIZERS:
        raise ValueError(f"algorithm must be one of {sorted(OPTIMIZERS)}, got {algorithm!r}")
    adamw = {"lr": adamw_lr, "betas": tuple(adamw_betas), "eps": 1e-8}
    matrix = {"lr": lr, "weight_decay": weight_decay, "stacked": True, **options}
    groups = [
        ParamGroupConfig(pattern=NO_DECAY_PATTERN, optimizer_name="AdamW",
                         optimizer_kwargs={**adamw, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=ADAMW_PATTERN, optimizer_name="AdamW",
                         optimizer_kwargs={**adamw, "weight_decay": weight_decay}),
    ]
    if qkv_heads is not None:
        groups.append(ParamGroupConfig(pattern=FUSED_QKV_PATTERN, optimizer_name=algorithm,
                                       optimizer_kwargs={**matrix, "num_heads": qkv_heads}))
    groups.append(ParamGroupConfig(pattern=r".*", optimizer_name=algorithm, optimizer_kwargs=matrix))
    return groups


def dion3_optimizer(
    model_config: Any = None,
    algorithm: str = "Dion3",
    fraction_schedule: Optional[FractionWarmup] = None,
    implementation: str = "foreach",
    fraction_allocation: str = "uniform",
    **settings: Any,
) -> Dion3OptimizersContainer.Config:
    """The `optimizer` field of a torchtitan Trainer.Config that trains with dion3.

    model_config: the model's config (`config.model_spec.model`), read for a fused QKV weight
    (`fused_qkv_heads`); None: no per-head blocks. implementation: torchtitan's setting for its
    AdamW groups ("foreach" runs on CPU and GPU; "fused" is CUDA-only).
    fraction_allocation: "uniform" (default): `fraction` on every orthogonal matrix. "cost": the
    orthogonal group splits, when the container is built, into one group per global matrix shape
    with fractions by orthogonalization cost at the FLOPs of `fraction` on every matrix (as
    `dion3.param_groups(..., fraction_allocation="cost")`); the fused `wqkv` group (per-head
    blocks) keeps `fraction`. "most_rows": the same split with the most rows that modeled time
    buys (as `fraction_allocation="most_rows"`; opt-in, measured at batch 128 in the frontier
    README). Either needs algorithm "Dion3" and `fraction`; no fraction_schedule.
    settings: as `param_group_configs` (lr, adamw_lr, weight_decay, fraction, selection_scope, ...)."""
    _check_allocation("dion3_optimizer", fraction_allocation, fraction_schedule)
    if fraction_allocation in BY_COST:
        if algorithm != "Dion3":
            raise ValueError(f"dion3_optimizer: fraction_allocation={fraction_allocation!r} needs algorithm='Dion3' "
                             f"(row selection), got algorithm={algorithm!r}")
        if settings.get("fraction") is None:
            raise ValueError(f"dion3_optimizer: fraction_allocation={fraction_allocation!r} needs fraction=..., the "
                             "uniform fraction whose orthogonalization FLOPs the per-shape fractions share")
    heads = fused_qkv_heads(model_config) if model_config is not None else None
    return Dion3OptimizersContainer.Config(
        param_groups=param_group_configs(algorithm, qkv_heads=heads, **settings),
        implementation=implementation,
        fraction_schedule=fraction_schedule,
        fraction_allocation=fraction_allocation,
    )
