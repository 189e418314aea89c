"""Records every orthogonalization of a training run and keeps the inputs of the bad ones, so
that a step whose update goes wrong can be replayed exactly (on the GPU or the CPU).

quality_study.py installs it in each run when given --trace DIR (environment variable
DION3_TRACE_ORTHOGONALIZE). Each orthogonalization's input (copied) and output are held on the
device until the end of the optimizer step; then one host sync per step measures, per matrix,
‖O‖_F / √min(rows, cols) (Newton–Schulz output has singular values in about [0.7, 1.2], so the
ratio stays near or below 1), the optimizer's skipped-update counter and the finiteness of
every parameter. A matrix whose ratio is above RATIO_LIMIT or not finite goes to
DIR/<run>-<n>.pt (at most KEEP per run): its input, output and the call's arguments, only
that matrix of the batch (a few MB at most). DIR/<run>.jsonl gets one line per 100 steps and
per bad step, and a last line when the run ends. No sync inside the step: the step runs as it
would untraced (streams included).

With DION3_TRACE_FULL_STEP=1 it also keeps a copy of every parameter, gradient and state tensor
(and the groups' lr and fraction) from before each step, and after the first step that leaves a
parameter not finite, or whose update the optimizer skipped, writes it to DIR/<run>-step<N>.pt
with the names of the parameters whose gradients or values were not finite: the failing step,
ready to replay (replay_step.py). Large (the whole model's state): for local debugging.
DION3_TRACE_KEEP_BATCH=1 keeps the whole batch of each kept call too (<run>-<n>-batch.pt), and
DION3_TRACE_FILL_NAN=1 makes every new tensor start as NaN (torch's deterministic mode with
fill_uninitialized_memory): an output element that no kernel writes then shows up.
DION3_TRACE_FULL_FP16_REDUCTION=1 turns off cuBLAS's reduced-precision reductions in half
precision products (an arm of a stress test).
"""
from __future__ import annotations

import atexit
import json
import math
import os
from pathlib import Path

import torch

