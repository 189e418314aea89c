"""Dion3's row fraction as a schedule: `fraction` is a group value that may change between steps,
like `lr`, and `FractionScheduler` sets it from a function of the step count.

    optimizer = Dion3(groups, fraction=0.25)
    scheduler = FractionScheduler(optimizer, FractionWarmup(target=0.25, steps=200))
    # or PeriodicFull(0.25, every=8): every row on every 8th step, ¼ on the others
    for batch in data:
        loss(batch).backward()
        optimizer.step()
        scheduler.step()            # after optimizer.step(), like torch.optim.lr_scheduler
        optimizer.zero_grad()

The k of each matrix is max(1, ⌈f·rows⌉) with the fraction current at that step; nothing else in
the step depends on the fraction. Over groups by cost the schedule gives their budget, and each
group's fraction is that budget's allocation by cost (budget_schedule).

Under DDP/FSDP2 every rank must select the same k: the schedule is a deterministic function of the
step count (and the allocation by cost a pure function of the shapes and the budget), and the
scheduler checks once, when it is built and when its state is loaded (one small all-reduce), that
every rank has the same position and the same schedule values; the steps add no collective.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..distributed.mesh import local_tensor
from .budget_schedule import budget_allocation
from .validation import BUDGET_KEY, SELECTING_ALGORITHMS, check_range

# Steps ahead of the current one at which ranks compare their schedules (one collective, once).
PROBE_OFFSETS = (0, 1, 10, 100, 1000, 10000, 100000)


@dataclass(frozen=True)
class FractionWarmup:
    """A linear fraction schedule: `start` at step 0 to `target` at step `steps`, then `target`.

    levels: round the fraction to `levels` equally spaced values from start to target (nearest
    one), so that the step sees only a few distinct k per matrix: what a CUDA-graph-captured step
    needs (one graph per distinct k, docs/training.md). None: change every step.
    """

    target: float
    steps: int
    start: float = 1.0
    levels: Optional[int] = None

    def __post_init__(self):
        for name in ("target", "start"):
            check_range("FractionWarmup", name, getattr(self, name), 0.0, 1.0, low_open=True)
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"FractionWarmup: steps must be an integer ≥ 0, got {self.steps!r}")
        if self.levels is not None and (not isinstance(self.levels, int) or isinstance(self.levels, bool) or self.levels < 2):
            raise ValueError(f"FractionWarmup: levels must be None or an integer ≥ 2, got {self.levels!r}")

    def __call__(self, step: int) -> float:
        if step >= self.steps:
            return self.target
        progress = step / self.steps
        if self.levels is not None:
            progress = math.floor(progress * (self.levels - 1) + 0.5) / (self.levels - 1)
        if progress == 1.0:  # rounded up to the last level: exactly the target
            return self.target
        return self.start + (self.target - self.start) * progress


@dataclass(frozen=True)
class PeriodicFull:
    """Every row on every `every`-th step, `fraction` on the others: steps every − 1, 2·every − 1,
    … (counted from 0) return 1, which orthogonalizes every row of every matrix (over groups by
    cost: budget 1, the same). A run then spends fraction + (1 − fraction)/every of the rows on
    average, and a full step now and then updates rows the selection keeps passing over.

    fraction: a number in (0, 1], or a schedule of the step (e.g. FractionWarmup) for the other
    steps. With a fixed fraction the step sees two sets of k: a captured step keeps two graphs.
    """

    fraction: Union[float, Callable[[int], float]]
    every: int

    def __post_init__(self):
        if not callable(self.fraction):
            check_range("PeriodicFull", "fraction", self.fraction, 0.0, 1.0, low_open=True)
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"PeriodicFull: every must be an integer ≥ 1, got {self.every!r}")

    def full(self, step: int) -> bool:
        """Whether step (counted from 0) orthogonalizes every row."""
        return step % self.every == self.every - 1

    def __call__(self, step: int) -> float:
        if self.full(step):
            return 1.0
        return self.fraction(step) if callable(self.fraction) else self.fraction


def _check_one_fraction(optimizer: torch.optim.Optimizer, groups: Sequence[int]) -> None:
    """The groups a scheduler picks itself must hold one fraction: one schedule would replace theirs."""
    held = {i: optimizer.param_groups[i].get("fraction") for i in groups}
    if len(set(held.values())) > 1:
        listed = ", ".join(f"group {i}: {f}" for i, f in held.items())
        raise ValueError(f"FractionScheduler: the Dion3 groups hold different fractions ({listed}); a schedule sets "
                         "one fraction on every group it schedules and would replace them. Pass groups=[...] to "
                         "schedule chosen groups on purpose; for fractions per shape under a schedule, build the "
                         "groups with param_groups(..., fraction_allocation='cost'), whose budget a schedule sets")


class FractionScheduler:
    """Set the `fraction` of Dion3 groups from `schedule(step)` (the fraction itself, in (0, 1];
    over groups by cost, their budget).

    Like torch.optim.lr_scheduler: building it applies schedule(0); each `step()` (called after
    `optimizer.step()`) advances the count and applies the next value. groups: indices of the
    parameter groups to schedule (default: every group whose algorithm is "dion3" or "dion2",
    which must hold one fraction unless they are by cost).

    Groups by cost (param_groups(..., fraction_allocation="cost")): schedule(step) is their
    budget, and each group gets the fraction that the allocation by cost gives its shape at that
    budget (budget_schedule); the scheduled groups must then all be by cost, from one budget.

    Checkpoints: save `scheduler.state_dict()` with the optimizer's; to resume, build the
    optimizer and the scheduler as before, then `optimizer.load_state_dict(...)` and
    `scheduler.load_state_dict(...)` (the order of torch's LR schedulers). Loading re-applies
    the schedule at the saved position, so either order gives the same next step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float],
                 groups: Optional[Sequence[int]] = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FractionScheduler needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(schedule):
            raise TypeError(f"FractionScheduler: schedule must be a callable of the step count, got {type(schedule).__name__}")
        chosen = groups is None
        if chosen:
            groups = [i for i, g in enumerate(optimizer.param_groups) if g.get("algorithm") in SELECTING_ALGORITHMS]
            if not groups:
                raise ValueError("FractionScheduler: the optimizer has no parameter group with algorithm 'dion3' or 'dion2'")
        groups = list(groups)
        for index in groups:
            if not isinstance(index, int) or not 0 <= index < len(optimizer.param_groups):
                raise ValueError(f"FractionScheduler: groups holds {index!r}, not a parameter group index "
                                 f"(the optimizer has {len(optimizer.param_groups)})")
            algorithm = optimizer.param_groups[index].get("algorithm")
            if algorithm not in SELECTING_ALGORITHMS:
                raise ValueError(f"FractionScheduler: parameter group {index} has algorithm {algorithm!r}; "
                                 "only 'dion3' and 'dion2' groups have a fraction")
        # groups by cost: the schedule gives their budget, and the allocation each group's fraction
        self._allocation = budget_allocation(optimizer, groups)
        if self._allocation is None and chosen:
            _check_one_fraction(optimizer, groups)
        self.optimizer = optimizer
        self.schedule = schedule
        self.groups = groups
        self.last_step = 0  # the step whose fraction is set now (optimizer steps taken so far)
        self._apply()
        self._check_ranks_agree()

    def fraction_at(self, step: int) -> float:
        """schedule(step) as a float, or a ValueError naming the groups it would be set on."""
        value = self.schedule(step)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        names = ", ".join(map(str, self.groups))
        check_range(f"parameter group{'s' if len(self.groups) > 1 else ''} {names} (fraction schedule at step {step})",
                    "fraction", value, 0.0, 1.0, low_open=True)
        return value

    def _apply(self) -> None:
        value = self.fraction_at(self.last_step)
        if self._allocation is None:
            for index in self.groups:
                self.optimizer.param_groups[index]["fraction"] = value
            return
        for index, fraction in zip(self.groups, self._allocation.fractions(value)):
            group = self.optimizer.param_groups[index]
            group["fraction"], group[BUDGET_KEY] = fraction, value

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_fraction(self) -> list[float]:
        """The fraction of each scheduled group now (for logging)."""
        return [self.optimizer.param_groups[i]["fraction"] for i in self.groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "groups": list(self.groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step = state_dict.get("last_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"FractionScheduler state dict: 'last_step' must be an integer ≥ 0, got {step!r}")
        if list(state_dict.get("groups", self.groups)) != self.groups:
            raise ValueError(f"FractionScheduler state dict schedules groups {state_dict['groups']}, this "
                             f"scheduler schedules {self.groups}; the state dict does not match")
        self.last_step = step
        self._apply()
        self._check_ranks_agree()

    def _probe(self, step: int) -> float:
        """schedule(step) for comparison only: a schedule need not be valid past the run's end."""
        try:
            value = float(self.schedule(step))
        except Exception:  # noqa: BLE001 - any failure compares as the same sentinel on every rank
            return -1.0
        return value if math.isfinite(value) else -1.0

    def _check_ranks_agree(self) -> None:
        """Distributed optimizers: one all-reduce comparing the position and the schedule's values
        a few steps ahead on every rank; a ValueError on every rank if any differs (so none hangs
        in a step whose collectives would not match)."""
        mesh = getattr(self.optimizer, "_mesh", None)
        if mesh is None:
            return
        values = [float(self.last_step)] + [self._probe(self.last_step + ahead) for ahead in PROBE_OFFSETS]
        device = local_tensor(self.optimizer.param_groups[self.groups[0]]["params"][0]).device
        both = torch.tensor(values + [-v for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=mesh.group)
        low, high = both[: len(values)].tolist(), [-v for v in both[len(values):].tolist()]
        if low != high:
            raise ValueError(
                f"FractionScheduler: ranks disagree on the fraction schedule (step count {low[0]:g}..{high[0]:g}, "
                f"fractions from {low[1:]} to {high[1:]} at steps {[self.last_step + a for a in PROBE_OFFSETS]}); "
                "every rank must select the same k: give every rank the same schedule and the same scheduler state"
            )
