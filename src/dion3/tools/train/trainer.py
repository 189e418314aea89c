"""One training run: build the model from a seed, train it with one optimizer on a fixed batch
order, evaluate on a fixed validation set, and time the optimizer step separately from the rest.

Times come from CUDA events on a GPU (no host sync inside the step) and from perf_counter on
the CPU. The first `TIMING_WARMUP` steps are left out of the per-step means (allocation, kernel
autotuning, lazy initialization). On a GPU the optimizer step can run as one captured CUDA graph
(optim.graph.CapturedStep), as a training loop that cares for speed would run it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ...optim import Dion3, FractionScheduler, FractionWarmup, PeriodicFull
from ...optim.graph import CapturedStep
from .data import TokenData, read_once_batches, train_batches, val_batches
from ...optim.cost_fractions import matrix_shapes, step_orthogonalize_flops
from ...optim.param_groups import param_groups
from .model import GPT, GPTConfig, padded_vocab

TIMING_WARMUP = 5


@dataclass(frozen=True)
class RunSpec:
    """One optimizer configuration of the comparison."""

    label: str  # e.g. "dion3 f=1/4"
    algorithm: str  # "adamw", "muon", "normuon", "dion3"
    lr: float  # matrix learning rate
    fraction: Optional[float] = None  # Dion3 only
    mu: Optional[float] = None  # momentum of the matrix group; None keeps the optimizer default
    fraction_warmup: int = 0  # Dion3 only: steps of a linear fraction warm-up from 1 to `fraction` (by cost: the budget)
    # Dion3 only: param_groups' fraction_allocation, "uniform" (`fraction` on every matrix), "cost" (one
    # group per matrix shape, fractions within the modeled H200 step time of the uniform `fraction`) or
    # "most_rows" (as "cost", the most rows that time buys)
    fraction_allocation: str = "uniform"
    momentum_dtype: Optional[str] = None  # the matrix group's momentum_dtype; None keeps the optimizer's (float32)
    row_score: Optional[str] = None  # Dion3 only: the selection score ("l1", "l2"); None keeps the optimizer's (l1)
    # Dion3 with fraction_allocation "cost" only: ((part of a parameter name, weight), ...), param_groups'
    # fraction_weights; None: every matrix's rows count once
    fraction_weights: Optional[tuple[tuple[str, float], ...]] = None
    # Muon/NorMuon/Dion3: the Newton–Schulz schedule's name (ns_coefficients); None keeps the optimizer's
    ns_coefficients: Optional[str] = None
    # Dion3 only: the decay of the momentum rows a step does not select (unselected_decay); None keeps 1
    unselected_decay: Optional[float] = None
    full_every: int = 0  # Dion3 only: every row on every full_every-th step (PeriodicFull); 0: never


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch_size: int
    eval_every: int
    eval_batches: int
    warmup_steps: int = 0
    cooldown_fraction: float = 0.4  # linear decay to 0 over this last share of the steps
    read_once: bool = False  # disjoint windows, no byte read twice (data.read_once_batches)

    def lr_multiplier(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        cooldown = max(1, int(self.steps * self.cooldown_fraction))
        return min(1.0, (self.steps - step) / cooldown)


@dataclass
class RunResult:
    label: str
    algorithm: str
    lr: float
    fraction: Optional[float]
    mu: Optional[float]
    fraction_warmup: int = 0
    eval_steps: list[int] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)  # training time so far, evals excluded
    val_losses: list[float] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    optimizer_ms: float = math.nan  # mean optimizer step time after warm-up
    optimizer_ms_median: float = math.nan  # median of the same steps
    average_fraction: Optional[float] = None  # Dion3: the fraction averaged over the steps (and rows, see train)
    fraction_allocation: str = "uniform"  # Dion3: RunSpec.fraction_allocation
    # Dion3: (least, greatest) fraction of any matrix group at any step; by cost the per-shape
    # fractions spread around the budget `fraction`, which average_fraction (weighted by rows) need not equal
    fraction_range: Optional[tuple[float, float]] = None
    optimizer_flops: float = 0.0  # executed orthogonalization FLOPs of all steps (fractions.step_orthogonalize_flops)
    total_ms: float = math.nan  # mean forward + backward + optimizer time after warm-up
    tokens_per_step: int = 0
    nonfinite_updates: int = 0  # matrix updates the optimizer skipped as not finite (optimizer.nonfinite_updates)
    skipped_update_steps: list[int] = field(default_factory=list)  # the steps (0-based) that skipped any
    nonfinite_parameters: int = 0  # parameters with a non-finite entry at the end of the run

    @property
    def final_val_loss(self) -> float:
        return self.val_losses[-1] if self.val_losses else math.nan

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / (self.total_ms / 1000.0) if self.total_ms > 0 else math.nan


class StepClock:
    """Pairs of (start, end) marks per step for the optimizer and for the whole step."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, list[tuple]] = {"optimizer": [], "total": []}

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, kind: str, start, end) -> None:
        self.marks[kind].append((start, end))

    def milliseconds(self, kind: str) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self.marks[kind]]
        return [(end - start) * 1000.0 for start, end in self.marks[kind]]