RATIO_LIMIT = 1.5
KEEP = 4
FULL_STEP_ENV = "DION3_TRACE_FULL_STEP"
BATCH_ENV = "DION3_TRACE_KEEP_BATCH"  # also keep the whole batch of a bad call (<run>-<n>-batch.pt)
FILL_NAN_ENV = "DION3_TRACE_FILL_NAN"  # new tensors start as NaN: output no kernel writes shows up
OPS_ENV = "DION3_TRACE_OPS"  # record every operation inside Newton–Schulz (op_trace.py)
# cuBLAS half-precision products with full-precision reductions (torch's default allows reduced)
FULL_REDUCTION_ENV = "DION3_TRACE_FULL_FP16_REDUCTION"


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def install(folder: Path, run: str) -> None:
    from dion3 import rules

    original = rules.orthogonalize
    state = {"calls": 0, "kept": 0, "worst": 0.0, "steps": 0, "held": [], "dumped": False}
    log = folder / f"{run}.jsonl"

    def write(line: dict) -> None:
        with open(log, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def traced(x, method="auto", coefficients="polar_express", *args, **kwargs):
        recorder = state["ops"]
        if recorder is not None:
            recorder.call = state["calls"] + 1
        out = original(x, method, coefficients, *args, **kwargs)
        if recorder is not None:
            recorder.call = None
        state["calls"] += 1
        state["held"].append((x.detach().clone(), out.detach(), method, coefficients, args, kwargs, state["calls"]))
        return out

    rules.orthogonalize = traced
    full = _flag(FULL_STEP_ENV)
    state["keep_batch"] = _flag(BATCH_ENV)
    state["ops"] = None
    if _flag(OPS_ENV):
        import op_trace  # beside this file

        state["ops"] = op_trace.OpRecorder()
    if _flag(FULL_REDUCTION_ENV):
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if _flag(FILL_NAN_ENV):
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    for cls in step_classes():
        cls.step = _traced_step(cls.__dict__["step"], state, folder, run, write, full)
    atexit.register(lambda: write({"calls": state["calls"], "steps": state["steps"], "worst": state["worst"],
                                   "kept": state["kept"], "end": True}))


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


def matrix_ratios(out: torch.Tensor) -> torch.Tensor:
    """‖O‖_F / √min(rows, cols) per matrix of a [..., rows, cols] output (inf where not finite)."""
    n = min(out.shape[-2:])
    ratios = torch.linalg.vector_norm(out.reshape(-1, *out.shape[-2:]).float(), dim=(-2, -1)) / math.sqrt(n)
    return torch.nan_to_num(ratios, nan=math.inf)


def _keep_bad_calls(state: dict, ratios: list, folder: Path, run: str, write) -> list:
    """Write the bad matrices of this step's calls; returns their descriptions."""
    bad = []
    for (x, out, method, coefficients, args, kwargs, call), per_matrix in zip(state["held"], ratios):
        for index, ratio in enumerate(per_matrix):
            if math.isfinite(ratio) and ratio <= RATIO_LIMIT:
                continue
            bad.append({"call": call, "matrix": index, "ratio": ratio, "shape": list(x.shape[-2:]),
                        "dtype": str(x.dtype), "method": method, "input_finite": bool(torch.isfinite(x.reshape(-1, *x.shape[-2:])[index]).all())})
            if state["kept"] < KEEP:
                state["kept"] += 1
                if state["keep_batch"]:
                    torch.save({"input": x.cpu(), "output": out.cpu(), "method": method, "coefficients": coefficients,
                                "args": args, "kwargs": {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items()},
                                "call": call, "step": state["steps"]}, folder / f"{run}-{state['kept']}-batch.pt")
                torch.save({"input": x.reshape(-1, *x.shape[-2:])[index:index + 1].cpu(),
                            "output": out.reshape(-1, *out.shape[-2:])[index:index + 1].cpu(),
                            "method": method, "coefficients": coefficients, "args": args,
                            "kwargs": {k: (v.reshape(-1, 1, 1)[index:index + 1].cpu() if torch.is_tensor(v) and v.numel() > 1
                                           else (v.cpu() if torch.is_tensor(v) else v)) for k, v in kwargs.items()},
                            "ratios": torch.tensor([ratio]), "call": call, "step": state["steps"]},
                           folder / f"{run}-{state['kept']}.pt")
    return bad


def _traced_step(original, state: dict, folder: Path, run: str, write, full: bool):

    def names(optimizer) -> list:
        return [f"group{g}.param{i}{tuple(p.shape)}" for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])]

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        before = None
        if full and not state["dumped"]:
            before = {
                "params": [p.detach().clone() for p in params],
                "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
                "state": [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in self.state[p].items()} for p in params],
                "groups": [{k: (float(v) if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in g.items() if k != "params"}
                           for g in self.param_groups],
                "group_sizes": [len(g["params"]) for g in self.param_groups],
                "optimizer": type(self).__name__,
                "step": state["steps"],
            }
        skipped_before = self.nonfinite_updates.clone()
        grads_finite = torch.stack([torch.isfinite(p.grad).all() if p.grad is not None else torch.ones((), dtype=torch.bool, device=p.device)
                                    for p in params]) if params else None
        result = original(self, closure)
        # one host sync for the whole step: ratios of every call, skipped updates, finiteness
        per_call = [matrix_ratios(out) for _, out, *_ in state["held"]]
        sizes = [r.numel() for r in per_call]
        finite = torch.stack([torch.isfinite(p).all() for p in params]) if params else torch.ones(0, dtype=torch.bool)
        skipped = (self.nonfinite_updates - skipped_before).reshape(1).float()
        flat = torch.cat([*(r.to(skipped.device) for r in per_call), skipped,
                          finite.to(skipped.device).float(), grads_finite.to(skipped.device).float()]).tolist()
        ratios, offset = [], 0
        for size in sizes:
            ratios.append(flat[offset:offset + size])
            offset += size
        skipped = int(flat[offset])
        finite = flat[offset + 1:offset + 1 + len(params)]
        grads_ok = flat[offset + 1 + len(params):]
        worst = max((max(r) for r in ratios if r), default=0.0)
        state["worst"] = max(state["worst"], worst)
        label = names(self)
        bad_values = [label[i] for i, ok in enumerate(finite) if not ok]
        bad_grads = [label[i] for i, ok in enumerate(grads_ok) if not ok]
        bad_calls = _keep_bad_calls(state, ratios, folder, run, write) if worst > RATIO_LIMIT or not math.isfinite(worst) else []
        if bad_calls and state["ops"] is not None:
            for item in bad_calls[:2]:
                found = state["ops"].first_bad(item["call"], item["matrix"])
                line = {"op_trace_call": item["call"], "matrix": item["matrix"], "first_bad_op": found["first_bad_op"],
                        "position": found.get("position"), "sizes": found["sizes"], "audit": found["audit"]}
                if found["record"] is not None:
                    line.update(state["ops"].rerun(found["record"], item["matrix"]))
                write(line)
        if state["ops"] is not None:
            state["ops"].clear()
        if bad_values or skipped or bad_calls or bad_grads:
            fractions = [g.get("fraction") for g in self.param_groups]
            lrs = [float(g["lr"]) for g in self.param_groups]
            write({"nonfinite_step": state["steps"], "bad_params": bad_values, "bad_grads": bad_grads, "skipped": skipped,
                   "bad_calls": bad_calls, "fractions": fractions, "lrs": lrs})
            if before is not None and (bad_values or skipped):
                before.update(bad_params=bad_values, bad_grads=bad_grads, skipped=skipped)
                torch.save({k: _to_cpu(v) for k, v in before.items()}, folder / f"{run}-step{before['step']}.pt")
                state["dumped"] = True
        elif state["steps"] % 100 == 0:
            write({"step": state["steps"], "calls": state["calls"], "worst_so_far": state["worst"]})
        state["held"].clear()
        state["steps"] += 1
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
