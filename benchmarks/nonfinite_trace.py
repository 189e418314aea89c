"""Records every orthogonalization of a training run and keeps the inputs of the bad ones, so
that a step whose update goes wrong can be replayed exactly (on the GPU or the CPU).

quality_study.py installs it in each run when given --trace DIR (environment variable
DION3_TRACE_ORTHOGONALIZE). Per call it measures ‖O‖_F / √min(rows, cols): Newton–Schulz
output has singular values in about [0.7, 1.2], so the ratio stays near or below 1; above
RATIO_LIMIT, or not finite, the call's input, output and arguments go to
DIR/<run>-<n>.pt (at most KEEP per run). DIR/<run>.jsonl gets one line per 1000 calls and per
bad call: the largest ratio seen so far; a last line when the run ends.

It also wraps the optimizer's step: it keeps a copy of every parameter, gradient and state
tensor (and the groups' lr and fraction) from before each step, and after the first step that
leaves a parameter not finite, or whose update the optimizer skipped, it writes that copy to
DIR/<run>-step<N>.pt with the names of the parameters whose gradients or values were not finite
and the number of skipped updates: the failing step, ready to replay (replay_step.py). It syncs
with the host on every call and step: a debugging tool, not for timing.
"""
from __future__ import annotations

import atexit
import json
import math
from pathlib import Path

import torch

RATIO_LIMIT = 1.5
KEEP = 4


def install(folder: Path, run: str) -> None:
    from dion3 import rules

    original = rules.orthogonalize
    state = {"calls": 0, "kept": 0, "worst": 0.0}
    log = folder / f"{run}.jsonl"

    def write(line: dict) -> None:
        with open(log, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def traced(x, method="auto", coefficients="polar_express", *args, **kwargs):
        out = original(x, method, coefficients, *args, **kwargs)
        state["calls"] += 1
        n = min(out.shape[-2:])
        ratios = torch.linalg.vector_norm(out.reshape(-1, *out.shape[-2:]).float(), dim=(-2, -1)) / math.sqrt(n)
        worst = float(torch.nan_to_num(ratios, nan=math.inf).max())
        state["worst"] = max(state["worst"], worst)
        bad = not math.isfinite(worst) or worst > RATIO_LIMIT
        if bad and state["kept"] < KEEP:
            state["kept"] += 1
            torch.save({"input": x.detach().cpu(), "output": out.detach().cpu(), "method": method,
                        "coefficients": coefficients, "args": args,
                        "kwargs": {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items()},
                        "ratios": ratios.cpu(), "call": state["calls"]},
                       folder / f"{run}-{state['kept']}.pt")
        if bad or state["calls"] % 1000 == 0:
            write({"call": state["calls"], "worst_so_far": state["worst"], "this": worst, "shape": list(x.shape),
                   "dtype": str(x.dtype), "method": method, "bad": bad})
        return out

    rules.orthogonalize = traced
    _wrap_step(folder, run, write)
    atexit.register(lambda: write({"calls": state["calls"], "worst": state["worst"], "kept": state["kept"], "end": True}))


def step_classes() -> list:
    """The optimizer classes whose own `step` to wrap: the base class, and every subclass that
    torch.optim.Optimizer has already given a `step` of its own (its profiling hook wraps the
    base class's step as it was when the first instance was built)."""
    from dion3.optim.base import OrthogonalOptimizer

    classes, todo = [], [OrthogonalOptimizer]
    while todo:
        cls = todo.pop()
        if "step" in cls.__dict__:
            classes.append(cls)
        todo += cls.__subclasses__()
    return classes


def _wrap_step(folder: Path, run: str, write) -> None:
    state = {"step": 0, "dumped": False}
    for cls in step_classes():
        cls.step = _traced_step(cls.__dict__["step"], state, folder, run, write)


def _traced_step(original, state: dict, folder: Path, run: str, write):

    def names(optimizer) -> dict:
        return {id(p): f"group{g}.param{i}{tuple(p.shape)}" for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])}

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        before = None
        if not state["dumped"]:
            before = {
                "params": [p.detach().clone() for p in params],
                "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
                "state": [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in self.state[p].items()} for p in params],
                "groups": [{k: (float(v) if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in g.items() if k != "params"}
                           for g in self.param_groups],
                "group_sizes": [len(g["params"]) for g in self.param_groups],
                "optimizer": type(self).__name__,
                "step": state["step"],
            }
        skipped_before = int(self.nonfinite_updates)
        result = original(self, closure)
        state["step"] += 1
        if before is not None:
            label = names(self)
            bad_values = [label[id(p)] for p in params if not bool(torch.isfinite(p).all())]
            skipped = int(self.nonfinite_updates) - skipped_before  # the optimizer's guard caught one
            if bad_values or skipped:
                bad_grads = [label[id(p)] for p, g in zip(params, before["grads"]) if g is not None and not bool(torch.isfinite(g).all())]
                before.update(bad_params=bad_values, bad_grads=bad_grads, skipped=skipped)
                torch.save({k: _to_cpu(v) for k, v in before.items()}, folder / f"{run}-step{before['step']}.pt")
                write({"nonfinite_step": before["step"], "bad_params": bad_values, "bad_grads": bad_grads, "skipped": skipped})
                state["dumped"] = True
        return result

    return step


def _to_cpu(value):
    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