def bf16_autocast(device: torch.device, bf16: bool = True):
    """The context a training step runs its forward in: bf16 autocast on a GPU when asked, else none."""
    if bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_device(requested: str = "auto") -> torch.device:
    """"auto" → CUDA when available, else CPU; an explicit "cuda" without a GPU is an error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise ValueError(f"--device: {requested!r} is not a device name ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: only 'cpu', 'cuda[:N]' and 'auto' are supported, got {requested!r}")
    return device


def use_captured_step(device: torch.device, eager: bool = False) -> bool:
    """Whether to run the optimizer step as a captured CUDA graph: on a GPU unless eager steps
    are asked for; never on the CPU (there is no graph to capture)."""
    return device.type == "cuda" and not eager


def set_lr_multiplier(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """lr ← initial_lr · multiplier for every group; a tensor lr (a captured step reads it on
    the device) is filled in place, so the graph sees the new value."""
    for group in optimizer.param_groups:
        value = group["initial_lr"] * multiplier
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def build_optimizer(model: GPT, spec: RunSpec) -> Dion3:
    # Dion3, Muon and NorMuon share one front-end; each group names its algorithm, so the class
    # only supplies defaults that every group here overrides or does not read.
    options = {key: value for key, value in (("fraction", spec.fraction), ("mu", spec.mu),
                                             ("momentum_dtype", spec.momentum_dtype), ("row_score", spec.row_score),
                                             ("ns_coefficients", spec.ns_coefficients),
                                             ("unselected_decay", spec.unselected_decay))
               if value is not None}
    weights = None if spec.fraction_weights is None else dict(spec.fraction_weights)
    return Dion3(param_groups(model, lm_head=model.lm_head, algorithm=spec.algorithm, lr=spec.lr,
                              fraction_allocation=spec.fraction_allocation, fraction_weights=weights, **options))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]], device: torch.device, bf16: bool = True) -> float:
    model.eval()
    total = 0.0
    for inputs, targets in batches:
        with bf16_autocast(device, bf16):
            total += float(model(inputs.to(device), targets.to(device)))
    model.train()
    return total / len(batches)


def train(
    spec: RunSpec,
    model_config: GPTConfig,
    schedule: Schedule,
    data: TokenData,
    device: torch.device,
    seed: int = 0,
    bf16: bool = False,
    on_eval: Optional[Callable[[RunResult, int], None]] = None,
    on_step: Optional[Callable[[], None]] = None,
    on_optimizer: Optional[Callable[[torch.optim.Optimizer], None]] = None,
    model_factory: Callable[[GPTConfig], nn.Module] = GPT,
    captured: bool = False,
    compiled: bool = False,
) -> RunResult:
    """Train a freshly initialized model (same seed → same weights and batches) with `spec`.

    model_factory: builds the model from the config (vocabulary padded to the data's); the
    model maps (tokens, targets) to the mean loss and has an `lm_head` module.
    captured: run the optimizer step through CapturedStep (CUDA only; see use_captured_step);
    a fraction warm-up then runs its ramp eagerly and is captured once k settles; periodic full
    steps (spec.full_every) get a graph of their own beside the other steps'.
    compiled: the model's forward and backward through torch.compile (the optimizer step is not
    compiled); the same math with fused elementwise kernels, for throughput on a GPU.
    on_optimizer: called with the optimizer once it is built (e.g. to read its skip counter)."""
    config = dataclasses.replace(model_config, vocab_size=padded_vocab(data.vocab_size))
    torch.manual_seed(seed)
    model = model_factory(config).to(device)
    optimizer = build_optimizer(model, spec)
    if on_optimizer is not None:
        on_optimizer(optimizer)
    # parameters stay the model's own; only the calls go through the compiled wrapper
    forward = torch.compile(model, dynamic=False) if compiled else model
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    schedule_of_step = FractionWarmup(spec.fraction, spec.fraction_warmup) if spec.fraction_warmup else None
    if spec.full_every:  # every row on every full_every-th step, the warm-up's (or fixed) fraction between
        schedule_of_step = PeriodicFull(schedule_of_step or spec.fraction, every=spec.full_every)
    fraction_schedule = FractionScheduler(optimizer, schedule_of_step) if schedule_of_step else None
    # the fraction at each step, a mean over the Dion3 groups weighted by their matrix rows (one group: its fraction)
    fractions = []
    selecting = [(group, sum(s.rows * s.count for s in matrix_shapes(group["params"], group.get("flatten", False))))
                 for group in optimizer.param_groups if group.get("algorithm") == "dion3"]
    weights = [rows / sum(r for _, r in selecting) for _, rows in selecting]
    # executed orthogonalization FLOPs of a step, by the groups' fractions then: counted on the host
    step_flops: dict[tuple, float] = {}
    # Captured: lr lives in device tensors, and gradients are zeroed in place (not set to None)
    # so that each backward writes the buffers the graph reads, with no copy before a replay.
    optimizer_step = CapturedStep(optimizer) if captured else optimizer.step

    if schedule.read_once:
        batches = read_once_batches(data.train, schedule.batch_size, config.seq_len, seed, schedule.steps)
    else:
        batches = train_batches(data.train, schedule.batch_size, config.seq_len, seed)
    validation = val_batches(data.val, schedule.batch_size, config.seq_len, schedule.eval_batches)
    result = RunResult(spec.label, spec.algorithm, spec.lr, spec.fraction, spec.mu, spec.fraction_warmup,
                       tokens_per_step=schedule.batch_size * config.seq_len,
                       fraction_allocation=spec.fraction_allocation)
    held: set[float] = set()  # every fraction a Dion3 group held at a step
    clock = StepClock(device)
    elapsed = 0.0  # seconds of training so far, evaluations excluded
    # the skip counter after each step, copied on the device (no host sync): which steps skipped
    # updates is read once at the end, so a skipped update can be traced to its step
    skip_counts = torch.zeros(schedule.steps, dtype=torch.int64, device=device)

    def record_eval(step: int) -> None:
        result.eval_steps.append(step)
        result.eval_seconds.append(elapsed)
        result.val_losses.append(evaluate(forward, validation, device, bf16))
        if on_eval is not None:
            on_eval(result, step)

    record_eval(0)
    segment_start = time.perf_counter()
    for step in range(schedule.steps):
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        step_start = clock.mark()
        with bf16_autocast(device, bf16):
            loss = forward(inputs, targets)
        loss.backward()
        set_lr_multiplier(optimizer, schedule.lr_multiplier(step))
        optimizer_start = clock.mark()
        optimizer_step()
        step_end = clock.mark()
        skipped = optimizer.nonfinite_updates
        if skipped.device == skip_counts.device:  # else no group has a counter yet: nothing was skipped
            skip_counts[step].copy_(skipped)
        if selecting:
            fractions.append(sum(w * group["fraction"] for w, (group, _) in zip(weights, selecting)))
            held.update(group["fraction"] for group, _ in selecting)
        now = tuple(group.get("fraction") for group in optimizer.param_groups)
        if now not in step_flops:
            step_flops[now] = step_orthogonalize_flops(optimizer.param_groups)
        result.optimizer_flops += step_flops[now]
        if fraction_schedule is not None:
            fraction_schedule.step()
        optimizer.zero_grad(set_to_none=not captured)
        clock.add("optimizer", optimizer_start, step_end)
        clock.add("total", step_start, step_end)
        result.train_losses.append(loss.detach())
        if on_step is not None:
            on_step()
        done = step + 1
        if done % schedule.eval_every == 0 or done == schedule.steps:
            if device.type == "cuda":
                torch.cuda.synchronize()  # wall-clock up to here must include queued GPU work
            elapsed += time.perf_counter() - segment_start
            record_eval(done)
            segment_start = time.perf_counter()

    result.train_losses = [float(v) for v in result.train_losses]
    result.nonfinite_updates = int(optimizer.nonfinite_updates)
    counts = skip_counts.tolist()
    result.skipped_update_steps = [step for step, count in enumerate(counts) if count > (counts[step - 1] if step else 0)]
    result.nonfinite_parameters = sum(1 for p in model.parameters() if not bool(torch.isfinite(p).all()))
    if fractions:
        result.average_fraction = sum(fractions) / len(fractions)
        result.fraction_range = (min(held), max(held))
    for kind, attribute in (("optimizer", "optimizer_ms"), ("total", "total_ms")):
        times = clock.milliseconds(kind)
        kept = times[TIMING_WARMUP:] if len(times) > 2 * TIMING_WARMUP else times
        setattr(result, attribute, sum(kept) / len(kept))
        if kind == "optimizer":
            result.optimizer_ms_median = statistics.median(kept)
    return result
