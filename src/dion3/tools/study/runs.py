"""The study's runs: the models, the Run record (its key names a finished run in results.jsonl),
and the plans that turn the command line's grids (plan_runs) or an earlier study's best settings
(plan_best_runs) into runs."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from ...optim.cost_fractions import COST_RULE
from ...optim.param_groups import BY_COST, FRACTION_ALLOCATIONS
from ...ortho.coefficients import SCHEDULES
from ...rules import ROW_SCORES
from ..models import REGISTRY
from ..setting_names import Dion3Setting
from .flags import (
    floats, fraction_weights_spec, full_every_steps, ints, learning_rates, momenta, momentum_dtypes, ns_schedules,
    unselected_decays, warmup_steps,
)


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "gpt" (dion3.tools.train.model.GPT) or "llama-hf"
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    batch_size: int
    kv_heads: int = 0  # llama-hf only
    mlp_width: int = 0  # llama-hf only


def study_model(name: str, seq_len: int, batch_size: int) -> ModelSpec:
    """The study's model `name`: its shape is that of the name in dion3.tools.models (one registry
    of model names for every command), its context and batch the study's."""
    model = REGISTRY[name]
    if model.family == "gpt":  # dion3.tools.train.model.GPT: MLP 4 × d_model, no GQA
        return ModelSpec("gpt", seq_len, model.n_layer, model.n_head, model.d_model, batch_size)
    return ModelSpec("llama-hf", seq_len, model.n_layer, model.n_head, model.d_model, batch_size,
                     kv_heads=model.kv_heads, mlp_width=model.mlp_width)


# The models the study trains (study=True in dion3.tools.models): name → (context, batch)
MODELS = {name: study_model(name, seq_len, batch_size) for name, (seq_len, batch_size) in {
    "gpt-tiny": (32, 4),
    "gpt-25m": (1024, 16),
    "gpt-120m": (1024, 16),
    "llama-hf": (512, 16),
    "llama-384": (512, 32),
    # The scale trend: llama-hf's family (GQA, head width 64, SwiGLU) at about 110 M and 340 M matrix
    # parameters in the blocks (llama-hf: 25 M), with llama-hf's 16 × 512 tokens per step.
    "llama-hf-110m": (512, 16),
    "llama-hf-350m": (512, 16),
    # held out: the batch-128 settings of llama-384, verbatim, on a shape they were not tuned on
    "llama-512-6l": (512, 128),
}.items()}
# family → (lr flag default, μ flag default or None where the family has no μ)
FAMILIES = {"adamw": ("0.003", None), "muon": ("0.02", "0.95"), "normuon": ("0.02", "0.6,0.8"), "dion3": ("0.04,0.08", "0.3,0.6")}
DEFAULT_NS = "polar_express"  # the optimizers' Newton–Schulz schedule (ns_coefficients)


