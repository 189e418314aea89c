"""Records every orthogonalization of a training run and keeps the inputs of the bad ones, so
that a step whose update goes wrong can be replayed exactly (on the GPU or the CPU).

quality_study.py installs it in each run when given --trace DIR (environment variable
DION3_TRACE_ORTHOGONALIZE). Per call it measures ‖O‖_F / √min(rows, cols): Newton–Schulz
output has singular values in about [0.7, 1.2], so the ratio stays near or below 1; above
RATIO_LIMIT, or not finite, the call's input, output and arguments go to
DIR/<run>-<n>.pt (at most KEEP per run). DIR/<run>.jsonl gets one line per 1000 calls and per
bad call: the largest ratio seen so far; a last line when the run ends. It syncs with the host on every call: a debugging
tool, not for timing.
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
    atexit.register(lambda: write({"calls": state["calls"], "worst": state["worst"], "kept": state["kept"], "end": True}))
