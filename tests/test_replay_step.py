"""benchmarks/nonfinite_trace.py keeps the inputs of the first step whose update the optimizer
had to skip (or that left a weight non-finite), and of each bad orthogonalization;
benchmarks/replay_step.py replays them, in the recorded dtype and in float64, to the same
outcome."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

import dion3
from dion3 import rules
from dion3.optim.base import OrthogonalOptimizer

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_dumped_step_replays_to_the_same_skip(tmp_path, monkeypatch):
    trace, replay = _module("nonfinite_trace"), _module("replay_step")
    # install() patches these: monkeypatch restores them after the test. Dion3 gets a step of
    # its own from torch.optim once any Dion3 was built (in this process, earlier tests)
    dion3.Dion3([torch.nn.Parameter(torch.zeros(2, 2))])
    monkeypatch.setattr(rules, "orthogonalize", rules.orthogonalize)
    for cls in trace.step_classes():
        monkeypatch.setattr(cls, "step", cls.__dict__["step"])
    assert dion3.Dion3 in trace.step_classes() and OrthogonalOptimizer in trace.step_classes()
    monkeypatch.setenv(trace.FULL_STEP_ENV, "1")
    trace.install(tmp_path, "run")
    generator = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(8, 6, generator=generator)) for _ in range(2)]
    bias = torch.nn.Parameter(torch.zeros(6))
    optimizer = dion3.Dion3([dict(params=weights), dict(params=[bias], algorithm="adamw", lr=1e-3)], lr=0.05, fraction=0.5)
    for step in range(3):
        grads = [torch.randn(8, 6, generator=generator) for _ in weights]
        if step == 2:
            grads[1][5, 2] = float("inf")
        for w, g in zip(weights, grads):
            w.grad = g
        bias.grad = torch.randn(6, generator=generator)
        optimizer.step()
    assert int(optimizer.nonfinite_updates) == 1
    step = torch.load(tmp_path / "run-step2.pt", weights_only=False)
    assert step["bad_grads"] == ["group0.param1(8, 6)"] and step["skipped"] == 1 and step["bad_params"] == []
    for dtype in (None, torch.float64):
        again = replay.replay_step(step, torch.device("cpu"), dtype)
        assert again["nonfinite_grads"] == ["param1(8, 6)"] and again["skipped_updates"] == 1
        assert again["nonfinite_params"] == [] and len(again["orthogonalization_ratios"]) == 1
    call = torch.load(tmp_path / "run-1.pt", weights_only=False)
    # only the bad matrix of the batch is kept (matrix 1 of the step's one call)
    assert call["call"] == 3 and call["step"] == 2 and call["output"].shape[0] == 1
    assert not torch.isfinite(call["output"]).all()
    log = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    bad = [line for line in log if "nonfinite_step" in line][0]  # the replays above, traced too, come after
    assert bad["nonfinite_step"] == 2 and bad["skipped"] == 1 and bad["bad_calls"][0]["matrix"] == 1
    assert replay.replay_orthogonalization(call, torch.device("cpu"))["nonfinite"]


def test_op_trace_names_a_product_that_went_wrong_at_its_moment(tmp_path, monkeypatch):
    """With DION3_TRACE_OPS, a bad orthogonalization gets an audit of every operation inside
    Newton–Schulz: run again on its recorded operands, the one product that was corrupted once
    (a fault of the moment, here forced) differs from its recorded output while the others
    reproduce theirs, and every operand is traced to the operation that produced it."""
    import importlib

    newton_schulz = importlib.import_module("dion3.ortho.newton_schulz")
    monkeypatch.syspath_prepend(str(BENCH))
    trace = _module("nonfinite_trace")
    dion3.Dion3([torch.nn.Parameter(torch.zeros(2, 2))])
    monkeypatch.setattr(rules, "orthogonalize", rules.orthogonalize)
    monkeypatch.setattr(newton_schulz, "torch", newton_schulz.torch)
    for cls in trace.step_classes():
        monkeypatch.setattr(cls, "step", cls.__dict__["step"])
    calls = {"n": 0, "break_at": None}
    honest = newton_schulz.symmetric_matmul

    def once_wrong(*args, **kwargs):  # the 6th product of the armed step comes out corrupted, once
        out = honest(*args, **kwargs)
        calls["n"] += 1
        if calls["break_at"] is not None and calls["n"] == calls["break_at"]:
            out = out.clone()
            out[1] = out[1].flip(-1) * 40.0
        return out

    monkeypatch.setattr(newton_schulz, "symmetric_matmul", once_wrong)
    monkeypatch.setenv(trace.OPS_ENV, "1")
    trace.install(tmp_path, "run")
    generator = torch.Generator().manual_seed(1)
    weights = [torch.nn.Parameter(torch.randn(40, 12, generator=generator)) for _ in range(2)]
    optimizer = dion3.Dion3(weights, lr=0.05, fraction=0.5, orthogonalizer="gram")
    for step in range(2):
        for w in weights:
            w.grad = torch.randn(40, 12, generator=generator)
        if step == 1:
            calls["break_at"] = calls["n"] + 6
        optimizer.step()
    log = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    audit = [line for line in log if "op_trace_call" in line][0]
    assert audit["matrix"] == 1
    differences = [entry["rerun_relative_difference"] for entry in audit["audit"]]
    products = [i for i, entry in enumerate(audit["audit"]) if entry["op"] == "symmetric_matmul"]
    broken = products[5]
    assert differences[broken] > 1.0 and all(d < 1e-3 for i, d in enumerate(differences) if i != broken)
    # the chain: the first operation reads the call's input, every later one reads earlier outputs
    assert audit["audit"][0]["operands_from"] == ["input"]
    assert all(source != "input" for entry in audit["audit"][1:] for source in entry["operands_from"])