@dataclass(frozen=True)
class Run:
    model: str
    optimizer: str  # "adamw", "muon", "normuon" or "dion3"
    lr: float
    mu: float
    fraction: Optional[float]  # dion3 only
    fraction_warmup: int  # dion3 only: steps of the linear warm-up from 1 (0: fixed fraction; by cost: the budget's)
    horizon: int
    seed: int
    batch_size: int
    lr_warmup: int
    cooldown: float
    eval_batches: int
    data: Optional[tuple[str, ...]]
    read_once: bool = True  # disjoint windows (data.read_once_batches); False: random, may repeat
    repeat: int = 0  # the same run again (--repeats: GPU runs are not bit-reproducible; stress tests)
    captured: bool = False  # optimizer steps through CapturedStep (CUDA only)
    fraction_allocation: str = "uniform"  # dion3 only: "uniform" or "cost" (per matrix shape, trainer.RunSpec)
    compiled: bool = False  # forward and backward through torch.compile (trainer.train)
    momentum_dtype: Optional[str] = None  # Muon/NorMuon/Dion3: the matrix momentum's dtype; None: float32
    # fractions by cost: the rule's name, COST_RULE ("time": modeled step time, since 2026-12-03;
    # from 2026-12-06 priced on the cheapest way to at least k rows, which moved no study model's
    # allocation but the smoke model gpt-tiny's); None in the records of earlier runs, which
    # allocated by executed FLOPs (and in every uniform run)
    cost_rule: Optional[str] = None
    row_score: str = "l1"  # dion3 only: the selection score, dion3.rules.ROW_SCORES
    # dion3 by cost only: the rows' weights by parameter name, "part=w,part=w" (fraction_weights_spec;
    # param_groups' fraction_weights); None: every matrix's rows count once
    fraction_weights: Optional[str] = None
    # Muon/NorMuon/Dion3: the Newton–Schulz schedule, a name of dion3.ortho.SCHEDULES (e.g.
    # polar_express_4, 4 steps); AdamW runs keep the default
    ns_coefficients: str = DEFAULT_NS
    # dion3 only: the decay of the momentum rows a step does not select (Dion3's unselected_decay;
    # 1, the rule, in every record from before the option)
    unselected_decay: float = 1.0
    full_every: int = 0  # dion3 only: every row on every full_every-th step (PeriodicFull); 0: never

    @property
    def setting(self) -> tuple:
        """What the seeds of one setting share (the summary averages over seeds); the batch size
        last, so that a larger batch of the same optimizer is its own setting."""
        return (self.model, self.horizon, self.optimizer, self.fraction, self.fraction_warmup, self.lr, self.mu,
                self.fraction_allocation, self.compiled, self.momentum_dtype, self.cost_rule, self.row_score,
                self.fraction_weights, self.ns_coefficients, self.unselected_decay, self.full_every, self.batch_size)

    @property
    def key(self) -> str:
        fields = dataclasses.asdict(self)
        # the keys of runs from before these fields stay valid
        if fields["fraction_allocation"] == "uniform":
            del fields["fraction_allocation"]
        if not fields["compiled"]:
            del fields["compiled"]
        if fields["momentum_dtype"] is None:
            del fields["momentum_dtype"]
        if fields["cost_rule"] is None:
            del fields["cost_rule"]
        if fields["row_score"] == "l1":
            del fields["row_score"]
        if fields["fraction_weights"] is None:
            del fields["fraction_weights"]
        if fields["ns_coefficients"] == DEFAULT_NS:
            del fields["ns_coefficients"]
        if fields["unselected_decay"] == 1.0:
            del fields["unselected_decay"]
        if not fields["full_every"]:
            del fields["full_every"]
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        if self.optimizer != "dion3":
            name = self.optimizer
        else:  # the setting as `dion3 compare` and `dion3 bench` name it, then what the study varies besides
            name = Dion3Setting(self.fraction, self.fraction_allocation, self.fraction_warmup).name
            name = (name + ("-flops" if self.fraction_allocation in BY_COST and not self.cost_rule else "")
                    + (f"-{self.row_score}" if self.row_score != "l1" else "")
                    + (f"-weights[{self.fraction_weights}]" if self.fraction_weights else "")
                    + (f"-unselected{self.unselected_decay:g}" if self.unselected_decay != 1.0 else "")
                    + (f"-full-every{self.full_every}" if self.full_every else ""))
        if self.momentum_dtype:
            name += f"-momentum-{self.momentum_dtype}"
        if self.ns_coefficients != DEFAULT_NS:
            name += f"-{self.ns_coefficients}"
        return f"{name} lr={self.lr:g} mu={self.mu:g} h={self.horizon} seed={self.seed}" + (f" #{self.repeat}" if self.repeat else "")


def check_schedule(args: argparse.Namespace) -> None:
    """The settings every run shares, refused before any run starts rather than inside one."""
    if args.batch_size is not None and args.batch_size < 1:
        raise SystemExit(f"quality_study: --batch-size must be ≥ 1, got {args.batch_size}")
    if args.lr_warmup < 0:
        raise SystemExit(f"quality_study: --lr-warmup must be ≥ 0 steps, got {args.lr_warmup}")
    if not 0.0 <= args.cooldown <= 1.0:
        raise SystemExit(f"quality_study: --cooldown is a share of the steps in [0, 1], got {args.cooldown}")


def selection_label(row_score: str, fraction_weights: Optional[str]) -> str:
    """What a Dion3 setting changes of the selection rule, for tables and plots: "" for the rule
    itself (L1 scores, every matrix's rows counted once)."""
    return ((f", rows by {row_score.upper()}" if row_score != "l1" else "")
            + (f", rows weighted {fraction_weights}" if fraction_weights else ""))


def rule_label(unselected_decay: float, full_every: int) -> str:
    """What a Dion3 setting changes of the update rule, for tables and plots: "" for the rule
    itself (the unselected rows keep accumulating; the fraction on every step)."""
    return ((f", unselected rows ×{unselected_decay:g} a step" if unselected_decay != 1.0 else "")
            + (f", all rows every {full_every} steps" if full_every else ""))


def schedule_label(ns_coefficients: str) -> str:
    """What a setting changes of the Newton–Schulz schedule, for tables and plots: "" for the
    default; ", 4 NS steps" for a Polar Express construction of another length; else the name."""
    if ns_coefficients == DEFAULT_NS:
        return ""
    steps = len(SCHEDULES[ns_coefficients])
    return f", {steps} NS steps" if ns_coefficients.startswith(DEFAULT_NS) else f", NS {ns_coefficients} ({steps} steps)"


def with_ns_schedules(runs: Sequence[Run], names: Sequence[str]) -> list[Run]:
    """Each run once per Newton–Schulz schedule; AdamW runs once (it orthogonalizes nothing)."""
    out = []
    for run in runs:
        for name in (names if run.optimizer != "adamw" else [DEFAULT_NS]):
            out.append(dataclasses.replace(run, ns_coefficients=name))
    return list(dict.fromkeys(out))


def parse_fraction_weights(spec: Optional[str]) -> Optional[tuple[tuple[str, float], ...]]:
    """The Run field → trainer.RunSpec's fraction_weights."""
    if spec is None:
        return None
    return tuple((name, float(value)) for name, _, value in (item.partition("=") for item in spec.split(",")))


def with_momentum_dtypes(runs: Sequence[Run], dtypes: Sequence[Optional[str]]) -> list[Run]:
    """Each run once per momentum dtype; AdamW runs once (it has no matrix momentum)."""
    out = []
    for run in runs:
        for dtype in (dtypes if run.optimizer != "adamw" else [None]):
            out.append(dataclasses.replace(run, momentum_dtype=dtype))
    return list(dict.fromkeys(out))


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Every run of the study, short horizons first (a partial study then covers every setting)."""
    horizons, seeds = sorted(set(ints(args.horizons, "--horizons"))), ints(args.seeds, "--seeds")
    if any(h < 1 for h in horizons):
        raise SystemExit("quality_study: --horizons must be positive")
    families = [f.strip() for f in args.optimizers.split(",") if f.strip()]
    for family in families:
        if family not in FAMILIES:
            raise SystemExit(f"quality_study: --optimizers: unknown {family!r}; expected some of {tuple(FAMILIES)}")
    fractions = list(dict.fromkeys(floats(args.fraction, "--fraction")))
    if any(not 0.0 < f <= 1.0 for f in fractions):
        raise SystemExit(f"quality_study: --fraction values must lie in (0, 1], got {args.fraction!r}")
    allocations = list(dict.fromkeys(a.strip() for a in args.fraction_allocation.split(",") if a.strip()))
    if not allocations or any(a not in FRACTION_ALLOCATIONS for a in allocations):
        raise SystemExit(f"quality_study: --fraction-allocation expects some of {FRACTION_ALLOCATIONS}, "
                         f"got {args.fraction_allocation!r}")
    row_scores = list(dict.fromkeys(s.strip() for s in args.row_score.split(",") if s.strip()))
    if not row_scores or any(s not in ROW_SCORES for s in row_scores):
        raise SystemExit(f"quality_study: --row-score expects some of {ROW_SCORES}, got {args.row_score!r}")
    weightings = list(dict.fromkeys(fraction_weights_spec(text) for text in args.fraction_weights))
    decays, fulls = unselected_decays(args.unselected_decay), full_every_steps(args.full_every)
    if any(weightings) and not set(allocations) <= set(BY_COST):
        raise SystemExit("quality_study: --fraction-weights weigh the rows of fractions by cost: use it with "
                         "--fraction-allocation cost and/or most_rows alone")
    check_schedule(args)
    model = MODELS[args.model]
    common = dict(model=args.model, batch_size=args.batch_size or model.batch_size, lr_warmup=args.lr_warmup,
                  cooldown=args.cooldown, eval_batches=args.eval_batches, data=tuple(args.data) if args.data else None,
                  read_once=not args.allow_repeat, captured=args.captured, compiled=args.compile)
    if args.repeats < 1:
        raise SystemExit(f"quality_study: --repeats must be ≥ 1, got {args.repeats}")
    runs = []
    for horizon, seed in itertools.product(horizons, seeds):
        for family in (f for f in FAMILIES if f != "dion3" and f in families):
            lrs = learning_rates(getattr(args, f"{family}_lr"), f"--{family}-lr")
            mus = momenta(getattr(args, f"{family}_mu"), f"--{family}-mu") if FAMILIES[family][1] else [0.0]
            for lr, mu in itertools.product(lrs, mus):
                runs.append(Run(optimizer=family, lr=lr, mu=mu, fraction=None, fraction_warmup=0, horizon=horizon, seed=seed, **common))
        if "dion3" in families:
            warmups = [warmup_steps(w, horizon) for w in args.fraction_warmup.split(",") if w.strip()]
            for fraction, lr, mu, warm, allocation, score, weighting, decay, full in itertools.product(
                    fractions, learning_rates(args.dion3_lr, "--dion3-lr"), momenta(args.dion3_mu, "--dion3-mu"),
                    dict.fromkeys(warmups), allocations, row_scores, weightings, decays, fulls):
                runs.append(Run(optimizer="dion3", lr=lr, mu=mu, fraction=fraction, fraction_warmup=warm,
                                horizon=horizon, seed=seed, fraction_allocation=allocation,
                                cost_rule=COST_RULE if allocation in BY_COST else None, row_score=score,
                                fraction_weights=weighting, unselected_decay=decay, full_every=full, **common))
    runs = with_ns_schedules(runs, ns_schedules(args.ns_coefficients))
    runs = with_momentum_dtypes(runs, momentum_dtypes(args.momentum_dtype))
    return [dataclasses.replace(run, repeat=r) for run in runs for r in range(args.repeats)]


def best_on_shared_seeds(losses: Sequence[dict[int, float]]) -> tuple[int, float]:
    """(index, mean) of the best of several settings of one variant, each given as its loss per seed:
    the lowest mean over the seeds that every setting has, so that a seed-0 sweep whose winner then
    ran more seeds is judged on seed 0 (a one-seed setting never beats a three-seed mean by drawing
    one lucky seed); over each setting's own seeds when they share none."""
    shared = set.intersection(*(set(by_seed) for by_seed in losses))
    means = [statistics.fmean(loss for seed, loss in by_seed.items() if not shared or seed in shared) for by_seed in losses]
    index = min(range(len(means)), key=means.__getitem__)
    return index, means[index]


def plan_best_runs(args: argparse.Namespace, records: Sequence[dict]) -> list[Run]:
    """The best setting of each family (and of each Dion3 variant: fraction, warm-up, allocation)
    among `records` at horizon --best-at, compiled or not as --compile says, run again at
    --horizons with --seeds; every other field (lr, μ, batch, schedules, data) is the best run's
    own. Best: the lowest mean final validation loss over the seeds that every setting of the
    variant has (a seed-0 sweep whose winner then ran more seeds is judged on seed 0), or over
    each setting's own seeds when they share none. Families: --optimizers, each once per schedule
    of --ns-coefficients; Dion3 variants: those of --fraction, --fraction-warmup (in steps),
    --fraction-allocation, --row-score, --unselected-decay and --full-every. Runs by cost of another rule than COST_RULE (the FLOP
    rule's, cost_rule None) are left out: rerun now, they would allocate by COST_RULE."""
    families = [f.strip() for f in args.optimizers.split(",") if f.strip()]
    fractions = set(floats(args.fraction, "--fraction"))
    warmups = set(ints(args.fraction_warmup, "--fraction-warmup"))
    allocations = {a.strip() for a in args.fraction_allocation.split(",") if a.strip()}
    scores = {s.strip() for s in args.row_score.split(",") if s.strip()}
    decays, fulls = set(unselected_decays(args.unselected_decay)), set(full_every_steps(args.full_every))
    schedules = set(ns_schedules(args.ns_coefficients))
    by_setting: dict[tuple, tuple[Run, dict[int, float]]] = {}  # setting → (a run of it, loss per seed)
    for record in records:
        run = Run(**{**record["config"], "data": tuple(record["config"]["data"]) if record["config"]["data"] else None})
        if (run.model != args.model or run.horizon != args.best_at or run.optimizer not in families
                or run.compiled != args.compile or run.momentum_dtype is not None  # best judged in float32
                or run.batch_size != (args.batch_size or MODELS[args.model].batch_size)  # and at the batch asked for
                or (run.optimizer != "adamw" and run.ns_coefficients not in schedules)):
            continue
        if run.optimizer == "dion3" and (run.fraction not in fractions or run.fraction_warmup not in warmups
                                         or run.fraction_allocation not in allocations or run.row_score not in scores
                                         or run.unselected_decay not in decays or run.full_every not in fulls):
            continue
        if run.fraction_allocation in BY_COST and run.cost_rule != COST_RULE:
            continue  # another rule's fractions: this code would rerun it under COST_RULE, another setting
        if math.isfinite(record["final_val_loss"]) and not record.get("nonfinite_parameters"):
            by_setting.setdefault(run.setting, (run, {}))[1][run.seed] = record["final_val_loss"]
    variants: dict[tuple, list[tuple[Run, dict[int, float]]]] = {}
    for run, losses in by_setting.values():
        variant = (run.optimizer, run.fraction, run.fraction_warmup, run.fraction_allocation, run.row_score,
                   run.fraction_weights, run.ns_coefficients, run.unselected_decay, run.full_every)
        variants.setdefault(variant, []).append((run, losses))
    best: dict[tuple, tuple[float, Run]] = {}
    for variant, settings in variants.items():
        index, mean = best_on_shared_seeds([losses for _, losses in settings])
        best[variant] = (mean, settings[index][0])
    if not best:
        raise SystemExit(f"quality_study: --best-from holds no finite {args.model} run at horizon {args.best_at} "
                         f"of {families} (and the Dion3 variants asked for)")
    horizons, seeds = sorted(set(ints(args.horizons, "--horizons"))), ints(args.seeds, "--seeds")
    ranked = sorted(best.values(), key=lambda item: item[0])
    for mean, run in ranked:
        print(f"best at {args.best_at} steps: {run.label.rsplit(' h=', 1)[0]} (mean {mean:.4f})", flush=True)
    best_runs = [dataclasses.replace(run, horizon=h, seed=s, repeat=0) for h in horizons for s in seeds for _, run in ranked]
    return with_momentum_dtypes(best_runs, momentum_dtypes(args.momentum_dtype))


